"""A per-request contiguous KV cache and the attention backend over it.

Each request keeps, per layer, a tensor of its keys and values. Full layers
keep the whole sequence; sliding layers keep only the last W tokens, the most
a future query can see.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llm_core.model.attention import attention_reference
from llm_core.model.config import AttentionSpec


@dataclass
class LayerKV:
    k: torch.Tensor
    v: torch.Tensor
    start_pos: int  # absolute position of k[0]


@dataclass
class RequestKVCache:
    layers: dict[int, LayerKV] = field(default_factory=dict)

    def append(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, first_pos: int) -> LayerKV:
        entry = self.layers.get(layer_idx)
        if entry is None:
            entry = LayerKV(k, v, first_pos)
        else:
            if entry.start_pos + entry.k.shape[0] != first_pos:
                raise RuntimeError(
                    f"layer {layer_idx}: appending position {first_pos} after "
                    f"{entry.start_pos + entry.k.shape[0]}"
                )
            entry = LayerKV(torch.cat((entry.k, k)), torch.cat((entry.v, v)), entry.start_pos)
        self.layers[layer_idx] = entry
        return entry

    def trim_to_window(self, layer_idx: int, keep: int) -> None:
        entry = self.layers[layer_idx]
        drop = entry.k.shape[0] - keep
        if drop > 0:
            self.layers[layer_idx] = LayerKV(
                entry.k[drop:].clone(), entry.v[drop:].clone(), entry.start_pos + drop
            )

    def num_tokens(self, layer_idx: int) -> int:
        entry = self.layers.get(layer_idx)
        return 0 if entry is None else entry.k.shape[0]


@dataclass(frozen=True)
class Segment:
    """The tokens one request contributes to a forward: positions [start, start+length)."""

    cache: RequestKVCache
    start: int
    length: int


class ContiguousAttention:
    """AttentionBackend over per-request caches for one flat forward batch."""

    def __init__(self, segments: list[Segment], device: torch.device | str) -> None:
        self.segments = segments
        self.q_positions = [
            torch.arange(s.start, s.start + s.length, device=device) for s in segments
        ]

    def attend(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        spec: AttentionSpec,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        outputs = []
        offset = 0
        for segment, q_pos in zip(self.segments, self.q_positions):
            end = offset + segment.length
            entry = segment.cache.append(layer_idx, k[offset:end], v[offset:end], segment.start)
            k_pos = torch.arange(
                entry.start_pos, entry.start_pos + entry.k.shape[0], device=q.device
            )
            outputs.append(
                attention_reference(
                    q[offset:end], entry.k, entry.v, q_pos, k_pos, spec.sliding_window, sinks
                )
            )
            if spec.sliding_window is not None:
                # The next query sits at the following position and sees window-1 older keys.
                segment.cache.trim_to_window(layer_idx, spec.sliding_window - 1)
            offset = end
        return torch.cat(outputs, dim=0)
