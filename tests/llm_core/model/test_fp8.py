"""FP8 checkpoints in the published MiMo-V2 layout: the format, the loader, and
the determinism contract against transformers run on the dequantized weights."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from llm_core import LLM, CheckpointError, ConfigError, SamplingParams
from llm_core.loading.checkpoint import write_random_checkpoint
from llm_core.model.fp8 import (
    FP8_DTYPE,
    Fp8Scheme,
    block_scale_rows,
    dequantize,
    quantize_activations,
    quantize_blockwise,
    read_fp8_scheme,
)
from llm_core.model.presets import tiny, tiny_kv2, tiny_wide
from llm_core.loading.weights import load_model
from tests.conftest import hf_greedy_outputs
from llm_core.loading.fp8_dequantize import write_dequantized_copy


# (config, block, fused qkv_proj)
CASES = {
    "partial-blocks": (tiny_wide(), (64, 64), False),
    "one-partial-tile": (tiny(), (128, 128), False),
    "fused-qkv": (tiny_kv2(), (32, 32), True),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def fp8_pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(an FP8 hub-layout checkpoint, its dequantized float32 copy)."""
    config, block, fused = CASES[request.param]
    root = tmp_path_factory.mktemp(f"fp8-{request.param}")
    fp8 = write_random_checkpoint(root / "fp8", config, seed=3, fp8_block=block, fused_qkv=fused)
    return fp8, write_dequantized_copy(fp8, root / "dequantized")


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (1, 5, 20, 34, 61, 97)]


# ------------------------------------------------------------------ format
def test_quantization_config_is_read_or_refused_by_name() -> None:
    published = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                 "weight_block_size": [128, 128], "ignored_layers": ["model.layers.0.self_attn.o_proj"]}
    scheme = read_fp8_scheme({"quantization_config": published})
    assert scheme == Fp8Scheme((128, 128), "dynamic", ("model.layers.0.self_attn.o_proj",))
    assert scheme.lists_unconverted("model.layers.0.self_attn.o_proj")
    assert not scheme.lists_unconverted("model.layers.10.self_attn.o_proj")
    both = read_fp8_scheme({"quantization_config": {**published, "modules_to_not_convert": ["lm_head"]}})
    assert both is not None and both.lists_unconverted("lm_head")
    assert read_fp8_scheme({}) is None
    assert read_fp8_scheme({"quantization_config": {"quant_method": "fp8"}}) == Fp8Scheme(None)
    for bad, words in [({"fmt": "e5m2"}, "fmt 'e5m2'"), ({"quant_method": "awq"}, "quant_method 'awq'"),
                       ({"weight_block_size": [100, 100]}, "weight_block_size"),
                       ({"weight_block_size": [128]}, "weight_block_size"),
                       ({"activation_scheme": "static"}, "dynamic"),
                       ({"scale_fmt": "ue8m0"}, "scale_fmt"),
                       ({"ignored_layers": "o_proj"}, "ignored_layers")]:
        with pytest.raises(ConfigError, match=words):
            read_fp8_scheme({"quantization_config": {**published, **bad}})


def test_block_quantization_round_trips_within_e4m3_precision() -> None:
    weight = torch.randn(200, 300)
    values, scale = quantize_blockwise(weight, (128, 128))
    assert values.dtype == FP8_DTYPE and scale.shape == (2, 3)
    restored = dequantize(values, scale, block_scale_rows(200, 128), 128)
    # e4m3 keeps 3 mantissa bits: each element within 1/16 of its tile's largest.
    tile_max = weight.abs().amax()
    assert (restored - weight).abs().max() <= tile_max / 16
    x_q, x_scale = quantize_activations(torch.randn(5, 300), 128)
    assert x_q.shape == (5, 300) and x_scale.shape == (5, 3)  # the last group is partial


# ------------------------------------------------------------ the contract
def test_fp8_checkpoint_loads_as_its_dequantized_weights_exactly(fp8_pair: tuple[Path, Path]) -> None:
    fp8, reference = fp8_pair
    ours, theirs = load_model(fp8).state_dict(), load_model(reference).state_dict()
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        assert tensor.dtype == theirs[name].dtype and torch.equal(tensor, theirs[name]), name


def test_fp8_greedy_tokens_match_transformers_on_the_dequantized_weights(fp8_pair: tuple[Path, Path]) -> None:
    from transformers import MiMoV2FlashForCausalLM

    fp8, reference = fp8_pair
    llm = LLM(fp8)
    prompts = _prompts(llm.config.vocab_size)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    hf_model = MiMoV2FlashForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    hf_model.generation_config.eos_token_id = None  # plain greedy on both sides (ours ignores EOS)
    assert [o.token_ids for o in outputs] == hf_greedy_outputs(hf_model, prompts, 12)
    weights = llm.stats()["weights"]
    assert weights["checkpoint"].startswith("fp8 e4m3") and weights["held_as"] == "float32"
    assert weights["resident_bytes"] == sum(t.numel() * t.element_size()
                                           for t in [*llm.model.parameters(), *llm.model.buffers()])


def test_the_published_layout_and_spelling(fp8_pair: tuple[Path, Path]) -> None:
    fp8, _ = fp8_pair
    config = json.loads((fp8 / "config.json").read_text())
    quant = config["quantization_config"]
    assert quant["quant_method"] == "fp8" and quant["fmt"] == "e4m3" and quant["activation_scheme"] == "dynamic"
    assert all(entry.endswith("self_attn.o_proj") for entry in quant["ignored_layers"])
    dtypes: dict[str, torch.dtype] = {}
    for file in fp8.glob("*.safetensors"):
        with safe_open(str(file), "pt") as handle:
            dtypes |= {name: handle.get_slice(name).get_dtype() for name in handle.keys()}
    assert dtypes["model.layers.1.mlp.experts.3.gate_proj.weight"] == "F8_E4M3"
    assert dtypes["model.layers.1.mlp.experts.3.gate_proj.weight_scale_inv"] == "F32"
    assert dtypes["model.layers.1.mlp.gate.weight"] == dtypes["model.layers.1.mlp.gate.e_score_correction_bias"] \
        == "F32"
    assert dtypes["model.layers.1.self_attn.o_proj.weight"] == "BF16"
    assert dtypes["model.mtp.layers.0.eh_proj.weight"] == "BF16"
    assert dtypes["model.mtp.layers.0.mlp.down_proj.weight"] == "F8_E4M3"
    assert dtypes["model.embed_tokens.weight"] == dtypes["lm_head.weight"] == "BF16"
    assert "model.layers.1.self_attn.attention_sink_bias" in dtypes
    fused = config.get("attention_projection_layout") == "fused_qkv"
    assert ("model.layers.0.self_attn.qkv_proj.weight" in dtypes) == fused
    assert ("model.layers.0.self_attn.q_proj.weight" in dtypes) == (not fused)


# ------------------------------------------------------------ bad checkpoints
@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("fp8-bad") / "fp8", tiny(), seed=1, fp8_block=(32, 32))


def _edited(src: Path, dst: Path, edit: Callable[[dict[str, torch.Tensor]], None],
            config_edit: Callable[[dict], None] | None = None) -> Path:
    """A copy of ``src`` whose tensors (all in one file) and config went through the edits."""
    shutil.copytree(src, dst)
    tensors: dict[str, torch.Tensor] = {}
    for file in dst.glob("*.safetensors"):
        with safe_open(str(file), "pt") as handle:
            tensors |= {name: handle.get_tensor(name) for name in handle.keys()}
        file.unlink()
    (dst / "model.safetensors.index.json").unlink()
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    if config_edit is not None:
        config = json.loads((dst / "config.json").read_text())
        config_edit(config)
        (dst / "config.json").write_text(json.dumps(config))
    return dst


EXPERT = "model.layers.2.mlp.experts.5.down_proj"
Q = "model.layers.1.self_attn.q_proj"


def _set(name: str, value: torch.Tensor) -> Callable[[dict[str, torch.Tensor]], None]:
    return lambda t: t.__setitem__(name, value)


BAD_TENSORS: dict[str, tuple[Callable[[dict[str, torch.Tensor]], None], str]] = {
    "missing expert scale": (lambda t: t.pop(f"{EXPERT}.weight_scale_inv"),
                             rf"'{EXPERT}\.weight' has no scale: '{EXPERT}\.weight_scale_inv' is missing"),
    "scale of the wrong shape": (_set(f"{Q}.weight_scale_inv", torch.ones(3, 1)),
                                 rf"'{Q}\.weight_scale_inv' .* shape \[3, 1\].*needs \[6, 4\]"),
    "non-finite scale": (_set(f"{Q}.weight_scale_inv", torch.full((6, 4), float("inf"))),
                         rf"'{Q}\.weight_scale_inv' holds a non-finite scale"),
    "unused tensor": (_set("model.layers.0.mlp.extra_proj.weight", torch.zeros(2, 2)),
                      r"does not use, first 'model\.layers\.0\.mlp\.extra_proj\.weight'"),
    "scale of a BF16 weight": (_set("model.layers.0.self_attn.o_proj.weight_scale_inv", torch.ones(4, 4)),
                               r"'model\.layers\.0\.self_attn\.o_proj\.weight_scale_inv' scales .* not FP8"),
    "ignored module stored FP8": (
        _set("model.layers.0.self_attn.o_proj.weight", torch.zeros(128, 128, dtype=FP8_DTYPE)),
        r"'model\.layers\.0\.self_attn\.o_proj\.weight' is FP8, but quantization_config lists"),
    "e5m2 values": (lambda t: t.__setitem__(f"{Q}.weight", t[f"{Q}.weight"].to(torch.float8_e5m2)),
                    rf"'{Q}\.weight' is torch\.float8_e5m2, but quantization_config says fmt 'e4m3'"),
    "negative KV scale": (_set("model.layers.0.self_attn.k_scale", torch.tensor(-1.0)),
                          r"'model\.layers\.0\.self_attn\.k_scale' is -1\.0"),
}


@pytest.mark.parametrize("case", sorted(BAD_TENSORS))
def test_a_bad_fp8_checkpoint_fails_at_load_naming_the_tensor(case: str, fp8_checkpoint: Path,
                                                              tmp_path: Path) -> None:
    edit, message = BAD_TENSORS[case]
    with pytest.raises(CheckpointError, match=message):
        LLM(_edited(fp8_checkpoint, tmp_path / "bad", edit))


def test_fp8_tensors_without_a_quantization_config_fail(fp8_checkpoint: Path, tmp_path: Path) -> None:
    bad = _edited(fp8_checkpoint, tmp_path / "bad", lambda t: None, lambda c: c.pop("quantization_config"))
    with pytest.raises(CheckpointError, match=r"is torch\.float8_e4m3fn, but config\.json has no quantization_config"):
        LLM(bad)


@pytest.mark.parametrize("quant, words", [({"fmt": "e5m2"}, "fmt 'e5m2'"),
                                          ({"weight_block_size": [100, 100]}, r"weight_block_size \[100, 100\]")])
def test_an_unknown_format_or_block_size_fails(quant: dict, words: str, fp8_checkpoint: Path, tmp_path: Path) -> None:
    bad = _edited(fp8_checkpoint, tmp_path / "bad", lambda t: None,
                  lambda c: c["quantization_config"].update(quant))
    with pytest.raises(ConfigError, match=words):
        LLM(bad)


def test_a_fused_qkv_checkpoint_needs_its_layout_declared(tmp_path: Path) -> None:
    fused = write_random_checkpoint(tmp_path / "fused", tiny_kv2(), fp8_block=(32, 32), fused_qkv=True)
    bad = _edited(fused, tmp_path / "bad", lambda t: None, lambda c: c.pop("attention_projection_layout"))
    with pytest.raises(CheckpointError, match=r"fused 'model\.layers\.0\.self_attn\.qkv_proj\.weight'.*fused_qkv"):
        LLM(bad)


def test_unused_tensors_fail_in_float_checkpoints_too(tiny_checkpoint: Path, tmp_path: Path) -> None:
    bad = _edited(tiny_checkpoint, tmp_path / "bad", _set("model.layers.3.self_attn.q_norm.weight", torch.ones(4)))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.3\.self_attn\.q_norm\.weight'"):
        LLM(bad)


def test_known_extras_load_and_kv_scales_come_from_the_checkpoint(fp8_checkpoint: Path, tmp_path: Path) -> None:
    def edit(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
        t["model.layers.5.self_attn.k_scale"] = torch.tensor(0.5)
        t["model.layers.5.self_attn.v_scale"] = torch.tensor([0.25])

    model = load_model(_edited(fp8_checkpoint, tmp_path / "extras", edit))
    attention = model.model.layers[5].self_attn
    assert (float(attention.k_scale), float(attention.v_scale)) == (0.5, 0.25)
    assert float(model.model.layers[0].self_attn.k_scale) == 1.0  # none given: 1.0


def test_expert_parallel_ranks_read_only_their_experts(fp8_pair: tuple[Path, Path]) -> None:
    from llm_core.model.expert_parallel import ExpertParallel

    fp8, reference = fp8_pair
    shard = load_model(fp8, ep=ExpertParallel(rank=1, size=2, group=None, control=None)).state_dict()
    full = load_model(reference).state_dict()
    name = "model.layers.1.mlp.experts.gate_up_proj"
    half = full[name].shape[0] // 2
    assert torch.equal(shard[name], full[name][half:])


# ------------------------------------------------- other FP8 layouts in the wild
def fp8_from_float(src: Path, dst: Path, block: tuple[int, int] | None) -> Path:
    """A float checkpoint of this engine's layout (stacked ``mlp.experts.*`` as
    transformers saves them) quantized FP8: in ``block`` tiles (scales
    ``*_scale_inv``), or per tensor (``weight_scale``, one per expert of a
    stacked tensor, static ``input_scale``s) as other FP8 exports are."""
    from llm_core.model.fp8 import never_quantized, quantize_tensorwise

    def quantize(tensors: dict[str, torch.Tensor]) -> None:
        for name, tensor in list(tensors.items()):
            stacked = name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))
            if not stacked and (tensor.dim() != 2 or not name.endswith(".weight") or never_quantized(name)):
                continue
            scale_name = (name.removesuffix("weight") if not stacked else f"{name}_") + \
                ("weight_scale_inv" if block and not stacked else "scale_inv" if block else
                 "weight_scale" if not stacked else "scale")
            if block is not None:
                tensors[name], tensors[scale_name] = quantize_blockwise(tensor, block)
            elif stacked:
                pairs = [quantize_tensorwise(expert) for expert in tensor]
                tensors[name] = torch.stack([q for q, _ in pairs])
                tensors[scale_name] = torch.stack([s for _, s in pairs])
            else:
                tensors[name], tensors[scale_name] = quantize_tensorwise(tensor)
                tensors[name.removesuffix("weight") + "input_scale"] = torch.tensor(0.02)

    quant = {"quant_method": "fp8", "activation_scheme": "dynamic" if block else "static"}
    if block:
        quant["weight_block_size"] = list(block)
    return _edited(src, dst, quantize, lambda c: c.update(quantization_config=quant))


@pytest.mark.parametrize("block", [None, (32, 32)], ids=["per-tensor", "stacked-experts-blocks"])
def test_other_fp8_layouts_load_as_their_dequantized_weights(block: tuple[int, int] | None, tiny_checkpoint: Path,
                                                             tmp_path: Path) -> None:
    fp8 = fp8_from_float(tiny_checkpoint, tmp_path / "fp8", block)
    ours = load_model(fp8).state_dict()
    theirs = load_model(write_dequantized_copy(fp8, tmp_path / "dequantized")).state_dict()
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name
    # Quantized for real: the weights are not the float checkpoint's any more.
    assert not torch.equal(ours["model.layers.1.mlp.experts.down_proj"],
                           load_model(tiny_checkpoint).state_dict()["model.layers.1.mlp.experts.down_proj"])
