"""Block-scaled FP8 GEMMs in Triton: linear layers and grouped (MoE) experts.

``C = sum over K-blocks kb of (A[:, kb] @ B[:, kb].T) * a_scale[:, kb] * b_scale[n // bn, kb]``
with A the activations quantized per token and ``bk``-wide group (dynamic,
``fp8.quantize_activations``) and B an FP8 weight with one scale per
``bn x bk`` tile. A program's K step is one scale block, so each ``tl.dot``
accumulates 128 products in the tensor cores and is rescaled into a float32
accumulator (the split DeepSeek-V3 uses to keep FP8 accuracy).

The grouped form gathers its A rows through an index (tokens sorted by
expert, each expert's rows padded to the tile height, ``-1`` for padding) and
reads the expert of each row tile from a table, so one launch covers every
expert of a MoE layer and nothing waits on the host.

On CPU the kernels run under ``TRITON_INTERPRET=1`` (set before this module
is imported), which holds float8 tensors and multiplies them exactly.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from llm_core.model.fp8 import quantize_activations

_MIN_DOT = 16


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _block_fp8_gemm_kernel(
    A,
    A_scale,
    B,
    B_scale,
    C,
    scale_row_ptr,  # [N] int32: the B_scale row of each B row (output column)
    a_rows_ptr,  # GATHER: A row of each output row, -1 for padding
    tile_expert_ptr,  # GATHER: expert of each BLOCK_M row tile, -1 for none
    M,
    N,
    stride_am,
    stride_asm,
    stride_be,
    stride_bn,
    stride_bse,
    stride_bsn,
    stride_cm,
    K: tl.constexpr,
    GROUP_K: tl.constexpr,  # also the K tile: one scale per step
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GATHER: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if GATHER:
        expert = tl.load(tile_expert_ptr + pid_m)
        a_rows = tl.load(a_rows_ptr + rows)
        row_ok = a_rows >= 0
    else:
        expert = pid_m * 0
        a_rows = rows
        row_ok = rows < M
    if expert >= 0:
        a_rows = tl.where(row_ok, a_rows, 0).to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        scale_rows = tl.load(scale_row_ptr + cols, mask=col_ok, other=0)
        b_base = B + expert.to(tl.int64) * stride_be
        bs_base = B_scale + expert.to(tl.int64) * stride_bse
        ks = tl.arange(0, GROUP_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, GROUP_K)):
            k = kb * GROUP_K + ks
            k_ok = k < K
            a = tl.load(A + a_rows[:, None] * stride_am + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_base + cols[None, :] * stride_bn + k[:, None], mask=col_ok[None, :] & k_ok[:, None],
                        other=0.0)
            a_s = tl.load(A_scale + a_rows * stride_asm + kb, mask=row_ok, other=0.0)
            b_s = tl.load(bs_base + scale_rows * stride_bsn + kb, mask=col_ok, other=0.0)
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        tl.store(C + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :], acc.to(C.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])


def _tiles(rows: int) -> tuple[int, int]:
    if _interpreting():
        return max(_MIN_DOT, min(64, triton.next_power_of_2(rows))), 64
    return (16 if rows <= 16 else 64), 128


def _launch(
    x_q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
    scale_row: torch.Tensor, group_k: int, out: torch.Tensor, a_rows: torch.Tensor | None,
    tile_expert: torch.Tensor | None, block_m: int, block_n: int,
) -> torch.Tensor:
    n, k = weight.shape[-2:]
    gather = a_rows is not None
    rows = out.shape[0]
    grid = (triton.cdiv(rows, block_m), triton.cdiv(n, block_n))
    expert_stride = weight.stride(0) if weight.dim() == 3 else 0
    scale_stride = weight_scale.stride(0) if weight_scale.dim() == 3 else 0
    extra = {} if _interpreting() else {"num_warps": 4, "num_stages": 3}
    dummy = scale_row  # an unused pointer where GATHER is off
    _block_fp8_gemm_kernel[grid](
        x_q, x_scale, weight, weight_scale, out, scale_row,
        a_rows if gather else dummy, tile_expert if gather else dummy,
        rows, n,
        x_q.stride(0), x_scale.stride(0), expert_stride, weight.stride(-2), scale_stride, weight_scale.stride(-2),
        out.stride(0),
        K=k, GROUP_K=group_k, BLOCK_M=block_m, BLOCK_N=block_n, GATHER=gather, **extra,
    )  # fmt: skip
    return out


def _check(weight: torch.Tensor, weight_scale: torch.Tensor, scale_row: torch.Tensor, group_k: int) -> None:
    n, k = weight.shape[-2:]
    assert weight.dtype == torch.float8_e4m3fn and weight.stride(-1) == 1, "an FP8 weight with contiguous rows"
    assert weight_scale.dtype == torch.float32 and weight_scale.stride(-1) == 1
    assert weight_scale.shape[-1] == -(-k // group_k), "one scale column per K group"
    assert scale_row.dtype == torch.int32 and scale_row.shape == (n,)


def block_fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, scale_row: torch.Tensor, group_k: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for x [..., K], W [N, K] FP8 whose row n is scaled by
    ``weight_scale[scale_row[n], k // group_k]``; x's rows are quantized per
    ``group_k``-group on the fly. Out in x's dtype."""
    _check(weight, weight_scale, scale_row, group_k)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    x_q, x_scale = quantize_activations(x2, group_k)
    out = torch.empty(x2.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block_m, block_n = _tiles(x2.shape[0])
        _launch(x_q, x_scale, weight, weight_scale, scale_row, group_k, out, None, None, block_m, block_n)
    if bias is not None:
        out += bias
    return out.view(*shape[:-1], weight.shape[0])


def grouped_row_layout(expert_ids: torch.Tensor, num_experts: int, block_m: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each (token, choice) slot goes in a grouped product: (slot of each
    row [R], -1 for padding; expert of each ``block_m`` row tile [R / block_m],
    -1 past the last). Rows are sorted by expert and each expert's rows padded to
    a whole tile; R is a bound fixed by the shapes alone, so nothing here syncs."""
    flat = expert_ids.reshape(-1)
    slots = flat.numel()
    device = flat.device
    tiles = -(-slots // block_m) + min(num_experts, slots)
    order = flat.argsort(stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    start = counts.cumsum(0) - counts
    row = torch.arange(tiles * block_m, device=device)
    expert = torch.searchsorted(padded_end, row, right=True).clamp(max=num_experts - 1)
    local = row - padded_start[expert]
    used = (row < padded_end[-1]) & (local < counts[expert])
    slot = torch.where(used, order[(start[expert] + local).clamp(0, max(slots - 1, 0))], -1)
    first_rows = row[::block_m]
    tile_expert = torch.where(first_rows < padded_end[-1], expert[::block_m], -1)
    return slot, tile_expert.to(torch.int32)


def grouped_block_fp8_experts(
    x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor,
    gate_up: torch.Tensor, gate_up_scale: torch.Tensor, gate_up_scale_row: torch.Tensor,
    down: torch.Tensor, down_scale: torch.Tensor, down_scale_row: torch.Tensor, group_k: int,
) -> torch.Tensor:
    """The routed experts' SwiGLU MLP with FP8 weights: x [T, H], routing
    weights and expert ids [T, k]; gate_up [E, 2I, H], down [E, H, I], each with
    its scales [E, S, K / group_k] and the scale row of each weight row (the
    same for every expert). Out [T, H] in x's dtype."""
    _check(gate_up, gate_up_scale, gate_up_scale_row, group_k)
    _check(down, down_scale, down_scale_row, group_k)
    t, top_k = expert_ids.shape
    num_experts, two_i = gate_up.shape[0], gate_up.shape[1]
    block_m, block_n = _tiles(t * top_k)
    slot, tile_expert = grouped_row_layout(expert_ids, num_experts, block_m)
    used = slot >= 0
    token = torch.where(used, slot // top_k, -1)
    x_q, x_scale = quantize_activations(x, group_k)
    h = torch.zeros(slot.shape[0], two_i, dtype=x.dtype, device=x.device)
    _launch(x_q, x_scale, gate_up, gate_up_scale, gate_up_scale_row, group_k, h, token, tile_expert, block_m,
            block_n)
    gate, up = h.chunk(2, dim=-1)
    act_q, act_scale = quantize_activations(torch.nn.functional.silu(gate) * up, group_k)
    rows = torch.arange(slot.shape[0], device=x.device)
    y = torch.zeros(slot.shape[0], down.shape[1], dtype=x.dtype, device=x.device)
    _launch(act_q, act_scale, down, down_scale, down_scale_row, group_k, y, torch.where(used, rows, -1),
            tile_expert, block_m, block_n)
    slot_weight = torch.where(used, weights.reshape(-1)[slot.clamp(min=0)], 0.0).to(y.dtype)
    return torch.zeros_like(x).index_add_(0, token.clamp(min=0), y * slot_weight[:, None])
