"""Parity with transformers over random small configs, and proof that the check can fail.

Every example is a ``MiMoV2FlashConfig`` that transformers accepts and runs,
with random (peaky) weights saved by transformers itself. Swallow must give
the same full-sequence logits and, through the engine with prefill chunks
crossing the sliding window, the same greedy tokens. The second test loads
the same checkpoints with one field of Swallow's ``ModelConfig`` deliberately
off by one and requires the comparison to fail wherever that field matters.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, note, seed, settings
from hypothesis import example as explicit_example
from hypothesis import strategies as st

from llm_core import LLM, SamplingParams
from llm_core.model.config import LayerType, ModelConfig
from llm_core.kv.kv_cache import ContiguousAttention, RequestKVCache, Segment
from llm_core.model.model import MiMoV2ForCausalLM
from llm_core.loading.weights import CheckpointError, load_model
from tests.conftest import append_mtp_shard, _make_peaky

VOCAB = 128
LOGIT_TOLERANCE = 1e-4
MAX_NEW_TOKENS = 6
# Partial rotary factors, MiMo's first (hypothesis favours early entries): with
# head dims 2..24 they give odd rotary dims (16 * 0.334 -> 5), zero ones
# (2 * 0.334 -> 0) and whole heads.
ROTARY_FACTORS = (0.334, 0.5, 0.25, 0.1, 0.75, 1.0, 0.0)
# MiMo's thetas first: 5M on full layers, 10K on SWA layers.
THETAS = {"full_attention": (5e6, 1e4, 100.0), "sliding_attention": (1e4, 5e6, 100.0)}
SWEEP_SEED = 20250611


@dataclass(frozen=True)
class Example:
    hf_config: dict[str, Any]  # MiMoV2FlashConfig keyword arguments
    num_mtp_layers: int
    prompt: tuple[int, ...]  # longer than the window and than one prefill chunk
    chunk: int  # the engine's chunked_prefill_size
    weight_seed: int


def _kv_head_choices(heads: int, attends_like_swa: bool) -> list[int]:
    # transformers doubles the KV heads of SWA layers; every used count must divide the heads.
    factor = 2 if attends_like_swa else 1
    return [k for k in range(1, heads + 1) if heads % (factor * k) == 0]


def _router(draw: st.DrawFn) -> dict[str, Any]:
    experts = draw(st.sampled_from([4, 8]))
    # A group's score is the sum of its top two experts: groups need two.
    n_group = draw(st.sampled_from([g for g in (1, 2, 4) if experts // g >= 2]))
    topk_group = draw(st.integers(1, n_group))
    return {
        "n_routed_experts": experts,
        "n_group": n_group,
        "topk_group": topk_group,
        "num_experts_per_tok": draw(st.integers(1, topk_group * experts // n_group)),
        "routed_scaling_factor": draw(st.sampled_from([1.0, 1.5, 2.5])),
        "norm_topk_prob": draw(st.booleans()),
        "moe_intermediate_size": draw(st.integers(8, 32)),
    }


def _rope(draw: st.DrawFn, head_dim: int) -> dict[str, dict[str, Any]]:
    # An odd head cannot rotate whole: transformers refuses that config.
    factors = [f for f in ROTARY_FACTORS if head_dim % 2 == 0 or f < 1.0]
    return {
        layer_type: {
            "rope_type": "default",
            "rope_theta": draw(st.sampled_from(THETAS[layer_type])),
            "partial_rotary_factor": draw(st.sampled_from(factors)),
        }
        for layer_type in ("full_attention", "sliding_attention")
    }


@st.composite
def examples(draw: st.DrawFn) -> Example:
    n = draw(st.integers(2, 4))
    layer_types = draw(st.lists(st.sampled_from(["full_attention", "sliding_attention"]), min_size=n, max_size=n))
    num_mtp_layers = draw(st.integers(0, 2))
    heads = draw(st.sampled_from([2, 4, 6]))
    # MTP layers attend like SWA layers, so they need the doubled KV heads to fit too.
    swa_heads_used = "sliding_attention" in layer_types or num_mtp_layers > 0
    head_dim = draw(st.integers(2, 24))
    window = draw(st.integers(1, 64))
    chunk = draw(st.integers(2, 12))
    prompt_len = window + draw(st.integers(chunk + 1, chunk + 12))
    hf_config = {
        "vocab_size": VOCAB,
        "hidden_size": draw(st.sampled_from([32, 48, 64])),
        "intermediate_size": draw(st.integers(16, 64)),
        "num_hidden_layers": n,
        "layer_types": layer_types,
        "mlp_layer_types": draw(st.lists(st.sampled_from(["dense", "sparse"]), min_size=n, max_size=n)),
        "num_attention_heads": heads,
        "num_key_value_heads": draw(st.sampled_from(_kv_head_choices(heads, swa_heads_used))),
        "head_dim": head_dim,
        "v_head_dim": draw(st.integers(2, 24)),
        "sliding_window": window,
        "rope_parameters": _rope(draw, head_dim),
        "attention_value_scale": draw(st.sampled_from([None, 0.5, 0.707, 1.0])),
        "attention_bias": draw(st.booleans()),
        "tie_word_embeddings": draw(st.booleans()),
        **_router(draw),
        "max_position_embeddings": 256,
        "initializer_range": 0.1,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }
    prompt = draw(st.lists(st.integers(0, VOCAB - 1), min_size=prompt_len, max_size=prompt_len))
    return Example(hf_config, num_mtp_layers, tuple(prompt), chunk, draw(st.integers(0, 2**16)))


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tensors this small gain nothing from threads, and on busy shared cores
    each parallel region can wait a time slice for its second thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _explicit(hf_changes: dict[str, Any], window: int, chunk: int, num_mtp_layers: int = 0) -> Example:
    """A hand-picked example: a small MoE model with the given fields changed."""
    rope = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.334}
    hf_config = {
        "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 3,
        "layer_types": ["full_attention", "sliding_attention", "sliding_attention"],
        "mlp_layer_types": ["dense", "sparse", "sparse"],
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16, "v_head_dim": 8,
        "sliding_window": window,
        "rope_parameters": {"full_attention": {**rope, "rope_theta": 5e6}, "sliding_attention": rope},
        "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
        "max_position_embeddings": 256, "initializer_range": 0.1,
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
        **hf_changes,
    }
    prompt = [(7 * i + 3) % VOCAB for i in range(window + 2 * chunk + 1)]
    return Example(hf_config, num_mtp_layers, tuple(prompt), chunk, weight_seed=0)


EXPLICIT_EXAMPLES = (
    # 16 * 0.334 -> rotary dim 5: transformers rotates 6 channels with theta^(-2i/5).
    _explicit({}, window=8, chunk=3, num_mtp_layers=1),
    # All full: the doubled SWA KV heads (8) need not divide the 4 heads.
    _explicit({"layer_types": ["full_attention"] * 3, "num_key_value_heads": 4, "rope_parameters": {
        t: {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}
        for t in ("full_attention", "sliding_attention")}}, window=8, chunk=5),
    # A window of the query alone, and an odd head rotating all but one channel (7 * 0.75 -> 5 -> 6).
    _explicit({"head_dim": 7, "rope_parameters": {
        t: {"rope_type": "default", "rope_theta": 100.0, "partial_rotary_factor": 0.75}
        for t in ("full_attention", "sliding_attention")}}, window=1, chunk=2),
)


def sweep(test: Callable[[Example], None]) -> Callable[[], None]:
    """The hypothesis sweep both tests run: one seed, so they see the same configs."""

    @functools.wraps(test)
    def noted(example: Example) -> None:
        # Under pytest this hypothesis prints a failing argument as empty; a note survives.
        note(repr(example))
        test(example)

    for explicit in EXPLICIT_EXAMPLES:
        noted = explicit_example(example=explicit)(noted)
    return seed(SWEEP_SEED)(
        settings(
            max_examples=30,
            deadline=None,
            database=None,
            phases=(Phase.explicit, Phase.generate, Phase.shrink),
            suppress_health_check=[HealthCheck.too_slow],
        )(given(example=examples())(noted))
    )


# ------------------------------------------------------------------ helpers
def _write_checkpoint(example: Example, out: Path):  # -> transformers.MiMoV2FlashForCausalLM
    """Random peaky weights saved by transformers, plus MTP layers in their own shard."""
    from transformers import MiMoV2FlashConfig, MiMoV2FlashForCausalLM

    torch.manual_seed(example.weight_seed)
    # The modeling file's own expert loop: the grouped_mm kernel transformers
    # picks by default on CPU needs 16-byte strides (moe_intermediate_size % 4).
    hf_config = MiMoV2FlashConfig(**example.hf_config, experts_implementation="eager")
    model = MiMoV2FlashForCausalLM(hf_config).eval()
    _make_peaky(model)
    model.save_pretrained(out)
    if example.num_mtp_layers:
        config = ModelConfig.from_json_file(out / "config.json").with_mtp_layers(example.num_mtp_layers)
        append_mtp_shard(out, config)
    return model


def _hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


def _swallow_logits(model: MiMoV2ForCausalLM, ids: list[int]) -> torch.Tensor:
    """One whole-sequence forward, no engine."""
    backend = ContiguousAttention([Segment(RequestKVCache(), 0, len(ids))], "cpu")
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), backend))


def _mismatches(ours: torch.Tensor, ref: torch.Tensor) -> list[str]:
    """Why our logits are not transformers' (empty when they are)."""
    problems = []
    diff = (ours - ref).abs().max().item()
    if not diff < LOGIT_TOLERANCE:  # NaN included
        problems.append(f"max |logit difference| {diff:.3g}")
    differ = (ours.argmax(-1) != ref.argmax(-1)).nonzero().flatten().tolist()
    if differ:
        problems.append(f"greedy tokens differ at positions {differ}")
    return problems


def _checkpoint_with_config(checkpoint: Path, config: ModelConfig, out: Path) -> Path:
    """The same weights under another config.json."""
    data = config.to_hf_dict()
    # The rewritten config.json must describe exactly `config`, nothing else.
    assert ModelConfig.from_hf_dict(json.loads(json.dumps(data))) == config
    out.mkdir()
    for file in checkpoint.iterdir():
        if file.name != "config.json":
            (out / file.name).symlink_to(file)
    (out / "config.json").write_text(json.dumps(data))
    return out


# --------------------------------------------------------------- the sweep
@sweep
def test_random_configs_match_transformers(example: Example) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        hf_model = _write_checkpoint(example, Path(tmp))
        llm = LLM(
            tmp,
            chunked_prefill_size=example.chunk,
            max_num_batched_tokens=example.chunk,
            max_running_requests=2,
            kv_budget_bytes=1 << 20,
        )
        assert llm.config.num_mtp_layers == example.num_mtp_layers
        prompt = list(example.prompt)
        out = llm.generate([prompt], SamplingParams(max_tokens=MAX_NEW_TOKENS))[0]
        assert out.finish_reason == "length", out.error
        # Teacher forcing on the engine's own output: one transformers forward
        # checks every greedy step, past the window and across chunk borders.
        sequence = prompt + out.token_ids[:-1]
        ref = _hf_logits(hf_model, sequence)
        assert not _mismatches(_swallow_logits(llm.model, sequence), ref)
        assert out.token_ids == ref[len(prompt) - 1 :].argmax(-1).tolist()


# ---------------------------------------------------- the sweep can fail
@dataclass(frozen=True)
class OffByOne:
    name: str
    # Whether the change can alter the logits of this config over n tokens.
    matters: Callable[[ModelConfig, int], bool]
    inject: Callable[[ModelConfig], ModelConfig]


def _with_attention(config: ModelConfig, layer_type: LayerType, **changes: Any) -> ModelConfig:
    field = f"{layer_type}_attention"
    return dataclasses.replace(config, **{field: dataclasses.replace(getattr(config, field), **changes)})


def _factor_giving(rope_dim: int, head_dim: int) -> float:
    # Halfway between integers, so truncation lands on rope_dim whatever the rounding.
    return max(rope_dim + 0.5, 0.0) / head_dim


def _rotary_is_seen(c: ModelConfig, layer_type: LayerType) -> bool:
    """Rotary embedding is relative: a layer whose queries see only themselves
    (a window of 1) is blind to it."""
    attends_to_others = layer_type == "full" or (c.sliding_attention.sliding_window or 0) >= 2
    return layer_type in c.layer_types and attends_to_others


def _rotary_two_smaller(layer_type: LayerType) -> OffByOne:
    def inject(c: ModelConfig) -> ModelConfig:
        spec = c.attention_for(layer_type)
        wrong = _with_attention(
            c, layer_type, partial_rotary_factor=_factor_giving(spec.rope_dim - 2, spec.head_dim)
        )
        assert wrong.attention_for(layer_type).rotary_dim == spec.rotary_dim - 2
        return wrong

    return OffByOne(
        f"{layer_type} rotary dim two smaller",
        lambda c, n: _rotary_is_seen(c, layer_type) and c.attention_for(layer_type).rotary_dim >= 2,
        inject,
    )


def _other_types_theta(layer_type: LayerType) -> OffByOne:
    other: LayerType = "sliding" if layer_type == "full" else "full"

    def matters(c: ModelConfig, n: int) -> bool:
        spec = c.attention_for(layer_type)
        # The first frequency is theta^0 = 1 whatever theta: it takes a second pair.
        return (
            _rotary_is_seen(c, layer_type)
            and spec.rotary_dim >= 4
            and spec.rope_theta != c.attention_for(other).rope_theta
        )

    return OffByOne(
        f"{layer_type} layers with the {other} theta",
        matters,
        lambda c: _with_attention(c, layer_type, rope_theta=c.attention_for(other).rope_theta),
    )


def _window_changed_by(delta: int) -> OffByOne:
    def matters(c: ModelConfig, n: int) -> bool:
        window = c.sliding_attention.sliding_window or 0
        # A query sees one key more or fewer once the sequence outgrows the smaller window.
        return "sliding" in c.layer_types and window + delta >= 1 and n > min(window, window + delta)

    return OffByOne(
        f"sliding window {'one larger' if delta > 0 else 'one smaller'}",
        matters,
        lambda c: _with_attention(c, "sliding", sliding_window=c.sliding_attention.sliding_window + delta),
    )


OFF_BY_ONES = (
    _window_changed_by(+1),
    _window_changed_by(-1),
    _rotary_two_smaller("full"),
    _rotary_two_smaller("sliding"),
    _other_types_theta("full"),
    _other_types_theta("sliding"),
    OffByOne(
        "sliding sinks dropped",
        lambda c, n: "sliding" in c.layer_types,
        lambda c: _with_attention(c, "sliding", has_sinks=False),
    ),
    OffByOne(
        "value scale ignored",
        lambda c, n: c.attention_value_scale != 1.0,
        lambda c: dataclasses.replace(c, attention_value_scale=1.0),
    ),
    OffByOne(
        "norm_topk_prob flipped",
        lambda c, n: "sparse" in c.mlp_layer_types,
        lambda c: dataclasses.replace(c, norm_topk_prob=not c.norm_topk_prob),
    ),
    OffByOne(
        "routed scaling ignored",
        lambda c, n: "sparse" in c.mlp_layer_types and c.routed_scaling_factor != 1.0,
        lambda c: dataclasses.replace(c, routed_scaling_factor=1.0),
    ),
)


@sweep
def test_sweep_fails_on_every_deliberate_off_by_one_that_matters(example: Example) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp) / "checkpoint"
        hf_model = _write_checkpoint(example, checkpoint)
        prompt = list(example.prompt)
        ref = _hf_logits(hf_model, prompt)
        right = load_model(checkpoint).config
        # Control: the config rewritten unchanged still matches, so any failure below is the knob's.
        control = load_model(_checkpoint_with_config(checkpoint, right, Path(tmp) / "control"))
        assert not _mismatches(_swallow_logits(control, prompt), ref)
        unnoticed = []
        for i, knob in enumerate(OFF_BY_ONES):
            if not knob.matters(right, len(prompt)):
                continue
            try:
                model = load_model(_checkpoint_with_config(checkpoint, knob.inject(right), Path(tmp) / str(i)))
            except CheckpointError:
                continue  # noticed at load: e.g. sinks the config no longer has are tensors nothing uses
            if not _mismatches(_swallow_logits(model, prompt), ref):
                unnoticed.append(knob.name)
        assert not unnoticed, f"the comparison missed: {unnoticed}"
