"""Attention math shared by every KV layout: the torch reference path.

The model computes q/k/v and hands them to an ``AttentionBackend`` together
with the layer's ``AttentionSpec``; the backend owns where K/V live (a simple
per-request cache here, paged pools in the engine) and calls
``attention_reference`` (or a kernel) on the keys a query may see.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from llm_core.model.config import AttentionSpec

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
    n, hq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    scale = d**-0.5
    # Grouped heads: query head h uses KV head h // group, without copying K/V.
    kh = k.permute(1, 0, 2)[:, None]  # [Hkv, 1, m, D]
    vh = v.permute(1, 0, 2)[:, None]  # [Hkv, 1, m, Dv]
    sink_logits = None if sinks is None else sinks.view(hkv, group, 1, 1)
    outputs = []
    for start in range(0, n, _QUERY_BLOCK):
        qb = q[start : start + _QUERY_BLOCK]
        b = qb.shape[0]
        qg = qb.view(b, hkv, group, d).permute(1, 2, 0, 3)  # [Hkv, G, b, D]
        pos = q_pos[start : start + _QUERY_BLOCK]
        visible = k_pos[None, :] <= pos[:, None]
        if sliding_window is not None:
            visible &= (pos[:, None] - k_pos[None, :]) < sliding_window
        scores = torch.matmul(qg, kh.transpose(-1, -2)) * scale  # [Hkv, G, b, m]
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = softmax_with_sinks(scores, sink_logits)
        out = torch.matmul(probs.to(vh.dtype), vh)  # [Hkv, G, b, Dv]
        outputs.append(out.permute(2, 0, 1, 3).reshape(b, hq, -1))
    return torch.cat(outputs, dim=0)


def attention_fused(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    sliding_window: int | None,
    sinks: torch.Tensor | None,
    causal_from_zero: bool = False,
) -> torch.Tensor:
    """``attention_reference`` through torch's fused SDPA kernel.

    ``causal_from_zero``: the caller knows query i sits at key i (a prompt
    with no prefix), so the kernel may skip the masked half instead of
    reading a mask.
    """
    causal = causal_from_zero and sliding_window is None and sinks is None
    visible = None
    if not causal:
        visible = k_pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            visible &= (q_pos[:, None] - k_pos[None, :]) < sliding_window
    out = sdpa_with_sinks(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                          None if visible is None else visible[None], sinks)
    return out[0].transpose(0, 1)


def sdpa_with_sinks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None, sinks: torch.Tensor | None
) -> torch.Tensor:
    """q [N, Hq, n, D], k [N, Hkv, m, D], v [N, Hkv, m, Dv], visible [N, n, m]
    (None: causal from key 0) -> [N, Hq, n, Dv].

    A sink is a zero key whose score the mask sets to the sink logit: it joins
    the denominator and adds nothing to the output. Equal Q/K and V head dims
    keep SDPA on its flash kernel, so V is zero-padded and the output sliced.
    """
    batch, hq, n, d = q.shape
    hkv, m, dv = k.shape[1], k.shape[2], v.shape[-1]
    if dv < d:
        v = F.pad(v, (0, d - dv))
    mask: torch.Tensor | None = None if visible is None else visible[:, None]
    if sinks is not None:
        if visible is None:
            visible = torch.ones(n, m, dtype=torch.bool, device=q.device).tril_(m - n)[None]
        k = torch.cat((k, k.new_zeros(batch, hkv, 1, d)), dim=2)
        v = torch.cat((v, v.new_zeros(batch, hkv, 1, v.shape[-1])), dim=2)
        bias = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill_(~visible, float("-inf"))
        sink_col = sinks.to(q.dtype)[None, :, None, None].expand(batch, hq, n, 1)
        mask = torch.cat((bias[:, None].expand(batch, hq, n, m), sink_col), dim=-1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=d**-0.5,
                                         enable_gqa=hq != hkv)
    return out[..., :dv]


def softmax_with_sinks(scores: torch.Tensor, sink_logits: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim; a sink logit joins the denominator only."""
    if sink_logits is not None:
        sink_col = sink_logits.to(scores.dtype).expand(*scores.shape[:-1], 1)
        scores = torch.cat((scores, sink_col), dim=-1)
    scores = scores - scores.amax(dim=-1, keepdim=True)
    probs = torch.softmax(scores, dim=-1)
    return probs[..., :-1] if sink_logits is not None else probs
