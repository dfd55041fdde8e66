"""Partial rotary embedding, odd rotary dims included, bit for bit as transformers."""

from __future__ import annotations

import pytest
import torch

from llm_core.model.config import AttentionSpec
from llm_core.model.layers import apply_partial_rotary, rotary_cos_sin

# (head_dim, partial_rotary_factor): even, odd (16 * 0.334 -> 5), a single
# frequency (18 * 0.1 -> 1), an odd head all but whole (21 * 0.75 -> 15),
# none at all (2 * 0.334 -> 0) and whole heads.
SHAPES = [(16, 0.334), (18, 0.1), (21, 0.75), (9, 0.334), (2, 0.334), (16, 0.0), (192, 0.334), (8, 1.0)]


def _spec(head_dim: int, factor: float, theta: float = 1e4) -> AttentionSpec:
    return AttentionSpec(
        num_heads=4, num_kv_heads=2, head_dim=head_dim, v_head_dim=8, rope_theta=theta,
        partial_rotary_factor=factor, sliding_window=None, has_sinks=False,
    )


def _hf_rotary(head_dim: int, factor: float, theta: float):  # -> MiMoV2FlashRotaryEmbedding
    from transformers import MiMoV2FlashConfig
    from transformers.models.mimo_v2_flash.modeling_mimo_v2_flash import MiMoV2FlashRotaryEmbedding

    rope = {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": factor}
    config = MiMoV2FlashConfig(
        num_hidden_layers=1, head_dim=head_dim, layer_types=["full_attention"],
        rope_parameters={"full_attention": rope, "sliding_attention": rope},
    )
    return MiMoV2FlashRotaryEmbedding(config)


def test_odd_rotary_dim_rotates_whole_pairs() -> None:
    spec = _spec(16, 0.334)
    assert (spec.rope_dim, spec.rotary_dim) == (5, 6)
    assert (_spec(2, 0.334).rope_dim, _spec(2, 0.334).rotary_dim) == (0, 0)
    assert _spec(192, 0.334).rotary_dim == 64


@pytest.mark.parametrize(("head_dim", "factor"), SHAPES)
def test_cos_sin_tables_equal_transformers(head_dim: int, factor: float) -> None:
    theta = 5e6
    positions = torch.arange(300)
    x = torch.zeros(1, 1, 1, dtype=torch.float32)
    ref_cos, ref_sin = _hf_rotary(head_dim, factor, theta)(x, positions[None], "full_attention")
    cos, sin = rotary_cos_sin(positions, _spec(head_dim, factor, theta), torch.float32)
    assert cos.shape == (300, _spec(head_dim, factor).rotary_dim)
    assert torch.equal(cos, ref_cos[0]) and torch.equal(sin, ref_sin[0])


@pytest.mark.parametrize(("head_dim", "factor"), SHAPES)
def test_rotation_equals_transformers(head_dim: int, factor: float) -> None:
    from transformers.models.mimo_v2_flash.modeling_mimo_v2_flash import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(head_dim)
    t, heads = 40, 3
    q, k = torch.randn(2, t, heads, head_dim, generator=gen)
    cos, sin = rotary_cos_sin(torch.arange(t), _spec(head_dim, factor), torch.float32)
    # transformers' layout: [batch, heads, T, D] with cos/sin [batch, T, rotary].
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    assert torch.equal(apply_partial_rotary(q, cos, sin), ref_q[0].transpose(0, 1))
    assert torch.equal(apply_partial_rotary(k, cos, sin), ref_k[0].transpose(0, 1))
