"""Routed experts: the grouped path (no host sync) computes what the dispatched one does."""

from __future__ import annotations

import pytest
import torch

from llm_core.model.layers import RoutedExperts, _grouped_mm_runs


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


def _cpu_kernels() -> object:
    from llm_core.kv import cpu_kernels
    if not cpu_kernels.available():
        pytest.skip("no C++ compiler for the CPU kernels")
    return cpu_kernels


def _routing(tokens: int, num_experts: int, top_k: int, hidden: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(tokens)])
    return x, torch.rand(tokens, top_k, generator=gen), ids


@pytest.mark.parametrize("num_experts,hidden,intermediate,top_k", [(8, 128, 64, 2), (8, 96, 40, 2), (6, 20, 12, 3)])
@pytest.mark.parametrize("tokens", [1, 3, 37, 300])
def test_cpu_experts_kernel_matches_float64_experts(num_experts: int, hidden: int, intermediate: int, top_k: int,
                                                    tokens: int) -> None:
    """Widths no vector divides (96, 40, 20, 12) and row counts no tile divides,
    in both layouts the kernel takes (k-major is what the CPU loader stores)."""
    from llm_core.model.layers import k_major

    kernels = _cpu_kernels()
    experts = _experts(num_experts, hidden, intermediate, torch.float32)
    x, weights, ids = _routing(tokens, num_experts, top_k, hidden, seed=tokens)
    with torch.inference_mode():
        exact = RoutedExperts.over(experts.gate_up_proj.double(), experts.down_proj.double())._dispatched(
            x.double(), weights.double(), ids)
        for gate_up, down in ((experts.gate_up_proj, experts.down_proj),
                              (k_major(experts.gate_up_proj), k_major(experts.down_proj))):
            out = kernels.routed_experts_cpu(x, weights, ids, gate_up, down)
            torch.testing.assert_close(out.double(), exact, atol=1e-5, rtol=1e-5)


def test_cpu_experts_kernel_rows_do_not_depend_on_the_batch() -> None:
    """A token's output is the same bits alone or beside any others (greedy
    output must not change with what else is running)."""
    from llm_core.model.layers import k_major

    kernels = _cpu_kernels()
    experts = _experts(8, 128, 64, torch.float32)
    gate_up, down = k_major(experts.gate_up_proj), k_major(experts.down_proj)
    x, weights, ids = _routing(45, 8, 2, 128, seed=7)
    with torch.inference_mode():
        together = kernels.routed_experts_cpu(x, weights, ids, gate_up, down)
        for rows in (slice(0, 1), slice(3, 6), slice(10, 41)):
            assert torch.equal(kernels.routed_experts_cpu(x[rows], weights[rows], ids[rows], gate_up, down),
                               together[rows])


def test_k_major_experts_take_the_kernel_in_eager_and_traced_forwards() -> None:
    from llm_core.model.layers import _cpu_kernel_runs, k_major

    _cpu_kernels()
    experts = _experts(8, 64, 32, torch.float32)
    x, weights, ids = _routing(20, 8, 2, 64, seed=4)
    assert not _cpu_kernel_runs(x, experts.gate_up_proj, experts.down_proj)  # as built: row-major
    packed = RoutedExperts.over(k_major(experts.gate_up_proj), k_major(experts.down_proj))
    assert _cpu_kernel_runs(x, packed.gate_up_proj, packed.down_proj)
    assert not _cpu_kernel_runs(x.double(), packed.gate_up_proj.double(), packed.down_proj.double())
    traced = torch.compile(packed, fullgraph=True, dynamic=True, backend="aot_eager")
    with torch.inference_mode():
        reference = experts._dispatched(x, weights, ids)
        torch.testing.assert_close(packed(x, weights, ids), reference, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(traced(x, weights, ids), reference, atol=1e-5, rtol=1e-5)


def test_cpu_experts_kernel_rejects_an_expert_id_out_of_range() -> None:
    kernels = _cpu_kernels()
    experts = _experts(4, 32, 16, torch.float32)
    x, weights, ids = _routing(3, 4, 2, 32, seed=5)
    ids[1, 0] = 4
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.routed_experts_cpu(x, weights, ids, experts.gate_up_proj, experts.down_proj)


def test_the_cpu_loader_stores_float32_experts_k_major(hf_checkpoint) -> None:  # noqa: ANN001
    from llm_core.model.layers import _cpu_kernel_runs
    from llm_core.loading.weights import load_model

    _cpu_kernels()
    model = load_model(hf_checkpoint)
    experts = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    assert experts and all(_cpu_kernel_runs(torch.zeros(1, e.gate_up_proj.shape[2]), e.gate_up_proj, e.down_proj)
                           for e in experts)
