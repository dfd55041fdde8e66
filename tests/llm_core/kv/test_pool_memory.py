from __future__ import annotations

import pytest
import torch

from llm_core.kv.pool_memory import zeroed_pool


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("shape", [(3, 2, 4), (1025, 8, 1024)], ids=["small", "huge-pages"])
def test_a_pool_is_zeros_of_its_shape_and_dtype(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    # Memory that held other values first: a pool must be zeros whatever the allocator reuses.
    garbage = torch.full(shape, 7.0).to(dtype)
    del garbage
    pool = zeroed_pool(shape, dtype, "cpu")
    assert pool.shape == shape and pool.dtype == dtype and pool.is_contiguous()
    assert not pool.view(torch.uint8).any()


def test_a_meta_pool_has_its_shape_and_no_memory() -> None:
    pool = zeroed_pool((4, 2, 8), torch.bfloat16, "meta")
    assert pool.is_meta and pool.shape == (4, 2, 8)
