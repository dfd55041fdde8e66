"""The FP8 KV cache: pools of float8_e4m3fn with per-layer scales, read by the
torch path, the C++ CPU decode kernel and the Triton kernels alike; through
the engine, its prefix cache, host/disk tiers and disaggregated transfers."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
import torch

from tests.triton_interpreter import import_kernels, use_interpreter_without_cuda

use_interpreter_without_cuda()

from llm_core import LLM, SamplingParams  # noqa: E402
from llm_core.model.fp8 import FP8_DTYPE  # noqa: E402
from llm_core.kv.paged_attention import (  # noqa: E402
    PagedBatch,
    dequantize_kv,
    paged_attention_torch,
    paged_decode_attention_torch,
    quantize_kv,
)
from tests.conftest import assert_pools_full  # noqa: E402
from tests.llm_core.cluster.test_disagg import OPTIONS, disaggregated, prompts  # noqa: E402

SCALES = torch.tensor([0.05, 0.02])  # (k, v): values up to ~20 / ~9 fit e4m3's 448


def _pools(slots: int, heads: int, d: int, dv: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(FP8 K, FP8 V, and the float32 pools holding exactly their dequantized values)."""
    gen = torch.Generator().manual_seed(0)
    k = quantize_kv(torch.randn(slots, heads, d, generator=gen) * 4, SCALES[0], FP8_DTYPE)
    v = quantize_kv(torch.randn(slots, heads, dv, generator=gen) * 2, SCALES[1], FP8_DTYPE)
    return k, v, dequantize_kv(k, SCALES[0], torch.float32), dequantize_kv(v, SCALES[1], torch.float32)


def _batch() -> PagedBatch:
    # Decode with history, a chunk after a prefix, a fresh prefill: keys through a slot list.
    ranges, firsts = [(20, 1), (12, 5), (0, 37)], [0, 0, 0]
    slots = [torch.randperm(100)[: start + n] for start, n in ranges]
    return PagedBatch.build(ranges, slots, firsts, [s[-n:] for s, (_, n) in zip(slots, ranges)], "cpu")


@pytest.mark.parametrize("window", [None, 9])
def test_the_torch_path_reads_an_fp8_pool_as_its_dequantized_values(window: int | None) -> None:
    k, v, k_ref, v_ref = _pools(100, 2, 32, 16)
    batch = _batch()
    q = torch.randn(43, 4, 32)
    sinks = torch.randn(4)
    ours = paged_attention_torch(q, k, v, batch, window, sinks, SCALES)
    assert torch.equal(ours, paged_attention_torch(q, k_ref, v_ref, batch, window, sinks))
    pages = torch.randperm(25)[:6].view(2, 3).to(torch.int32)
    q_pos, kv_len = torch.tensor([10, 11]), torch.tensor([11, 12])
    decoded = paged_decode_attention_torch(q[:2], k, v, pages, 4, kv_len, q_pos, window, sinks, SCALES)
    assert torch.equal(decoded, paged_decode_attention_torch(q[:2], k_ref, v_ref, pages, 4, kv_len, q_pos, window,
                                                             sinks))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_decode_kernel_reads_fp8_pools(dtype: torch.dtype) -> None:
    from llm_core.kv import cpu_kernels
    if not cpu_kernels.available():
        pytest.skip("the C++ kernel did not build")
    k, v, _, _ = _pools(100, 2, 32, 16)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(3, 4, 32, generator=gen).to(dtype)
    pages = torch.randperm(25, generator=gen)[:12].view(3, 4).to(torch.int32)
    q_pos, kv_len = torch.tensor([7, 15, 12]), torch.tensor([8, 16, 9])
    for window, sinks in [(None, None), (5, torch.randn(4, generator=gen))]:
        ours = cpu_kernels.paged_decode_attention_cpu(q, k, v, pages, 4, kv_len, q_pos, window, sinks, SCALES)
        # The kernel works in float32 whatever q's dtype: so does the reference.
        ref = paged_decode_attention_torch(q.float(), k, v, pages, 4, kv_len, q_pos, window, sinks, SCALES)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(ours.float(), ref, rtol=tol, atol=tol)


@pytest.fixture(scope="module")
def ta() -> ModuleType:
    """llm_core.kv.triton_attention, imported after TRITON_INTERPRET is set."""
    return import_kernels("llm_core.kv.triton_attention")


@pytest.mark.parametrize("window", [None, 9])
def test_the_triton_kernels_read_fp8_pools(ta: ModuleType, window: int | None) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    k, v, _, _ = _pools(100, 2, 32, 16)
    batch = _batch()
    q = torch.randn(43, 4, 32)
    sinks = torch.randn(4)
    ref = paged_attention_torch(q, k, v, batch, window, sinks, SCALES)
    if device == "cuda":
        pytest.skip("the CPU batch above; the GPU run is in the GPU-marked suite")
    ours = ta.paged_attention_triton(q, k, v, batch, window, sinks, SCALES)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    pages = torch.randperm(25)[:6].view(2, 3).to(torch.int32)
    q_pos, kv_len = torch.tensor([10, 11]), torch.tensor([11, 12])
    decoded = ta.paged_decode_attention_triton(q[:2], k, v, pages, 4, kv_len, q_pos, window, sinks, SCALES)
    torch.testing.assert_close(decoded, paged_decode_attention_torch(q[:2], k, v, pages, 4, kv_len, q_pos, window,
                                                                     sinks, SCALES), rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------ engine
PARAMS = SamplingParams(max_tokens=5, ignore_eos=True)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (4, 19, 40, 77)]


# Without drafts: each path's reads are the subject, and drafting doubles the
# interpreted Triton run's kernel launches (the tier test below drafts over FP8 pools).
ENGINE = {"kv_cache_dtype": "fp8_e4m3", "speculative_tokens": 0}


@pytest.fixture(scope="module")
def fp8_tokens(hf_checkpoint: Path) -> list[list[int]]:
    return [o.token_ids for o in LLM(hf_checkpoint, attention="torch", **ENGINE).generate(_prompts(), PARAMS)]


def test_every_attention_path_reads_the_fp8_cache_alike(hf_checkpoint: Path, ta: ModuleType,
                                                       fp8_tokens: list[list[int]]) -> None:
    """The kernels agree to float rounding (above); through a whole model a last-bit
    difference can move a stored K across an e4m3 rounding edge, so requests may
    part after a few tokens: the first tokens agree and most of the rest."""
    for attention in ("auto", "triton"):  # auto on CPU: the C++ decode kernel
        llm = LLM(hf_checkpoint, attention=attention, **ENGINE)
        tokens = [o.token_ids for o in llm.generate(_prompts(), PARAMS)]
        assert [t[0] for t in tokens] == [t[0] for t in fp8_tokens], attention
        agree = sum(a == b for x, y in zip(tokens, fp8_tokens) for a, b in zip(x, y))
        assert agree >= 0.75 * sum(map(len, fp8_tokens)), attention
        assert_pools_full(llm)


def test_fp8_pools_hold_twice_the_tokens_of_bf16(hf_checkpoint: Path) -> None:
    bf16 = LLM(hf_checkpoint, kv_cache_dtype="bf16", speculative_tokens=0).stats()
    fp8 = LLM(hf_checkpoint, kv_cache_dtype="fp8_e4m3", speculative_tokens=0).stats()
    assert (bf16["kv_cache_dtype"], fp8["kv_cache_dtype"]) == ("bfloat16", "float8_e4m3fn")
    assert fp8["full_pool"]["bytes_per_token"] * 2 == bf16["full_pool"]["bytes_per_token"]
    ratio = fp8["full_pool"]["capacity_tokens"] / bf16["full_pool"]["capacity_tokens"]
    assert 1.95 <= ratio <= 2.05
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        LLM(hf_checkpoint, kv_cache_dtype="int8")


def test_pages_of_one_kv_dtype_are_never_read_as_another(hf_checkpoint: Path) -> None:
    options = {"kv_host_bytes": 1 << 22}
    fp8 = LLM(hf_checkpoint, kv_cache_dtype="fp8_e4m3", **options).engine
    bf16 = LLM(hf_checkpoint, kv_cache_dtype="bf16", **options).engine
    assert fp8.fingerprint != bf16.fingerprint
    assert fp8.kv_layout.startswith("kv=torch.float8_e4m3fn;scales=")


def test_fp8_pages_restored_from_host_and_disk_match_recompute(hf_checkpoint: Path, tmp_path: Path) -> None:
    """With drafts (the default speculation) over FP8 pools."""
    llm = LLM(hf_checkpoint, kv_cache_dtype="fp8_e4m3", attention="torch", page_size=4, kv_host_bytes=1 << 16,
              kv_disk_bytes=1 << 26, kv_disk_dir=str(tmp_path / "kv"))
    recompute = LLM(hf_checkpoint, kv_cache_dtype="fp8_e4m3", attention="torch", enable_prefix_caching=False)
    prompt = _prompts()[3]
    first = llm.generate([prompt], PARAMS)[0].token_ids
    assert first == recompute.generate([prompt], PARAMS)[0].token_ids
    llm.engine.flush_cache()  # the device copy goes: the next turn reads the tiers
    turn2 = prompt + first + [5, 6, 7]
    again = llm.generate([turn2], PARAMS)[0].token_ids
    tiers = llm.stats()["prefix_cache"]["cached_tokens_by_tier"]
    assert tiers.get("host", 0) + tiers.get("disk", 0) > 0
    assert again == recompute.generate([turn2], PARAMS)[0].token_ids
    llm.engine.close()


def test_fp8_kv_crosses_a_disaggregated_transfer(hf_checkpoint: Path) -> None:
    batch = prompts(2, 30)
    options = {**OPTIONS, "kv_cache_dtype": "fp8_e4m3", "attention": "torch"}
    prefill_llm, decode_llm = LLM(hf_checkpoint, **options), LLM(hf_checkpoint, **options)
    together = [o.token_ids for o in LLM(hf_checkpoint, **options).generate(batch, PARAMS)]
    assert disaggregated(prefill_llm, decode_llm, batch, PARAMS) == together
    bf16 = LLM(hf_checkpoint, **{**options, "kv_cache_dtype": "bf16"})
    assert prefill_llm.engine.kv_layout != bf16.engine.kv_layout  # a worker refuses the other's transfers


def test_checkpoint_kv_scales_reach_the_pools(tmp_path: Path) -> None:
    from tests.llm_core.model.test_fp8 import _edited
    from llm_core.loading.checkpoint import write_random_checkpoint
    from llm_core.model.presets import tiny

    src = write_random_checkpoint(tmp_path / "src", tiny())
    scaled = _edited(src, tmp_path / "scaled", lambda t: t.update({"model.layers.1.self_attn.k_scale": torch.tensor(0.5),
                                                                    "model.layers.1.self_attn.v_scale": torch.tensor(2.0)}))
    kv = LLM(scaled, kv_cache_dtype="fp8_e4m3").engine.kv
    assert kv.scale_values()[1] == (0.5, 2.0) and kv.scale_values()[2] == (1.0, 1.0)
    assert kv.layer(1)[1].dtype == FP8_DTYPE
