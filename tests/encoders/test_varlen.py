"""varlen_attention: block-diagonal attention equals per-segment attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from encoders.varlen import cu_seqlens_from_lengths, segments_by_length, varlen_attention


def _per_segment(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: list[int], scale: float) -> torch.Tensor:
    outs = []
    for a, b in zip(cu[:-1], cu[1:]):
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))
        weights = torch.softmax((qs @ ks.transpose(1, 2)) * scale, dim=-1)
        outs.append((weights @ vs).transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize(
    "lengths",
    [
        [5],
        [3, 3, 3],  # equal and contiguous: one batched call over a view
        [4, 7, 4, 1, 7, 4],  # equal lengths scattered: gathered
        [2, 0, 6, 0],  # empty segments
    ],
)
def test_matches_per_segment_attention(lengths: list[int]) -> None:
    g = torch.Generator().manual_seed(len(lengths))
    n = sum(lengths)
    q, k = torch.randn(n, 3, 8, generator=g), torch.randn(n, 3, 8, generator=g)
    v = torch.randn(n, 3, 5, generator=g)  # value dim differs from q/k dim
    cu = cu_seqlens_from_lengths(lengths)
    out = varlen_attention(q, k, v, torch.tensor(cu), scale=0.3)
    assert out.shape == (n, 3, 5)
    assert torch.allclose(out, _per_segment(q, k, v, cu, 0.3), atol=1e-6)


def test_segments_never_see_each_other() -> None:
    q = torch.randn(6, 1, 4)
    k, v = q.clone(), torch.randn(6, 1, 4)
    base = varlen_attention(q, k, v, [0, 3, 6])
    v2 = v.clone()
    v2[3:] += 100.0  # change only the second segment
    assert torch.equal(varlen_attention(q, k, v2, [0, 3, 6])[:3], base[:3])
    assert torch.allclose(base, F.scaled_dot_product_attention(
        q.view(2, 3, 1, 4).transpose(1, 2), k.view(2, 3, 1, 4).transpose(1, 2), v.view(2, 3, 1, 4).transpose(1, 2)
    ).transpose(1, 2).reshape(6, 1, 4), atol=1e-6)


def test_grouping_and_bad_boundaries() -> None:
    assert segments_by_length([0, 2, 5, 7, 7]) == {2: [0, 5], 3: [2]}
    for bad in ([0, 4], [1, 6], [0, 4, 3, 6], []):
        with pytest.raises(ValueError, match="partition"):
            varlen_attention(torch.zeros(6, 1, 2), torch.zeros(6, 1, 2), torch.zeros(6, 1, 2), bad)
