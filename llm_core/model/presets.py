"""Named model shapes: for capacity math, benchmarks and random test checkpoints."""

from __future__ import annotations

import dataclasses

from llm_core.model.config import AttentionSpec, ModelConfig


def _pattern(num_layers: int, full_layers: set[int]) -> tuple[str, ...]:
    return tuple("full" if i in full_layers else "sliding" for i in range(num_layers))


def _mimo_attention(num_heads: int, num_kv_heads: int, sliding: bool) -> AttentionSpec:
    """MiMo-V2 attention: 192/128 q-k/v head dims, a third of the dims rotated,
    theta 5M on full layers, 10K plus sinks and a 128-token window on SWA layers."""
    return AttentionSpec(
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=192, v_head_dim=128,
        rope_theta=10_000.0 if sliding else 5_000_000.0, partial_rotary_factor=0.334,
        sliding_window=129 if sliding else None, has_sinks=sliding,
    )


def tiny() -> ModelConfig:
    """A few-MB model with every feature of the architecture, for tests and `make serve`."""
    return ModelConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=6,
        layer_types=_pattern(6, {0, 5}),  # type: ignore[arg-type]
        mlp_layer_types=("dense",) + ("sparse",) * 5,
        full_attention=AttentionSpec(
            num_heads=4, num_kv_heads=1, head_dim=48, v_head_dim=32,
            rope_theta=5_000_000.0, partial_rotary_factor=0.334,
            sliding_window=None, has_sinks=False,
        ),
        sliding_attention=AttentionSpec(
            num_heads=4, num_kv_heads=2, head_dim=48, v_head_dim=32,
            rope_theta=10_000.0, partial_rotary_factor=0.334,
            sliding_window=33, has_sinks=True,
        ),
        moe_intermediate_size=64,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        attention_value_scale=0.707,
        max_position_embeddings=8192,
        num_mtp_layers=1,
        bos_token_id=1,
        eos_token_ids=(2,),
        pad_token_id=0,
    )


def tiny_wide() -> ModelConfig:
    """``tiny`` with widths no 64-wide block divides (hidden 96, expert width 40):
    FP8 checkpoints of it have partial scale blocks in both dimensions."""
    return dataclasses.replace(tiny(), hidden_size=96, intermediate_size=160, moe_intermediate_size=40)


def tiny_kv2() -> ModelConfig:
    """``tiny`` with 2 KV heads on full layers (4 on SWA layers, twice as many as
    transformers builds them): a fused qkv_proj comes in 2 chunks, as MiMo-V2.5's in 4."""
    config = tiny()
    return dataclasses.replace(config, full_attention=dataclasses.replace(config.full_attention, num_kv_heads=2),
                               sliding_attention=dataclasses.replace(config.sliding_attention, num_kv_heads=4))


def mimo_v2_flash() -> ModelConfig:
    """MiMo-V2-Flash: 48 layers (full at 0, 5, 11, ..., 47), SWA window 128."""
    full_layers = {0} | {i for i in range(48) if (i + 1) % 6 == 0}
    return ModelConfig(
        vocab_size=152576,
        hidden_size=4096,
        intermediate_size=16384,
        num_hidden_layers=48,
        layer_types=_pattern(48, full_layers),  # type: ignore[arg-type]
        mlp_layer_types=("dense",) + ("sparse",) * 47,
        full_attention=_mimo_attention(64, 4, sliding=False),
        sliding_attention=_mimo_attention(64, 8, sliding=True),
        moe_intermediate_size=2048,
        n_routed_experts=256,
        num_experts_per_tok=8,
        attention_value_scale=0.707,
        max_position_embeddings=262144,
        num_mtp_layers=3,
    )


def mimo_v2_5_pro() -> ModelConfig:
    """MiMo-V2.5-Pro: 70 layers, 10 full, 8 KV heads on both layer types."""
    full_layers = {0, 7, 15, 23, 31, 39, 47, 55, 62, 69}
    return ModelConfig(
        vocab_size=152576,
        hidden_size=6144,
        intermediate_size=16384,
        num_hidden_layers=70,
        layer_types=_pattern(70, full_layers),  # type: ignore[arg-type]
        mlp_layer_types=("dense",) + ("sparse",) * 69,
        full_attention=_mimo_attention(128, 8, sliding=False),
        sliding_attention=_mimo_attention(128, 8, sliding=True),
        moe_intermediate_size=2048,
        n_routed_experts=384,
        num_experts_per_tok=8,
        attention_value_scale=0.707,
        max_position_embeddings=1048576,
        num_mtp_layers=3,
    )


PRESETS = {"tiny": tiny, "tiny-wide": tiny_wide, "tiny-kv2": tiny_kv2, "mimo-v2-flash": mimo_v2_flash,
           "mimo-v2.5-pro": mimo_v2_5_pro}


def get_preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]()
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}") from None
