"""The block-scaled FP8 GEMMs against their float32 reference, and the model on
them (weights kept FP8) against its dequantized weights.

Without CUDA the kernels run under the Triton interpreter, which holds float8
tensors and multiplies them exactly (no emulation is needed); the variable is
set before ``llm_core.model.triton_fp8`` is (re)imported. On a GPU of compute
capability 8.9+ the same tests run the compiled kernels (marked ``gpu``).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import ModuleType

import pytest
import torch

from tests.triton_interpreter import import_kernels, use_interpreter_without_cuda

use_interpreter_without_cuda()

from llm_core.model.fp8 import (  # noqa: E402
    block_scale_rows,
    dequantize,
    fp8_matmul_reference,
    quantize_activations,
    quantize_blockwise,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.fixture(scope="module")
def tf() -> ModuleType:
    """llm_core.model.triton_fp8, imported after TRITON_INTERPRET is set."""
    return import_kernels("llm_core.model.triton_fp8")


def _skip_without_fp8() -> None:
    if torch.cuda.is_available() and not FP8_GPU:
        pytest.skip("FP8 GEMMs need compute capability 8.9+")


@pytest.mark.parametrize("m, n, k, block", [(5, 200, 300, (128, 128)), (1, 64, 96, (32, 32)), (33, 130, 70, (64, 32))])
def test_linear_matches_the_float32_reference(tf: ModuleType, m: int, n: int, k: int, block: tuple[int, int]) -> None:
    _skip_without_fp8()
    gen = torch.Generator().manual_seed(m + n)
    values, scale = quantize_blockwise(torch.randn(n, k, generator=gen), block)
    rows = block_scale_rows(n, block[0])
    x = torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    out = tf.block_fp8_linear(x.to(DEVICE), values.to(DEVICE), scale.to(DEVICE), rows.to(DEVICE), block[1],
                              bias.to(DEVICE))
    ref = fp8_matmul_reference(x, values, scale, rows, block[1]) + bias
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-5, atol=1e-4)


def test_rows_gathered_from_separately_blocked_parts(tf: ModuleType) -> None:
    """gate | up of 40 rows each in 32-row blocks: the up part starts a new block row."""
    _skip_without_fp8()
    gen = torch.Generator().manual_seed(0)
    gate, up = torch.randn(40, 64, generator=gen), torch.randn(40, 64, generator=gen) * 100
    (gv, gs), (uv, us) = quantize_blockwise(gate, (32, 32)), quantize_blockwise(up, (32, 32))
    values, scale = torch.cat([gv, uv]), torch.cat([gs, us])
    rows = torch.cat([block_scale_rows(40, 32), block_scale_rows(40, 32, first=gs.shape[0])])
    x = torch.randn(3, 64, generator=gen)
    out = tf.block_fp8_linear(x.to(DEVICE), values.to(DEVICE), scale.to(DEVICE), rows.to(DEVICE), 32).cpu()
    dense = torch.cat([dequantize(gv, gs, block_scale_rows(40, 32), 32), dequantize(uv, us, block_scale_rows(40, 32), 32)])
    x_q, x_scale = quantize_activations(x, 32)
    x_values = x_q.float() * x_scale.repeat_interleave(32, dim=-1)
    torch.testing.assert_close(out, x_values @ dense.T, rtol=1e-5, atol=1e-3)


def test_grouped_row_layout_covers_every_slot_once(tf: ModuleType) -> None:
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [5, 3]])
    slot, tile_expert = tf.grouped_row_layout(ids, num_experts=6, block_m=4)
    used = slot[slot >= 0]
    assert sorted(used.tolist()) == list(range(8))
    for tile, expert in enumerate(tile_expert.tolist()):
        rows = slot[tile * 4:(tile + 1) * 4]
        assert all(ids.reshape(-1)[r].item() == expert for r in rows[rows >= 0].tolist())
    assert (tile_expert[tile_expert < 0].numel() + len(set(tile_expert[tile_expert >= 0].tolist()))) <= len(tile_expert)


def test_grouped_experts_match_the_float32_reference(tf: ModuleType) -> None:
    _skip_without_fp8()
    gen = torch.Generator().manual_seed(1)
    t, hidden, inter, experts, top_k, block = 7, 96, 80, 6, 2, (32, 32)
    x = torch.randn(t, hidden, generator=gen)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(t)])
    weights = torch.rand(t, top_k, generator=gen)
    gate, up = (quantize_blockwise(torch.randn(experts, inter, hidden, generator=gen), block) for _ in range(2))
    down, down_scale = quantize_blockwise(torch.randn(experts, hidden, inter, generator=gen), block)
    gate_up, gate_up_scale = torch.cat([gate[0], up[0]], 1), torch.cat([gate[1], up[1]], 1)
    gate_up_rows = torch.cat([block_scale_rows(inter, 32), block_scale_rows(inter, 32, first=gate[1].shape[1])])
    down_rows = block_scale_rows(hidden, 32)
    args = [a.to(DEVICE) for a in (x, weights, ids, gate_up, gate_up_scale, gate_up_rows, down, down_scale, down_rows)]
    out = tf.grouped_block_fp8_experts(*args, 32).cpu()
    ref = torch.zeros(t, hidden)
    for token in range(t):
        for j in range(top_k):
            e = ids[token, j]
            h = fp8_matmul_reference(x[token:token + 1], gate_up[e], gate_up_scale[e], gate_up_rows, 32)[0]
            act = torch.nn.functional.silu(h[:inter]) * h[inter:]
            ref[token] += weights[token, j] * fp8_matmul_reference(act[None], down[e], down_scale[e], down_rows, 32)[0]
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-3)


# ------------------------------------------------------------ the model on them
def _logits(llm, prompt: list[int]) -> torch.Tensor:  # noqa: ANN001
    from llm_core.kv.kv_cache import ContiguousAttention, RequestKVCache, Segment

    backend = ContiguousAttention([Segment(RequestKVCache(), 0, len(prompt))], DEVICE)
    with torch.inference_mode():
        ids = torch.tensor(prompt, device=DEVICE)
        return llm.model.compute_logits(llm.model(ids, torch.arange(len(prompt), device=DEVICE), backend)).cpu()


# The stated tolerance of the FP8-GEMM path against the dequantized weights: with
# activations rounded to e4m3 at every product (about 2^-4 relative per
# element), a random 6-layer model's logits move by this much (measured: 0.15
# relative, 76-88% of argmaxes kept). The test runs 2 layers, one of each kind
# (every interpreted launch is slow on CPU).
GEMM_PATH_RELATIVE_ERROR = 0.25
GEMM_PATH_TOP1_AGREEMENT = 0.7


def test_the_model_on_fp8_gemms(tf: ModuleType, tmp_path: Path) -> None:
    """Through LLM with quantization='fp8': every matrix FP8 but o_proj (listed)
    and the LM head, eh_proj (kept), each exactly the dequantized checkpoint's
    once its scales are applied; logits within the stated tolerance of the
    dequantized model's (a tight whole-model bound does not exist: a last-bit
    difference anywhere can move an activation across an e4m3 rounding edge);
    generation runs."""
    _skip_without_fp8()
    from llm_core import LLM, SamplingParams
    from llm_core.loading.checkpoint import write_random_checkpoint
    from llm_core.model.fp8_linear import Fp8Linear, Fp8RoutedExperts
    from llm_core.model.presets import tiny
    from llm_core.loading.fp8_dequantize import write_dequantized_copy

    config = replace(tiny(), num_hidden_layers=2, layer_types=("full", "sliding"), mlp_layer_types=("dense", "sparse"))
    fp8 = write_random_checkpoint(tmp_path / "fp8", config, seed=3, fp8_block=(32, 32))
    llm = LLM(fp8, device=DEVICE, quantization="fp8")
    dense = LLM(write_dequantized_copy(fp8, tmp_path / "dense"), device=DEVICE)
    kinds = {name: type(m).__name__ for name, m in llm.model.named_modules()}
    assert kinds["model.layers.1.self_attn.q_proj"] == Fp8Linear.__name__
    assert kinds["model.layers.1.mlp.experts"] == Fp8RoutedExperts.__name__
    assert kinds["model.layers.1.self_attn.o_proj"] == kinds["lm_head"] == kinds["model.mtp.layers.0.eh_proj"] == "Linear"
    assert llm.stats()["weights"]["held_as"] == "fp8"
    for name, module in llm.model.named_modules():
        reference = dense.model.get_submodule(name)
        if isinstance(module, Fp8Linear):
            weight = dequantize(module.weight, module.weight_scale_inv, module.weight_scale_row, module.group_k)
            assert torch.equal(weight, reference.weight), name
        elif isinstance(module, Fp8RoutedExperts):
            for proj in ("gate_up_proj", "down_proj"):
                values = dequantize(getattr(module, proj), getattr(module, f"{proj}_scale_inv"),
                                    getattr(module, f"{proj}_scale_row"), module.group_k)
                assert torch.equal(values, getattr(reference, proj)), f"{name}.{proj}"
    prompt = torch.randint(3, 500, (80,), generator=torch.Generator().manual_seed(0)).tolist()
    kernels, exact = _logits(llm, prompt), _logits(dense, prompt)
    assert ((kernels - exact).norm() / exact.norm()).item() < GEMM_PATH_RELATIVE_ERROR
    assert (kernels.argmax(-1) == exact.argmax(-1)).float().mean().item() > GEMM_PATH_TOP1_AGREEMENT
    # A prefill and a decode step (each interpreted launch is slow on CPU).
    out = llm.generate([prompt[:20]], SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(out[0].token_ids) == 2


def test_quantization_fp8_needs_fp8_gemms(tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from llm_core import LLM

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="FP8 GEMMs"):
        LLM(tiny_checkpoint, device="cpu", quantization="fp8")
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(tiny_checkpoint, quantization="int4")


def test_a_float_checkpoint_is_quantized_at_load_with_fp8(tf: ModuleType, tiny_checkpoint: Path) -> None:
    _skip_without_fp8()
    from llm_core import LLM

    llm = LLM(tiny_checkpoint, device=DEVICE, quantization="fp8")
    q_proj = llm.model.model.layers[1].self_attn.q_proj
    assert q_proj.weight.dtype == torch.float8_e4m3fn and q_proj.weight_scale_inv.shape == (2, 1)
    # No ignore list in a float checkpoint: o_proj too; the LM head and norms never.
    assert llm.model.model.layers[1].self_attn.o_proj.weight.dtype == torch.float8_e4m3fn
    assert llm.model.lm_head.weight.dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.skipif(not FP8_GPU, reason="needs CUDA compute capability 8.9+")
def test_mimo_shapes_on_an_fp8_gpu(tf: ModuleType) -> None:
    """MiMo-V2-Flash's q_proj and an expert layer's shapes, 128x128 blocks, bf16 activations."""
    gen = torch.Generator().manual_seed(0)
    values, scale = quantize_blockwise(torch.randn(64 * 192, 4096, generator=gen), (128, 128))
    rows = block_scale_rows(64 * 192, 128)
    for m in (1, 16, 300):
        x = torch.randn(m, 4096, generator=gen)
        out = tf.block_fp8_linear(x.cuda().bfloat16(), values.cuda(), scale.cuda(), rows.cuda(), 128)
        ref = fp8_matmul_reference(x.bfloat16().float(), values, scale, rows, 128)
        assert ((out.float().cpu() - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not FP8_GPU, reason="needs CUDA compute capability 8.9+")
def test_auto_keeps_fp8_weights_on_an_fp8_gpu_compiled_and_graphed(tmp_path: Path) -> None:
    from llm_core import LLM, SamplingParams
    from llm_core.loading.checkpoint import write_random_checkpoint
    from llm_core.model.presets import tiny

    fp8 = write_random_checkpoint(tmp_path / "fp8", tiny(), seed=3, fp8_block=(128, 128))
    prompts = [list(range(5, 40)), [7, 8, 9]]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    eager = LLM(fp8, device="cuda", dtype="bfloat16", compile=False, cuda_graph_max_batch=0)
    assert eager.stats()["weights"]["held_as"] == "fp8"
    graphed = LLM(fp8, device="cuda", dtype="bfloat16", compile=True, kv_cache_dtype="fp8_e4m3")
    for llm in (eager, graphed):
        outputs = llm.generate(prompts, params)
        assert all(len(o.token_ids) == 8 for o in outputs)
    dense = LLM(fp8, device="cuda", dtype="bfloat16", quantization="none")
    assert dense.stats()["weights"]["resident_bytes"] > 1.5 * eager.stats()["weights"]["resident_bytes"]


@pytest.mark.parametrize("block", [None, (32, 32)], ids=["per-tensor", "stacked-experts-blocks"])
def test_other_fp8_layouts_stay_fp8_exactly(tf: ModuleType, tiny_checkpoint: Path, tmp_path: Path,
                                            block: tuple[int, int] | None) -> None:
    """Per-tensor scales become a one-row table (K groups of 128); stacked experts
    keep their whole-matrix blocks: each module dequantizes to the float copy's."""
    _skip_without_fp8()
    from llm_core import LLM
    from llm_core.loading.fp8_dequantize import write_dequantized_copy
    from llm_core.model.fp8_linear import Fp8Linear, Fp8RoutedExperts
    from tests.llm_core.model.test_fp8 import fp8_from_float

    fp8 = fp8_from_float(tiny_checkpoint, tmp_path / "fp8", block)
    llm = LLM(fp8, device=DEVICE, quantization="fp8")
    dense = LLM(write_dequantized_copy(fp8, tmp_path / "dense"), device=DEVICE).model
    checked = 0
    for name, module in llm.model.named_modules():
        if isinstance(module, Fp8Linear):
            weight = dequantize(module.weight, module.weight_scale_inv, module.weight_scale_row, module.group_k)
            assert torch.equal(weight, dense.get_submodule(name).weight), name
            checked += 1
        elif isinstance(module, Fp8RoutedExperts):
            for proj in ("gate_up_proj", "down_proj"):
                values = dequantize(getattr(module, proj), getattr(module, f"{proj}_scale_inv"),
                                    getattr(module, f"{proj}_scale_row"), module.group_k)
                assert torch.equal(values, getattr(dense.get_submodule(name), proj)), f"{name}.{proj}"
            checked += 1
    assert checked > 20
