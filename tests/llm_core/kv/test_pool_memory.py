"""KV pool memory: zeroed, and a large CPU pool resident only where written."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from llm_core.kv.pool_memory import check_fits_in_memory, zeroed


def _resident_mib() -> float:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("rows", [3, 70_000])  # under and over the size mapped on its own
def test_zeroed_is_zeros_of_the_shape_and_dtype(dtype: torch.dtype, rows: int) -> None:
    pool = zeroed((rows, 2, 8), dtype, "cpu")
    assert pool.shape == (rows, 2, 8) and pool.dtype == dtype and pool.is_contiguous()
    assert not pool.float().any()
    pool[-1] = 1.0
    assert pool.float().sum() == 16


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads resident memory from /proc")
def test_a_large_cpu_pool_is_resident_only_where_written() -> None:
    gc.collect()
    before = _resident_mib()
    pool = zeroed((64 << 20 >> 4, 4), torch.float32, "cpu")  # 64 MiB
    assert _resident_mib() - before < 8
    pool[: 1 << 18] = 1.0  # 4 MiB written
    assert 3 < _resident_mib() - before < 16
    del pool
    gc.collect()
    assert _resident_mib() - before < 4  # unmapped with the tensor


def test_pools_larger_than_the_available_memory_are_refused_at_start(tmp_path) -> None:  # noqa: ANN001
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       8000000 kB\nMemAvailable:      65536 kB\n")  # 64 MiB available
    pools = [zeroed((16 << 20 >> 2,), torch.float32, "cpu") for _ in range(3)]  # 48 MiB
    check_fits_in_memory(pools, meminfo)
    pools.append(zeroed((32 << 20 >> 2,), torch.float32, "cpu"))  # 80 MiB in all
    with pytest.raises(ValueError, match="need 80 MiB of host memory.*64 MiB available.*--kv-budget-mib"):
        check_fits_in_memory(pools, meminfo)
    check_fits_in_memory(pools, tmp_path / "missing")  # nothing to read: nothing checked
