"""Triton kernels for attention over paged KV pools.

Same contract as ``paged_attention_torch``: each request's keys are gathered
from the pool through its page table (``PagedBatch.kv_table``, page size 1
for the SWA pool's slot lists) inside the kernel, so no [keys, heads, dim]
copy is ever materialised. One flash-attention style
kernel serves both prefill/extend and decode; what changes is how the rows of
a program's query tile are laid out:

* extend: a tile holds ``BLOCK_M`` consecutive queries of one head;
* decode: a tile holds the one query of a request for every head of a GQA
  group, so the group shares each K/V load and the tile is tall enough for
  ``tl.dot``.

Set ``TRITON_INTERPRET=1`` before importing this module to run it on CPU
tensors (triton reads the variable when ``triton.jit`` decorates).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from llm_core.kv.paged_attention import PagedBatch, attention_output

_LOG2E = 1.4426950408889634
# tl.dot needs every tile side >= 16; smaller tiles use a broadcast product.
_MIN_DOT = 16


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _attend_block(
    q,
    qpos,
    row_ok,
    m_i,
    l_i,
    acc,
    K,
    V,
    kv_table_ptr,
    kv_start,
    kv_head,
    first_pos,
    n0,
    hi,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    qk_scale,
    window,
    k_scale,
    v_scale,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    USE_DOT: tl.constexpr,
    F32_DOT: tl.constexpr,
    PAGE: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """One key block [n0, n0 + BLOCK_N) of the online softmax; returns the new
    (max, denominator, accumulator)."""
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    n = n0 + tl.arange(0, BLOCK_N)
    n_ok = n < hi
    if PAGE == 1:
        slots = tl.load(kv_table_ptr + kv_start + n, mask=n_ok, other=0).to(tl.int64)
    else:
        pages = tl.load(kv_table_ptr + kv_start + n // PAGE, mask=n_ok, other=0).to(tl.int64)
        slots = pages * PAGE + n % PAGE
    k = tl.load(
        K + slots[:, None] * stride_ks + kv_head * stride_kh + d[None, :],
        mask=n_ok[:, None] & (d[None, :] < D),
        other=0.0,
    )
    if KV_FP8:  # stored = value / scale
        k = (k.to(tl.float32) * k_scale).to(q.dtype)
    else:  # a bfloat16 pool under float32 compute reads as float32
        k = k.to(q.dtype)
    if USE_DOT:
        if F32_DOT:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
    else:
        s = tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
    s = s * qk_scale

    kpos = first_pos + n
    visible = row_ok[:, None] & n_ok[None, :] & (kpos[None, :] <= qpos[:, None])
    if HAS_WINDOW:
        visible = visible & (qpos[:, None] - kpos[None, :] < window)
    s = tl.where(visible, s, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # A row with nothing visible yet keeps max -inf: shift by 0 instead so
    # exp2 sees -inf - 0 (-> 0) rather than -inf - -inf (-> nan).
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)

    v = tl.load(
        V + slots[:, None] * stride_vs + kv_head * stride_vh + dv[None, :],
        mask=n_ok[:, None] & (dv[None, :] < DV),
        other=0.0,
    )
    if KV_FP8:
        v = (v.to(tl.float32) * v_scale).to(q.dtype)
    else:
        v = v.to(q.dtype)
    if USE_DOT:
        if F32_DOT:
            pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
    else:
        # Round p like the dot path (and the torch reference) does.
        pv = tl.sum(p.to(v.dtype).to(tl.float32)[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def _paged_attention_kernel(
    Q,
    K,
    V,
    O,
    Sinks,
    KVScales,  # [2] (k, v) of an FP8 pool; unused otherwise
    q_pos_ptr,
    q_start_ptr,
    q_len_ptr,
    kv_table_ptr,
    kv_start_ptr,
    kv_len_ptr,
    kv_first_pos_ptr,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    qk_scale,  # D ** -0.5 * log2(e): scores live in base 2 so exp2 is used
    window,  # sliding window in positions; ignored unless HAS_WINDOW
    GROUP: tl.constexpr,  # Hq // Hkv
    HEADS_PER_PROG: tl.constexpr,  # query heads in one tile (1, or GROUP for decode)
    Q_PER_PROG: tl.constexpr,  # queries in one tile
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_M: tl.constexpr,  # next_power_of_2(Q_PER_PROG * HEADS_PER_PROG)
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    USE_DOT: tl.constexpr,
    # Dot in true float32: for float32 inputs (no tf32), and in the
    # interpreter, whose tl.dot misreads bfloat16 operands.
    F32_DOT: tl.constexpr,
    INTERPRET: tl.constexpr,
    PAGE: tl.constexpr,  # keys per page-table entry (1: the table lists slots)
    KV_FP8: tl.constexpr,  # K/V are float8_e4m3fn, scaled by KVScales
):
    b = tl.program_id(0)
    head_base = tl.program_id(1) * HEADS_PER_PROG
    q_block = tl.program_id(2)

    q_start = tl.load(q_start_ptr + b)
    q_len = tl.load(q_len_ptr + b)
    kv_start = tl.load(kv_start_ptr + b)
    kv_len = tl.load(kv_len_ptr + b)
    first_pos = tl.load(kv_first_pos_ptr + b)

    if q_block * Q_PER_PROG >= q_len:
        return  # grid is sized for the longest request

    # Tile row r is query (q_block * Q_PER_PROG + r // HEADS_PER_PROG) of the
    # request, for query head head_base + r % HEADS_PER_PROG.
    rows = tl.arange(0, BLOCK_M)
    q_idx = q_block * Q_PER_PROG + rows // HEADS_PER_PROG
    heads = head_base + rows % HEADS_PER_PROG
    row_ok = (rows < Q_PER_PROG * HEADS_PER_PROG) & (q_idx < q_len)
    q_row = (q_start + q_idx).to(tl.int64)
    kv_head = head_base // GROUP  # every head of the tile shares one kv head

    qpos = tl.load(q_pos_ptr + q_row, mask=row_ok, other=0)

    # Key index range [lo, hi) of this tile: later keys are in the future of
    # every query, earlier ones before every window.
    max_qpos = tl.max(tl.where(row_ok, qpos, -1), axis=0)
    hi = tl.minimum(kv_len, max_qpos - first_pos + 1)
    lo = hi * 0
    if HAS_WINDOW:
        min_qpos = tl.min(tl.where(row_ok, qpos, max_qpos), axis=0)
        lo = tl.maximum(lo, min_qpos - window + 1 - first_pos)

    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(
        Q + q_row[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & (d[None, :] < D),
        other=0.0,
    )

    # Online softmax state. A sink is one more logit with no value: starting
    # from it (max = sink, denominator = exp2(0) = 1) adds it exactly once.
    if HAS_SINKS:
        m_i = tl.load(Sinks + heads, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    if KV_FP8:
        k_scale = tl.load(KVScales)
        v_scale = tl.load(KVScales + 1)
    else:
        k_scale = 1.0
        v_scale = 1.0

    # The interpreter cannot use a runtime scalar as a range() bound (numpy
    # >= 2.4 refuses int() of its 1-element arrays); compiled, a for loop is
    # kept because only scf.for gets software pipelining.
    if INTERPRET:
        n0 = lo
        while n0 < hi:
            m_i, l_i, acc = _attend_block(
                q, qpos, row_ok, m_i, l_i, acc, K, V, kv_table_ptr, kv_start, kv_head, first_pos, n0, hi,
                stride_ks, stride_kh, stride_vs, stride_vh, qk_scale, window, k_scale, v_scale,
                D, DV, BLOCK_N, BLOCK_D, BLOCK_DV, HAS_WINDOW, USE_DOT, F32_DOT, PAGE, KV_FP8,
            )  # fmt: skip
            n0 += BLOCK_N
    else:
        for n0 in range(lo, hi, BLOCK_N):
            m_i, l_i, acc = _attend_block(
                q, qpos, row_ok, m_i, l_i, acc, K, V, kv_table_ptr, kv_start, kv_head, first_pos, n0, hi,
                stride_ks, stride_kh, stride_vs, stride_vh, qk_scale, window, k_scale, v_scale,
                D, DV, BLOCK_N, BLOCK_D, BLOCK_DV, HAS_WINDOW, USE_DOT, F32_DOT, PAGE, KV_FP8,
            )  # fmt: skip

    out = acc / tl.where(row_ok, l_i, 1.0)[:, None]  # padding rows have l = 0
    tl.store(
        O + q_row[:, None] * stride_ot + heads[:, None] * stride_oh + dv[None, :],
        out.to(O.dtype.element_ty),
        mask=row_ok[:, None] & (dv[None, :] < DV),
    )


def _launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: PagedBatch,
    sliding_window: int | None,
    sinks: torch.Tensor | None,
    heads_per_prog: int,
    q_per_prog: int,
    block_n: int,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    t, hq, d = q.shape
    hkv, dv = k_cache.shape[1], v_cache.shape[2]
    assert hq % hkv == 0 and k_cache.shape[2] == d and v_cache.shape[1] == hkv
    group = hq // hkv
    assert group % heads_per_prog == 0  # a tile never spans two kv heads
    out = torch.empty((t, hq, dv), dtype=q.dtype, device=q.device)
    max_q = max((n for _, n in batch.q_bounds), default=0)
    if t == 0 or max_q == 0:
        return out
    # The kernel indexes only the last dim as contiguous.
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_cache.stride(-1) != 1:
        k_cache = k_cache.contiguous()
    if v_cache.stride(-1) != 1:
        v_cache = v_cache.contiguous()
    if sinks is not None:
        # The reference adds the sink in the scores' dtype (q's).
        sinks = sinks.to(q.dtype).contiguous()

    block_m = triton.next_power_of_2(q_per_prog * heads_per_prog)
    block_d = max(triton.next_power_of_2(d), _MIN_DOT)
    block_dv = max(triton.next_power_of_2(dv), _MIN_DOT)
    use_dot = block_m >= _MIN_DOT and block_n >= _MIN_DOT
    grid = (len(batch.q_bounds), hq // heads_per_prog, triton.cdiv(max_q, q_per_prog))
    extra = {} if _interpreting() else {"num_warps": 4 if block_m * block_n <= 64 * 64 else 8, "num_stages": 2}
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        sinks if sinks is not None else q,  # unused pointer when HAS_SINKS is off
        kv_scales if kv_scales is not None else q,  # unused pointer when KV_FP8 is off
        batch.q_pos,
        batch.q_start,
        batch.q_len,
        batch.kv_table,
        batch.kv_start,
        batch.kv_len,
        batch.kv_first_pos,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        out.stride(0),
        out.stride(1),
        d**-0.5 * _LOG2E,
        sliding_window if sliding_window is not None else 0,
        GROUP=group,
        HEADS_PER_PROG=heads_per_prog,
        Q_PER_PROG=q_per_prog,
        D=d,
        DV=dv,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        BLOCK_DV=block_dv,
        HAS_WINDOW=sliding_window is not None,
        HAS_SINKS=sinks is not None,
        USE_DOT=use_dot,
        F32_DOT=q.dtype == torch.float32 or _interpreting(),
        INTERPRET=_interpreting(),
        PAGE=batch.page_size,
        KV_FP8=kv_scales is not None,
        **extra,
    )
    return out


def _block_n(d: int) -> int:
    # Big K tiles on the GPU cost registers/shared memory with wide heads
    # (MiMo's D=192 pads to 256); on the interpreter fewer, larger blocks are
    # simply faster.
    if _interpreting():
        return 32
    return 64 if triton.next_power_of_2(d) <= 128 else 32


def extend_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: PagedBatch,
    sliding_window: int | None,
    sinks: torch.Tensor | None,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Prefill / chunked prefill: tiles of consecutive queries of one head."""
    q_per_prog = 16 if _interpreting() else 64
    return _launch(q, k_cache, v_cache, batch, sliding_window, sinks, 1, q_per_prog, _block_n(q.shape[-1]), kv_scales)


def decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: PagedBatch,
    sliding_window: int | None,
    sinks: torch.Tensor | None,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode (every request has q_len == 1): one program per (request, kv
    head) whose tile rows are the GQA group's query heads, so K/V are loaded
    once per group."""
    group = q.shape[1] // k_cache.shape[1]
    return _launch(q, k_cache, v_cache, batch, sliding_window, sinks, group, 1, _block_n(q.shape[-1]), kv_scales)


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: PagedBatch,
    sliding_window: int | None,
    sinks: torch.Tensor | None,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Drop-in for ``paged_attention_torch``: q [T, Hq, D], k_cache [S, Hkv, D],
    v_cache [S, Hkv, Dv] -> [T, Hq, Dv] in q's dtype."""
    if batch.q_bounds and all(n == 1 for _, n in batch.q_bounds):
        return decode_attention_triton(q, k_cache, v_cache, batch, sliding_window, sinks, kv_scales)
    return extend_attention_triton(q, k_cache, v_cache, batch, sliding_window, sinks, kv_scales)


@torch.library.custom_op("swallow::paged_decode_attention", mutates_args=())
def _paged_decode_attention_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pages: torch.Tensor,
    page_size: int,
    kv_len: torch.Tensor,
    q_pos: torch.Tensor,
    sliding_window: int,
    sinks: torch.Tensor | None,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    b, width = pages.shape
    device = q.device
    q_pos, kv_len = q_pos.contiguous(), kv_len.contiguous()  # the kernel indexes them as dense vectors
    batch = PagedBatch(
        q_pos=q_pos,
        q_start=torch.arange(b, dtype=torch.int32, device=device),
        q_len=torch.ones(b, dtype=torch.int32, device=device),
        kv_table=pages.reshape(-1),
        kv_start=torch.arange(0, b * width, width, dtype=torch.int32, device=device),
        kv_len=kv_len.to(torch.int32),
        kv_first_pos=q_pos + 1 - kv_len,
        write_slots=q_pos,  # unused: the K/V are already stored
        page_size=page_size,
        q_bounds=tuple((i, 1) for i in range(b)),  # sizes the grid; no value is read on the host
        kv_bounds=(),
    )
    return decode_attention_triton(q, k_cache, v_cache, batch, sliding_window or None, sinks, kv_scales)


_paged_decode_attention_op.register_fake(attention_output)


def paged_decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pages: torch.Tensor,
    page_size: int,
    kv_len: torch.Tensor,
    q_pos: torch.Tensor,
    sliding_window: int | None,
    sinks: torch.Tensor | None,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Drop-in for ``paged_decode_attention_torch``. A custom op, so a compiled
    forward calls the kernel as one opaque node and a CUDA graph captures it."""
    return torch.ops.swallow.paged_decode_attention(q, k_cache, v_cache, pages, page_size, kv_len, q_pos,
                                                    sliding_window or 0, sinks, kv_scales)
