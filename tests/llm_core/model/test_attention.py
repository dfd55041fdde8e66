"""The fused (SDPA) attention computes what the reference does."""

from __future__ import annotations

import pytest
import torch

from llm_core.model.attention import attention_fused, attention_reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d,dv", [(4, 1, 48, 32), (4, 2, 16, 16), (2, 2, 24, 8)])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("n,m", [(37, 37), (5, 40), (1, 12)])
def test_fused_attention_matches_the_reference(dtype: torch.dtype, hq: int, hkv: int, d: int, dv: int,
                                                window: int | None, with_sinks: bool, n: int, m: int) -> None:
    gen = torch.Generator().manual_seed(n * 100 + m)
    q = torch.randn(n, hq, d, generator=gen).to(dtype)
    k = torch.randn(m, hkv, d, generator=gen).to(dtype)
    v = torch.randn(m, hkv, dv, generator=gen).to(dtype)
    sinks = torch.randn(hq, generator=gen) if with_sinks else None
    first = 3  # keys start mid-sequence, queries are the last n of them
    k_pos = torch.arange(first, first + m)
    q_pos = k_pos[-n:]
    ref = attention_reference(q, k, v, q_pos, k_pos, window, sinks)
    out = attention_fused(q, k, v, q_pos, k_pos, window, sinks)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, atol=tolerance, rtol=tolerance)
    if n == m:  # a prompt from position 0: the kernel's own causal mask
        pos = torch.arange(n)
        torch.testing.assert_close(attention_fused(q, k, v, pos, pos, window, sinks, causal_from_zero=True),
                                   attention_reference(q, k, v, pos, pos, window, sinks), atol=tolerance,
                                   rtol=tolerance)


def test_a_sink_changes_the_result_and_a_shifted_window_is_caught() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(6, 2, 8, generator=gen), torch.randn(10, 2, 8, generator=gen), torch.randn(10, 2, 8, generator=gen)
    k_pos = torch.arange(10)
    q_pos = k_pos[-6:]
    sinks = torch.randn(2, generator=gen)
    ref = attention_reference(q, k, v, q_pos, k_pos, 4, sinks)
    assert not torch.allclose(attention_fused(q, k, v, q_pos, k_pos, 4, None), ref, atol=1e-3)
    assert not torch.allclose(attention_fused(q, k, v, q_pos, k_pos, 5, sinks), ref, atol=1e-3)
