"""Routed experts: the grouped path (no host sync) computes what the dispatched one does."""

from __future__ import annotations

import pytest
import torch

from llm_core.layers import RoutedExperts, _grouped_mm_runs


def _experts(num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype) -> RoutedExperts:
    torch.manual_seed(0)
    experts = RoutedExperts(num_experts, hidden, intermediate)
    torch.nn.init.normal_(experts.gate_up_proj, std=0.1)
    torch.nn.init.normal_(experts.down_proj, std=0.1)
    return experts.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_experts,hidden,intermediate,tokens,top_k",
                         [(8, 128, 64, 1, 2), (8, 128, 64, 37, 2), (16, 64, 32, 200, 4), (4, 32, 16, 5, 4)])
def test_grouped_experts_match_the_dispatched_ones(
    dtype: torch.dtype, num_experts: int, hidden: int, intermediate: int, tokens: int, top_k: int
) -> None:
    experts = _experts(num_experts, hidden, intermediate, dtype)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen)
    with torch.inference_mode():
        assert _grouped_mm_runs(x, experts.gate_up_proj, experts.down_proj)
        grouped = experts(x, weights, ids)
        dispatched = experts._dispatched(x, weights, ids)
    tolerance = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(grouped, dispatched, atol=tolerance, rtol=tolerance)


def test_grouped_products_are_used_only_where_they_run() -> None:
    experts = _experts(4, 32, 16, torch.float32)
    x = torch.randn(3, 32)
    assert _grouped_mm_runs(x, experts.gate_up_proj, experts.down_proj)
    odd = _experts(4, 32, 10, torch.float32)  # 40-byte rows
    assert not _grouped_mm_runs(x, odd.gate_up_proj, odd.down_proj)
    shifted = torch.empty(4 * 32 * 32 + 1)[1:].view(4, 32, 32)  # data 4 bytes off alignment
    assert not _grouped_mm_runs(x, shifted, experts.down_proj)
    assert not _grouped_mm_runs(x.half(), experts.gate_up_proj.half(), experts.down_proj.half())


@pytest.mark.parametrize("tokens,top_k", [(1, 2), (33, 2), (64, 4)])
def test_dense_experts_for_traced_forwards_match_the_dispatched_ones(tokens: int, top_k: int) -> None:
    experts = _experts(8, 64, 32, torch.float32)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(tokens, 64, generator=gen)
    ids = torch.stack([torch.randperm(8, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen)
    with torch.inference_mode():
        torch.testing.assert_close(experts._dense(x, weights, ids), experts._dispatched(x, weights, ids),
                                   atol=1e-5, rtol=1e-5)


def test_traced_experts_use_dense_products_for_decode_and_the_opaque_op_for_prefill() -> None:
    experts = _experts(8, 64, 32, torch.float32)
    traced = torch.compile(experts, fullgraph=True, dynamic=True, backend="aot_eager")
    gen = torch.Generator().manual_seed(3)
    for tokens in (16, 300):  # below and above the dense limit: both trace whole
        x = torch.randn(tokens, 64, generator=gen)
        ids = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(tokens)])
        weights = torch.rand(tokens, 2, generator=gen)
        with torch.inference_mode():
            torch.testing.assert_close(traced(x, weights, ids), experts._dispatched(x, weights, ids),
                                       atol=1e-5, rtol=1e-5)
