"""Attention over paged KV pools: batch metadata and the torch reference path.

A forward batch is a flat list of query tokens from several requests. For
each request the metadata lists, in position order, the pool slots of every
key its queries may see (for SWA layers only the live window), and the
position of the first of them: keys have consecutive positions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from llm_core.attention import softmax_with_sinks, attention_reference
from llm_core.config import AttentionSpec, ModelConfig


@dataclass(frozen=True)
class PagedBatch:
    """Where one layer type's keys live, for every request of a forward batch."""

    q_pos: torch.Tensor  # [T] int64, absolute position of each query
    q_start: torch.Tensor  # [B] int32, first query row of request b
    q_len: torch.Tensor  # [B] int32
    kv_slots: torch.Tensor  # [N] int64, concatenated key slots per request
    kv_start: torch.Tensor  # [B] int32, offset of request b in kv_slots
    kv_len: torch.Tensor  # [B] int32
    kv_first_pos: torch.Tensor  # [B] int64, position of request b's first key
    write_slots: torch.Tensor  # [T] int64, slot where each query token's K/V is stored
    # Host copies of the per-request boundaries, so the torch path does not sync.
    q_bounds: tuple[tuple[int, int], ...]
    kv_bounds: tuple[tuple[int, int, int], ...]  # (start, len, first_pos)
    # Requests with a single query (decode), padded to one [B, L] slot table
    # so the torch path attends for all of them at once.
    decode_rows: torch.Tensor  # [Bd] query row of each
    decode_slots: torch.Tensor  # [Bd, Lmax] int64, padded with slot 0
    decode_key_pos: torch.Tensor  # [Bd, Lmax] int64, -1 where padded

    @staticmethod
    def build(
        q_ranges: list[tuple[int, int]],
        kv_slot_lists: Sequence[Sequence[int] | torch.Tensor],
        kv_first_positions: list[int],
        write_slot_lists: Sequence[Sequence[int] | torch.Tensor],
        device: torch.device | str,
    ) -> PagedBatch:
        """q_ranges: per request (first query position, number of queries).
        Slot lists may be host int64 tensors (cheap for long sequences)."""
        kv = [torch.as_tensor(s, dtype=torch.int64) for s in kv_slot_lists]
        writes = [torch.as_tensor(s, dtype=torch.int64) for s in write_slot_lists]
        q_bounds, kv_bounds = [], []
        q_off = kv_off = 0
        for (_, n), slots, first in zip(q_ranges, kv, kv_first_positions):
            q_bounds.append((q_off, n))
            kv_bounds.append((kv_off, len(slots), first))
            q_off += n
            kv_off += len(slots)

        def i32(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=device)

        def i64(values: list[int] | torch.Tensor) -> torch.Tensor:
            return torch.as_tensor(values, dtype=torch.int64).to(device)

        def cat(tensors: list[torch.Tensor]) -> torch.Tensor:
            return i64(torch.cat(tensors) if tensors else torch.zeros(0, dtype=torch.int64))

        decode = [b for b, (_, n) in enumerate(q_ranges) if n == 1]
        if decode:
            decode_slots = torch.nn.utils.rnn.pad_sequence([kv[b] for b in decode], batch_first=True)
            lengths = torch.tensor([len(kv[b]) for b in decode])
            offsets = torch.arange(decode_slots.shape[1])
            firsts = torch.tensor([kv_first_positions[b] for b in decode])
            decode_key_pos = torch.where(offsets < lengths[:, None], firsts[:, None] + offsets, -1)
        else:
            decode_slots = decode_key_pos = torch.zeros(0, 0, dtype=torch.int64)
        q_pos = [torch.arange(start, start + n) for start, n in q_ranges]
        return PagedBatch(
            q_pos=cat(q_pos),
            q_start=i32([b[0] for b in q_bounds]),
            q_len=i32([b[1] for b in q_bounds]),
            kv_slots=cat(kv),
            kv_start=i32([b[0] for b in kv_bounds]),
            kv_len=i32([b[1] for b in kv_bounds]),
            kv_first_pos=i64(kv_first_positions),
            write_slots=cat(writes),
            q_bounds=tuple(q_bounds),
            kv_bounds=tuple(kv_bounds),
            decode_rows=i64([q_bounds[b][0] for b in decode]),
            decode_slots=i64(decode_slots),
            decode_key_pos=i64(decode_key_pos),
        )


def paged_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: PagedBatch,
    sliding_window: int | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Reference: gather each request's keys from the pool and attend.

    q [T, Hq, D]; k_cache [S, Hkv, D]; v_cache [S, Hkv, Dv] -> [T, Hq, Dv].
    Decode rows go through one padded batched product; extend chunks one
    request at a time.
    """
    out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])
    if batch.decode_rows.numel():
        out[batch.decode_rows] = _decode_attention_torch(
            q[batch.decode_rows], k_cache, v_cache, batch, sliding_window, sinks
        )
    for (q0, nq), (k0, nk, first) in zip(batch.q_bounds, batch.kv_bounds):
        if nq == 1:
            continue
        slots = batch.kv_slots[k0 : k0 + nk]
        k_pos = torch.arange(first, first + nk, device=q.device)
        out[q0 : q0 + nq] = attention_reference(
            q[q0 : q0 + nq], k_cache[slots], v_cache[slots], batch.q_pos[q0 : q0 + nq], k_pos, sliding_window, sinks
        )
    return out


def _decode_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: PagedBatch,
    sliding_window: int | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    b, hq, d = q.shape
    hkv = k_cache.shape[1]
    group = hq // hkv
    keys = k_cache[batch.decode_slots]  # [B, L, Hkv, D]
    # Padding reads slot 0, which may hold anything: zero it so 0 * value stays 0.
    values = v_cache[batch.decode_slots].masked_fill(
        (batch.decode_key_pos < 0)[:, :, None, None], 0.0
    )  # [B, L, Hkv, Dv]
    qg = q.view(b, hkv, group, d)
    scores = torch.einsum("bhgd,blhd->bhgl", qg, keys) * d**-0.5
    q_pos = batch.q_pos[batch.decode_rows][:, None]
    key_pos = batch.decode_key_pos
    visible = (key_pos >= 0) & (key_pos <= q_pos)
    if sliding_window is not None:
        visible &= (q_pos - key_pos) < sliding_window
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    sink_logits = None if sinks is None else sinks.view(1, hkv, group, 1)
    probs = softmax_with_sinks(scores, sink_logits)
    out = torch.einsum("bhgl,blhd->bhgd", probs.to(values.dtype), values)
    return out.reshape(b, hq, -1)


class KVCacheTensors:
    """The pools' tensors: one [slots, kv_heads, dim] K and V per layer.

    Full-attention layers share the full pool's slot space, SWA and MTP layers
    the SWA pool's. On ``device="meta"`` nothing is allocated, which is how
    capacity is measured for model shapes that do not fit here.
    """

    def __init__(
        self,
        config: ModelConfig,
        full_slots: int,
        swa_slots: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        full, swa = config.full_attention, config.sliding_attention
        swa_layers = list(config.sliding_layer_ids) + [
            config.num_hidden_layers + j for j in range(config.num_mtp_layers)
        ]
        self._index: dict[int, tuple[bool, int]] = {i: (False, n) for n, i in enumerate(config.full_layer_ids)}
        self._index.update({i: (True, n) for n, i in enumerate(swa_layers)})
        self.full_k = torch.zeros(len(config.full_layer_ids), full_slots, full.num_kv_heads, full.head_dim,
                                  dtype=dtype, device=device)
        self.full_v = torch.zeros(len(config.full_layer_ids), full_slots, full.num_kv_heads, full.v_head_dim,
                                  dtype=dtype, device=device)
        self.swa_k = torch.zeros(len(swa_layers), swa_slots, swa.num_kv_heads, swa.head_dim,
                                 dtype=dtype, device=device)
        self.swa_v = torch.zeros(len(swa_layers), swa_slots, swa.num_kv_heads, swa.v_head_dim,
                                 dtype=dtype, device=device)
        element = torch.empty((), dtype=dtype).element_size()
        self.full_bytes_per_token = len(config.full_layer_ids) * full.kv_elements_per_token * element
        self.swa_bytes_per_token = len(swa_layers) * swa.kv_elements_per_token * element

    def layer(self, layer_idx: int) -> tuple[bool, torch.Tensor, torch.Tensor]:
        """(is_swa_pool, K, V) of one layer."""
        is_swa, n = self._index[layer_idx]
        if is_swa:
            return True, self.swa_k[n], self.swa_v[n]
        return False, self.full_k[n], self.full_v[n]


AttentionFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, PagedBatch, "int | None", "torch.Tensor | None"], torch.Tensor
]


class PagedAttentionBackend:
    """AttentionBackend for one engine step: writes the step's K/V into the
    pools, then attends over each request's visible slots."""

    def __init__(
        self, tensors: KVCacheTensors, full_batch: PagedBatch, swa_batch: PagedBatch, attention_fn: AttentionFn
    ) -> None:
        self.tensors = tensors
        self.full_batch = full_batch
        self.swa_batch = swa_batch
        self.attention_fn = attention_fn

    def attend(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        spec: AttentionSpec,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        is_swa, k_cache, v_cache = self.tensors.layer(layer_idx)
        batch = self.swa_batch if is_swa else self.full_batch
        k_cache.index_copy_(0, batch.write_slots, k.to(k_cache.dtype))
        v_cache.index_copy_(0, batch.write_slots, v.to(v_cache.dtype))
        return self.attention_fn(q, k_cache, v_cache, batch, spec.sliding_window, sinks)
