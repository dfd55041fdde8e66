"""Attention math shared by every KV layout: the torch reference path.

The model computes q/k/v and hands them to an ``AttentionBackend`` together
with the layer's ``AttentionSpec``; the backend owns where K/V live (a simple
per-request cache here, paged pools in the engine) and calls
``attention_reference`` (or a kernel) on the keys a query may see.
"""

from __future__ import annotations

from typing import Protocol

import torch

from llm_core.config import AttentionSpec

# Queries per block in the reference path: bounds the [heads, q, k] score
# tensor for long prompts without changing the result.
_QUERY_BLOCK = 512


class AttentionBackend(Protocol):
    def attend(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        spec: AttentionSpec,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, Dv] for the step's tokens,
        already rotated and scaled. Stores k/v and returns [T, Hq, Dv]."""
        ...


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    sliding_window: int | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Causal (optionally windowed) GQA attention with optional sink logits.

    q [n, Hq, D], k [m, Hkv, D], v [m, Hkv, Dv]; q_pos [n], k_pos [m] are
    absolute positions. A key is visible when ``k_pos <= q_pos`` and, with a
    window, ``q_pos - k_pos < sliding_window``. A sink is a per-head logit
    that joins the softmax denominator and contributes no value.
    """
    n_rep = q.shape[1] // k.shape[1]
    scale = q.shape[-1] ** -0.5
    kh = k.transpose(0, 1).repeat_interleave(n_rep, dim=0)  # [Hq, m, D]
    vh = v.transpose(0, 1).repeat_interleave(n_rep, dim=0)  # [Hq, m, Dv]
    outputs = []
    for start in range(0, q.shape[0], _QUERY_BLOCK):
        qb = q[start : start + _QUERY_BLOCK].transpose(0, 1)  # [Hq, b, D]
        pos = q_pos[start : start + _QUERY_BLOCK]
        scores = torch.matmul(qb, kh.transpose(1, 2)) * scale  # [Hq, b, m]
        visible = k_pos[None, :] <= pos[:, None]
        if sliding_window is not None:
            visible &= (pos[:, None] - k_pos[None, :]) < sliding_window
        scores = scores.masked_fill(~visible[None], float("-inf"))
        if sinks is not None:
            sink_col = sinks.to(scores.dtype)[:, None, None].expand(-1, scores.shape[1], 1)
            scores = torch.cat((scores, sink_col), dim=-1)
        scores = scores - scores.amax(dim=-1, keepdim=True)
        probs = torch.softmax(scores, dim=-1)
        if sinks is not None:
            probs = probs[..., :-1]
        outputs.append(torch.matmul(probs.to(vh.dtype), vh).transpose(0, 1))  # [b, Hq, Dv]
    return torch.cat(outputs, dim=0)
