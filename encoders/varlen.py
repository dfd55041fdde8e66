"""Attention over packed variable-length sequences (block-diagonal, no padding).

Encoders pack the sequences of many items -- images, video frames, attention
windows, audio chunks -- into one ``[tokens, heads, dim]`` tensor described by
cumulative boundaries ``cu_seqlens``. Each segment attends only to itself.

Segments of equal length are gathered into one batched ``scaled_dot_product_attention``
call, so a pack of N same-sized windows costs one kernel, not N, and nothing is
padded. Each segment's result depends only on that segment's rows, which is what
makes a batched forward give the same per-item outputs as encoding items alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

__all__ = ["cu_seqlens_from_lengths", "segments_by_length", "varlen_attention"]


def cu_seqlens_from_lengths(lengths: Sequence[int]) -> list[int]:
    """[3, 5, 2] -> [0, 3, 8, 10]."""
    out = [0]
    for n in lengths:
        out.append(out[-1] + int(n))
    return out


def segments_by_length(cu_seqlens: Sequence[int]) -> dict[int, list[int]]:
    """Segment start offsets grouped by segment length (empty segments dropped)."""
    groups: dict[int, list[int]] = {}
    for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        if end > start:
            groups.setdefault(int(end - start), []).append(int(start))
    return groups


def _gather_index(starts: list[int], length: int, device: torch.device) -> torch.Tensor:
    base = torch.tensor(starts, dtype=torch.int64, device=device)
    return (base[:, None] + torch.arange(length, device=device)[None, :]).reshape(-1)


def _is_contiguous_run(starts: list[int], length: int) -> bool:
    return all(b - a == length for a, b in zip(starts[:-1], starts[1:]))


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: Sequence[int] | torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Non-causal attention of ``q, k, v: [tokens, heads, dim]`` within each segment.

    ``cu_seqlens`` (list or 1-D tensor) holds segment boundaries, starting at 0 and
    ending at ``tokens``. Returns ``[tokens, heads, dim_v]`` in ``q``'s dtype.
    """
    cu = [int(x) for x in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)]
    n, h, _ = q.shape
    if not cu or cu[0] != 0 or cu[-1] != n or any(b < a for a, b in zip(cu[:-1], cu[1:])):
        raise ValueError(f"cu_seqlens {cu[:4]}...{cu[-2:]} does not partition {n} tokens")
    out = q.new_empty((n, h, v.shape[-1]))
    for length, starts in segments_by_length(cu).items():
        count = len(starts)
        if _is_contiguous_run(starts, length):
            lo, hi = starts[0], starts[0] + count * length
            qs, ks, vs = (t[lo:hi].view(count, length, h, -1) for t in (q, k, v))
            idx = None
        else:
            idx = _gather_index(starts, length, q.device)
            qs, ks, vs = (t.index_select(0, idx).view(count, length, h, -1) for t in (q, k, v))
        o = F.scaled_dot_product_attention(
            qs.transpose(1, 2), ks.transpose(1, 2), vs.transpose(1, 2), scale=scale
        ).transpose(1, 2)
        if idx is None:
            out[lo:hi] = o.reshape(count * length, h, -1)
        else:
            out.index_copy_(0, idx, o.reshape(count * length, h, -1))
    return out
