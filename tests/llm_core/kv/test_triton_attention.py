"""The Triton paged-attention kernels against the torch reference.

Without CUDA the kernels run on CPU tensors under the Triton interpreter,
which triton picks up when ``triton.jit`` decorates: the variable is set
before the module is (re)imported.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from tests.triton_interpreter import import_kernels, use_interpreter_without_cuda

use_interpreter_without_cuda()

from llm_core.kv.paged_attention import PagedBatch, paged_attention_torch  # noqa: E402
from tests.llm_core.attention_cases import DECODE, MIXED, make_block_table_case, make_case  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def ta() -> ModuleType:
    """llm_core.kv.triton_attention, imported after TRITON_INTERPRET is set."""
    return import_kernels("llm_core.kv.triton_attention")


def check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == ref.dtype == dtype
    assert out.shape == ref.shape
    assert torch.isfinite(out).all()
    atol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=atol)


# Cases are covered pairwise, each value of one choice meeting each value of
# every other: the shapes (head dims, grouping, dtype) among themselves, then
# against the masking choices (window, sinks). Under TRITON_INTERPRET a case
# costs ~1 s, and the full product would be 32 for a mixed batch alone.
SHAPES = [  # (d, dv, hq, hkv, dtype)
    (48, 32, 2, 2, torch.float32), (16, 16, 4, 1, torch.float32),
    (48, 32, 4, 1, torch.bfloat16), (16, 16, 2, 2, torch.bfloat16),
]


# Shapes against sinks and windows, pairwise too: each shape with and without
# sinks and a window, and every sinks-window pair (8 cases, not 16).
MIXED_CASES = [(*shape, with_sinks, window) for i, shape in enumerate(SHAPES)
               for with_sinks, window in (((False, None), (True, 9)) if i < 2 else ((False, 9), (True, None)))]


@pytest.mark.parametrize("d,dv,hq,hkv,dtype,with_sinks,window", MIXED_CASES)
def test_mixed_batch_matches_torch(
    ta: ModuleType,
    window: int | None,
    with_sinks: bool,
    hq: int,
    hkv: int,
    d: int,
    dv: int,
    dtype: torch.dtype,
) -> None:
    q, k_cache, v_cache, batch, sinks = make_case(MIXED, hq, hkv, d, dv, dtype, with_sinks, DEVICE)
    ref = paged_attention_torch(q, k_cache, v_cache, batch, window, sinks)
    check(ta.paged_attention_triton(q, k_cache, v_cache, batch, window, sinks), ref, dtype)


# dtype, head grouping, sinks and window pairwise: every value of each meets
# every value of each other (6 cases, not 24).
DECODE_CASES = [
    (torch.float32, 2, 2, False, None), (torch.bfloat16, 2, 2, True, 9),
    (torch.float32, 4, 1, True, 9), (torch.bfloat16, 4, 1, False, None),
    (torch.float32, 8, 2, False, 9), (torch.bfloat16, 8, 2, True, None),
]


@pytest.mark.parametrize("dtype,hq,hkv,with_sinks,window", DECODE_CASES)
def test_decode_batch_matches_torch(
    ta: ModuleType, window: int | None, with_sinks: bool, hq: int, hkv: int, dtype: torch.dtype
) -> None:
    q, k_cache, v_cache, batch, sinks = make_case(DECODE, hq, hkv, 48, 32, dtype, with_sinks, DEVICE, seed=1)
    ref = paged_attention_torch(q, k_cache, v_cache, batch, window, sinks)
    check(ta.decode_attention_triton(q, k_cache, v_cache, batch, window, sinks), ref, dtype)
    # The generic entry point picks the decode launch for such a batch.
    check(ta.paged_attention_triton(q, k_cache, v_cache, batch, window, sinks), ref, dtype)


def test_extend_handles_decode_rows_and_strided_q(ta: ModuleType) -> None:
    """The extend launch also serves q_len == 1 requests, and q may be a view."""
    q, k_cache, v_cache, batch, sinks = make_case(DECODE, 4, 1, 16, 16, torch.float32, True, DEVICE, seed=2)
    wide = torch.zeros(q.shape[0], q.shape[1], 2 * q.shape[2], device=DEVICE)
    wide[..., ::2] = q
    q_view = wide[..., ::2]  # last dim not contiguous
    ref = paged_attention_torch(q, k_cache, v_cache, batch, 9, sinks)
    check(ta.extend_attention_triton(q_view, k_cache, v_cache, batch, 9, sinks), ref, torch.float32)


@pytest.mark.parametrize("window", [None, 9])
def test_block_table_batches_attend_like_slot_lists(ta: ModuleType, window: int | None) -> None:
    requests = [(20, 1), (12, 5), (0, 37), (30, 37), (3, 1), (41, 1)]
    paged, listed, n_slots = make_block_table_case(requests, 4, DEVICE)
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(sum(n for _, n in requests), 4, 16, generator=gen).to(DEVICE)
    k_cache = torch.randn(n_slots, 1, 16, generator=gen).to(DEVICE)
    v_cache = torch.randn(n_slots, 1, 16, generator=gen).to(DEVICE)
    sinks = torch.randn(4, generator=gen).to(DEVICE)
    assert torch.equal(paged.write_slots, listed.write_slots)
    for b in range(len(requests)):
        assert torch.equal(paged.key_slots(b), listed.key_slots(b))
    assert torch.equal(paged.decode.slots, listed.decode.slots)
    assert torch.equal(paged.decode.key_pos, listed.decode.key_pos)
    ref = paged_attention_torch(q, k_cache, v_cache, listed, window, sinks)
    torch.testing.assert_close(paged_attention_torch(q, k_cache, v_cache, paged, window, sinks), ref)
    check(ta.paged_attention_triton(q, k_cache, v_cache, paged, window, sinks), ref, torch.float32)
    decode = [i for i, (_, n) in enumerate(requests) if n == 1]
    paged, listed, _ = make_block_table_case([requests[i] for i in decode], 4, DEVICE)
    q_dec = q[: len(decode)]
    ref = paged_attention_torch(q_dec, k_cache, v_cache, listed, window, sinks)
    check(ta.decode_attention_triton(q_dec, k_cache, v_cache, paged, window, sinks), ref, torch.float32)


def test_empty_batch(ta: ModuleType) -> None:
    batch = PagedBatch.build([], [], [], [], DEVICE)
    q = torch.zeros(0, 2, 16, device=DEVICE)
    kv = torch.zeros(4, 1, 16, device=DEVICE)
    assert ta.paged_attention_triton(q, kv, kv, batch, None, None).shape == (0, 2, 16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window,hkv", [(129, 2), (None, 1)])
def test_mimo_shape_on_cuda(ta: ModuleType, window: int | None, hkv: int, dtype: torch.dtype) -> None:
    # Long prefixes so the window and the key-block skipping both matter.
    requests = [(0, 300, 1), (0, 0, 200), (200, 500, 1), (0, 400, 173), (272, 400, 173), (0, 1000, 64)]
    q, k_cache, v_cache, batch, sinks = make_case(requests, 16, hkv, 192, 128, dtype, True, "cuda", seed=3)
    ref = paged_attention_torch(q, k_cache, v_cache, batch, window, sinks)
    check(ta.paged_attention_triton(q, k_cache, v_cache, batch, window, sinks), ref, dtype)
    decode = [r for r in requests if r[2] == 1]
    q, k_cache, v_cache, batch, sinks = make_case(decode, 16, hkv, 192, 128, dtype, True, "cuda", seed=4)
    ref = paged_attention_torch(q, k_cache, v_cache, batch, window, sinks)
    check(ta.decode_attention_triton(q, k_cache, v_cache, batch, window, sinks), ref, dtype)


def test_engine_on_triton_attention_generates_what_the_torch_path_does(ta: ModuleType, hf_checkpoint) -> None:
    from llm_core import LLM, SamplingParams

    prompts = [list(range(10, 31)), list(range(40, 52)), [7, 8, 9]]
    params = SamplingParams(max_tokens=3)
    torch_path = LLM(hf_checkpoint, attention="torch", chunked_prefill_size=8)
    triton_path = LLM(hf_checkpoint, attention="triton", chunked_prefill_size=8)
    assert triton_path.engine.runner.attention_fn is ta.paged_attention_triton
    expected = [o.token_ids for o in torch_path.generate(prompts, params)]
    assert [o.token_ids for o in triton_path.generate(prompts, params)] == expected


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_op_matches_torch_decode_path(ta: ModuleType, page_size: int, window: int | None,
                                             dtype: torch.dtype) -> None:
    from tests.llm_core.kv.test_decode_attention import make_decode_case

    from llm_core.kv.paged_attention import paged_decode_attention_torch

    kv_lens = [1, 7, 13, 4, 9]
    q, k_cache, v_cache, pages, sinks = make_decode_case(kv_lens, page_size, 4, 2, 48, 32, True)
    q, k_cache, v_cache = (x.to(device=DEVICE, dtype=dtype) for x in (q, k_cache, v_cache))
    pages, sinks = pages.to(DEVICE), sinks.to(DEVICE)
    kv_len = torch.tensor(kv_lens, device=DEVICE)
    q_pos = torch.tensor([0, 30, 12, 100, 8], device=DEVICE)
    ref = paged_decode_attention_torch(q, k_cache, v_cache, pages, page_size, kv_len, q_pos, window, sinks)
    # Metadata columns of one [B, fields] tensor, as the engine passes them: strided.
    meta = torch.stack((kv_len, q_pos), dim=1)
    kv_len, q_pos = meta[:, 0], meta[:, 1]
    check(ta.paged_decode_attention_triton(q, k_cache, v_cache, pages, page_size, kv_len, q_pos, window, sinks),
          ref, dtype)
