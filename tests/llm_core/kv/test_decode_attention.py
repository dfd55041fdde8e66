"""The decode-only attention path (``DecodeBatch``): whole pages gathered, one
query per request, tensor-only metadata, against the reference."""

from __future__ import annotations

import random

import pytest
import torch

from llm_core.model.attention import attention_reference
from llm_core.kv.paged_attention import PagedBatch, paged_attention_torch, paged_decode_attention_torch


def make_decode_case(
    kv_lens: list[int], page_size: int, hq: int, hkv: int, d: int, dv: int, with_sinks: bool, seed: int = 0,
) -> tuple[torch.Tensor, ...]:
    """Requests whose last kv_len keys sit in shuffled pages; every slot not
    holding a key is NaN, so reading padding or a wrong slot shows."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    widest = max(-(-n // page_size) for n in kv_lens)
    num_pages = sum(-(-n // page_size) for n in kv_lens) + 3
    free = list(range(num_pages))
    rng.shuffle(free)
    pages = torch.zeros(len(kv_lens), widest, dtype=torch.int32)
    k_cache = torch.full((num_pages * page_size, hkv, d), float("nan"))
    v_cache = torch.full((num_pages * page_size, hkv, dv), float("nan"))
    for b, n in enumerate(kv_lens):
        own = [free.pop() for _ in range(-(-n // page_size))]
        pages[b, : len(own)] = torch.tensor(own)
        slots = (torch.tensor(own)[:, None] * page_size + torch.arange(page_size)).flatten()[:n]
        k_cache[slots] = torch.randn(n, hkv, d, generator=gen)
        v_cache[slots] = torch.randn(n, hkv, dv, generator=gen)
    q = torch.randn(len(kv_lens), hq, d, generator=gen)
    sinks = torch.randn(hq, generator=gen) if with_sinks else None
    return q, k_cache, v_cache, pages, sinks


def reference(q, k_cache, v_cache, pages, page_size, kv_len, q_pos, window, sinks) -> torch.Tensor:  # noqa: ANN001
    out = []
    for b in range(q.shape[0]):
        n = int(kv_len[b])
        slots = (pages[b].long()[:, None] * page_size + torch.arange(page_size)).flatten()[:n]
        pos = int(q_pos[b])
        k_pos = torch.arange(pos + 1 - n, pos + 1)
        out.append(attention_reference(q[b : b + 1], k_cache[slots], v_cache[slots], q_pos[b : b + 1], k_pos,
                                       window, sinks))
    return torch.cat(out)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("hq,hkv", [(2, 2), (4, 1)])
def test_decode_attention_matches_reference(page_size: int, window: int | None, with_sinks: bool, hq: int,
                                            hkv: int) -> None:
    kv_lens = [1, 7, 13, 4, 9]
    q, k_cache, v_cache, pages, sinks = make_decode_case(kv_lens, page_size, hq, hkv, 16, 8, with_sinks)
    kv_len = torch.tensor(kv_lens)
    q_pos = torch.tensor([0, 30, 12, 100, 8])  # keys are each request's last kv_len positions
    out = paged_decode_attention_torch(q, k_cache, v_cache, pages, page_size, kv_len, q_pos, window, sinks)
    assert torch.isfinite(out).all()
    ref = reference(q, k_cache, v_cache, pages, page_size, kv_len, q_pos, window, sinks)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_off_by_one_in_the_key_positions_is_caught() -> None:
    kv_lens = [6, 9]
    q, k_cache, v_cache, pages, sinks = make_decode_case(kv_lens, 4, 2, 1, 16, 8, True, seed=1)
    kv_len, q_pos = torch.tensor(kv_lens), torch.tensor([20, 8])
    ref = reference(q, k_cache, v_cache, pages, 4, kv_len, q_pos, None, sinks)
    assert torch.allclose(paged_decode_attention_torch(q, k_cache, v_cache, pages, 4, kv_len, q_pos, None, sinks), ref,
                          atol=1e-5)
    # One key too few (the oldest dropped), or the window one too narrow: both must show.
    fewer = paged_decode_attention_torch(q, k_cache, v_cache, pages, 4, kv_len - 1, q_pos, None, sinks)
    assert not torch.allclose(fewer, ref, atol=1e-3)
    narrower = paged_decode_attention_torch(q, k_cache, v_cache, pages, 4, kv_len, q_pos, 5, sinks)
    assert not torch.allclose(narrower, reference(q, k_cache, v_cache, pages, 4, kv_len, q_pos, 6, sinks), atol=1e-3)


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("hq,hkv", [(2, 2), (4, 1), (8, 2)])
def test_cpu_kernel_matches_the_torch_decode_path(page_size: int, window: int | None, with_sinks: bool, hq: int,
                                                  hkv: int) -> None:
    from llm_core.kv import cpu_kernels
    if not cpu_kernels.available():
        pytest.skip("no C++ compiler for the CPU kernel")
    kv_lens = [1, 7, 13, 4, 40, 9, 100]  # up to 100: several 32-key blocks and pages
    q, k_cache, v_cache, pages, sinks = make_decode_case(kv_lens, page_size, hq, hkv, 48, 32, with_sinks)
    kv_len = torch.tensor(kv_lens)
    q_pos = torch.tensor([0, 30, 12, 100, 39, 8, 200])
    ref = paged_decode_attention_torch(q, k_cache, v_cache, pages, page_size, kv_len, q_pos, window, sinks)
    for table in (pages, pages.long()):
        out = cpu_kernels.paged_decode_attention_cpu(q, k_cache, v_cache, table, page_size, kv_len, q_pos, window,
                                                       sinks)
        assert torch.isfinite(out).all()  # NaN slots are never read
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    half = cpu_kernels.paged_decode_attention_cpu(q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), pages,
                                                    page_size, kv_len, q_pos, window, sinks)
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), ref, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("with_sinks", [False, True])
def test_cpu_kernel_handles_scores_far_below_the_max(with_sinks: bool) -> None:
    """Keys scoring ~100 to ~1000 below the best (peaky trained heads) weigh
    nothing; they must never come out as garbage or NaN."""
    from llm_core.kv import cpu_kernels
    if not cpu_kernels.available():
        pytest.skip("no C++ compiler for the CPU kernel")
    kv_lens = [40, 70]
    q, k_cache, v_cache, pages, sinks = make_decode_case(kv_lens, 4, 4, 2, 16, 8, with_sinks, seed=3)
    q = q * 60.0  # scores spread over hundreds
    if sinks is not None:
        sinks = sinks * 200.0
    kv_len, q_pos = torch.tensor(kv_lens), torch.tensor(kv_lens) - 1
    ref = paged_decode_attention_torch(q, k_cache, v_cache, pages, 4, kv_len, q_pos, None, sinks)
    out = cpu_kernels.paged_decode_attention_cpu(q, k_cache, v_cache, pages, 4, kv_len, q_pos, None, sinks)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_engine_on_cpu_decodes_through_the_kernel_where_it_builds(hf_checkpoint) -> None:  # noqa: ANN001
    from llm_core import LLM
    from llm_core.kv import cpu_kernels
    from llm_core.kv.paged_attention import paged_decode_attention_torch as torch_path

    expected = cpu_kernels.paged_decode_attention_cpu if cpu_kernels.available() else torch_path
    extend = cpu_kernels.paged_attention_cpu if cpu_kernels.available() else paged_attention_torch
    auto, forced = LLM(hf_checkpoint).engine.runner, LLM(hf_checkpoint, attention="torch").engine.runner
    assert auto.decode_attention_fn is expected and auto.attention_fn is extend
    assert forced.decode_attention_fn is torch_path and forced.attention_fn is paged_attention_torch


@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("hq,hkv", [(2, 2), (4, 1), (8, 2)])
def test_cpu_extend_attention_matches_the_torch_path(window: int | None, with_sinks: bool, hq: int,
                                                     hkv: int) -> None:
    """Extend batches (prefill chunks after a prefix, keys trimmed to the
    window as SWA pools keep them, decode rows beside them) through the
    kernel's per-row path: each query row its request's pages, from its own
    offset into the flat table."""
    from llm_core.kv import cpu_kernels
    from tests.llm_core.attention_cases import MIXED, make_block_table_case, make_case

    if not cpu_kernels.available():
        pytest.skip("no C++ compiler for the CPU kernel")
    q, k_cache, v_cache, batch, sinks = make_case(MIXED, hq, hkv, 48, 32, torch.float32, with_sinks, "cpu")
    ref = paged_attention_torch(q, k_cache, v_cache, batch, window, sinks)
    out = cpu_kernels.paged_attention_cpu(q, k_cache, v_cache, batch, window, sinks)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    # Through a block table of shuffled pages (page_size 4) the same.
    requests = [(20, 1), (12, 5), (0, 37), (30, 37), (3, 1)]
    paged, listed, n_slots = make_block_table_case(requests, 4, "cpu")
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(sum(n for _, n in requests), hq, 16, generator=gen)
    k_cache, v_cache = torch.randn(n_slots, hkv, 16, generator=gen), torch.randn(n_slots, hkv, 8, generator=gen)
    ref = paged_attention_torch(q, k_cache, v_cache, listed, window, sinks)
    torch.testing.assert_close(cpu_kernels.paged_attention_cpu(q, k_cache, v_cache, paged, window, sinks), ref,
                               atol=2e-5, rtol=2e-5)


def test_cpu_extend_attention_rows_do_not_depend_on_the_batch() -> None:
    """A request's outputs are the same bits batched with others or alone."""
    from llm_core.kv import cpu_kernels
    from tests.llm_core.attention_cases import MIXED, make_case

    if not cpu_kernels.available():
        pytest.skip("no C++ compiler for the CPU kernel")
    q, k_cache, v_cache, batch, sinks = make_case(MIXED, 4, 2, 48, 32, torch.float32, True, "cpu")
    together = cpu_kernels.paged_attention_cpu(q, k_cache, v_cache, batch, 9, sinks)
    rows = slice(43, 80)  # MIXED[3]: 37 queries from position 30 over keys from 0
    single = PagedBatch.build([(30, 37)], [batch.key_slots(3)], [0], [batch.write_slots[rows]], "cpu")
    alone = cpu_kernels.paged_attention_cpu(q[rows], k_cache, v_cache, single, 9, sinks)
    assert torch.equal(alone, together[rows])


def _one_long_request(first_query: int, queries: int, keys_from: int, seed: int = 3
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """Pools holding one request's keys (positions keys_from .. first_query +
    queries - 1) in shuffled slots, NaN elsewhere; its queries; its key slots."""
    gen = torch.Generator().manual_seed(seed)
    n_keys = first_query + queries - keys_from
    slots = torch.randperm(n_keys + 40, generator=gen)[:n_keys].tolist()
    k_cache = torch.full((n_keys + 40, 2, 48), float("nan"))
    v_cache = torch.full((n_keys + 40, 2, 32), float("nan"))
    k_cache[slots] = torch.randn(n_keys, 2, 48, generator=gen)
    v_cache[slots] = torch.randn(n_keys, 2, 32, generator=gen)
    return torch.randn(queries, 4, 48, generator=gen), k_cache, v_cache, slots


@pytest.mark.parametrize("window", [None, 33, 129])
@pytest.mark.parametrize("keys_from", [0, 90])
def test_cpu_extend_attention_over_many_key_tiles_matches_the_torch_path(window: int | None, keys_from: int) -> None:
    """A chunk longer than the kernel's row block and key tile (150 queries
    after a 120-token prefix), keys trimmed to start mid-way as SWA pools keep them."""
    from llm_core.kv import cpu_kernels
    if not cpu_kernels.available():
        pytest.skip("no C++ compiler for the CPU kernel")
    if window is None and keys_from:
        pytest.skip("full layers keep every key")
    q, k_cache, v_cache, slots = _one_long_request(120, 150, keys_from)
    batch = PagedBatch.build([(120, 150), (0, 1)], [slots, slots[:1]], [keys_from, keys_from],
                             [slots[-150:], slots[:1]], "cpu")
    q = torch.cat([q, q[:1]])
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(9))
    ref = paged_attention_torch(q, k_cache, v_cache, batch, window, sinks)
    out = cpu_kernels.paged_attention_cpu(q, k_cache, v_cache, batch, window, sinks)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window", [None, 33])
def test_cpu_extend_attention_rows_do_not_depend_on_the_chunking(window: int | None) -> None:
    """A prompt prefilled in one chunk or in two (split anywhere, the second
    seeing the first's keys from the pool): every query row the same bits."""
    from llm_core.kv import cpu_kernels
    if not cpu_kernels.available():
        pytest.skip("no C++ compiler for the CPU kernel")
    q, k_cache, v_cache, slots = _one_long_request(0, 200, 0)
    whole = PagedBatch.build([(0, 200)], [slots], [0], [slots], "cpu")
    reference = cpu_kernels.paged_attention_cpu(q, k_cache, v_cache, whole, window, None)
    for split in (1, 37, 64, 130):
        first = PagedBatch.build([(0, split)], [slots[:split]], [0], [slots[:split]], "cpu")
        second = PagedBatch.build([(split, 200 - split)], [slots], [0], [slots[split:]], "cpu")
        parts = torch.cat([cpu_kernels.paged_attention_cpu(q[:split], k_cache, v_cache, first, window, None),
                           cpu_kernels.paged_attention_cpu(q[split:], k_cache, v_cache, second, window, None)])
        assert torch.equal(parts, reference), f"split at {split}"


@pytest.mark.parametrize("pool", ["bf16", "fp8"])
@pytest.mark.parametrize("window", [None, 9])
def test_cpu_extend_attention_reads_bf16_and_fp8_pools(pool: str, window: int | None) -> None:
    """Pools stored narrower than the float32 queries read as their values:
    equal to the kernel over float32 pools holding exactly those values."""
    from llm_core.kv import cpu_kernels
    from llm_core.model.fp8 import FP8_DTYPE
    from llm_core.kv.paged_attention import dequantize_kv, quantize_kv
    from tests.llm_core.attention_cases import MIXED, make_case

    if not cpu_kernels.available():
        pytest.skip("no C++ compiler for the CPU kernel")
    q, k_cache, v_cache, batch, sinks = make_case(MIXED, 4, 2, 48, 32, torch.float32, True, "cpu")
    if pool == "bf16":
        scales = None
        k_pool, v_pool = k_cache.bfloat16(), v_cache.bfloat16()
        k_ref, v_ref = k_pool.float(), v_pool.float()
    else:
        scales = torch.tensor([0.05, 0.02])
        k_pool, v_pool = quantize_kv(k_cache, scales[0], FP8_DTYPE), quantize_kv(v_cache, scales[1], FP8_DTYPE)
        k_ref, v_ref = dequantize_kv(k_pool, scales[0], torch.float32), dequantize_kv(v_pool, scales[1], torch.float32)
    out = cpu_kernels.paged_attention_cpu(q, k_pool, v_pool, batch, window, sinks, scales)
    ref = paged_attention_torch(q, k_ref, v_ref, batch, window, sinks)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_cpu_extend_attention_refuses_bounds_outside_its_tensors() -> None:
    from llm_core.kv import cpu_kernels
    if not cpu_kernels.available():
        pytest.skip("no C++ compiler for the CPU kernel")
    q, k_cache, v_cache, slots = _one_long_request(0, 8, 0)
    bounds = torch.tensor([[0, 9, 0, 8, 0]])  # 9 query rows, 8 in q
    with pytest.raises(RuntimeError, match="bounds fall outside"):
        torch.ops.swallow_cpu.paged_extend_attention(q, k_cache, v_cache, torch.tensor(slots), 1, bounds,
                                                     torch.arange(8), 0, None, None)
