"""Attention over paged KV pools: batch metadata and the torch reference path.

A forward batch is a flat list of query tokens from several requests. Each
request's keys have consecutive positions from ``kv_first_pos``; key ``i`` is
found through a page table: slot ``table[kv_start + i // page_size] *
page_size + i % page_size``. For the SWA pool (one token per slot) the table
is the concatenated slots of the live windows -- O(W) per request. For the
full pool it is the engine's persistent block table, where a request's row
starts at ``row * width``: building a step's metadata then costs O(batch)
whatever the context length.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from llm_core.attention import softmax_with_sinks, attention_reference
from llm_core.config import AttentionSpec, ModelConfig
from llm_core.device import to_device


@dataclass(frozen=True)
class DecodeTables:
    """Single-query requests' keys as one padded [B, L] table, for the torch path."""

    rows: torch.Tensor  # [Bd] query row of each
    slots: torch.Tensor  # [Bd, Lmax] int64, padded with slot 0
    key_pos: torch.Tensor  # [Bd, Lmax] int64, -1 where padded


@dataclass(frozen=True)
class PagedBatch:
    """Where one layer type's keys live, for every request of a forward batch."""

    q_pos: torch.Tensor  # [T] int64, absolute position of each query
    q_start: torch.Tensor  # [B] int32, first query row of request b
    q_len: torch.Tensor  # [B] int32
    kv_table: torch.Tensor  # page ids (or slots, with page_size 1) that requests index from kv_start
    kv_start: torch.Tensor  # [B] int32, offset of request b's first page in kv_table
    kv_len: torch.Tensor  # [B] int32
    kv_first_pos: torch.Tensor  # [B] int64, position of request b's first key
    write_slots: torch.Tensor  # [T] int64, slot where each query token's K/V is stored
    page_size: int
    # Host copies of the per-request boundaries, so the torch path does not sync.
    q_bounds: tuple[tuple[int, int], ...]
    kv_bounds: tuple[tuple[int, int, int], ...]  # (start in kv_table, len, first_pos)

    @staticmethod
    def build(
        q_ranges: list[tuple[int, int]],
        kv_slot_lists: Sequence[Sequence[int] | torch.Tensor],
        kv_first_positions: list[int],
        write_slot_lists: Sequence[Sequence[int] | torch.Tensor],
        device: torch.device | str,
    ) -> PagedBatch:
        """From explicit slot lists (page size 1). q_ranges: per request (first
        query position, number of queries). Slot lists may be host int64 tensors."""
        kv = [torch.as_tensor(s, dtype=torch.int64) for s in kv_slot_lists]
        writes = [torch.as_tensor(s, dtype=torch.int64) for s in write_slot_lists]
        starts, offset = [], 0
        for slots in kv:
            starts.append(offset)
            offset += len(slots)
        return PagedBatch._assemble(
            q_ranges, to_device(_cat(kv), device), starts, [len(slots) for slots in kv], kv_first_positions,
            _cat(writes), 1, device,
        )

    @staticmethod
    def from_block_table(
        q_ranges: list[tuple[int, int]],
        table: torch.Tensor,
        rows: Sequence[int],
        write_slots: torch.Tensor,
        page_size: int,
        device: torch.device | str,
    ) -> PagedBatch:
        """From the engine's [rows, width] block table: each request's keys are
        positions [0, end of its queries)."""
        width = table.shape[1]
        return PagedBatch._assemble(
            q_ranges, table.view(-1), [row * width for row in rows], [start + n for start, n in q_ranges],
            [0] * len(q_ranges), write_slots, page_size, device,
        )

    @staticmethod
    def _assemble(
        q_ranges: list[tuple[int, int]],
        kv_table: torch.Tensor,
        kv_starts: list[int],
        kv_lens: list[int],
        kv_first_positions: list[int],
        write_slots: torch.Tensor,
        page_size: int,
        device: torch.device | str,
    ) -> PagedBatch:
        q_bounds, q_off = [], 0
        for _, n in q_ranges:
            q_bounds.append((q_off, n))
            q_off += n

        def i32(values: list[int]) -> torch.Tensor:
            return to_device(torch.tensor(values, dtype=torch.int32), device)

        def i64(values: list[int] | torch.Tensor) -> torch.Tensor:
            return to_device(torch.as_tensor(values, dtype=torch.int64), device)

        return PagedBatch(
            q_pos=i64(_cat([torch.arange(start, start + n) for start, n in q_ranges])),
            q_start=i32([b[0] for b in q_bounds]),
            q_len=i32([b[1] for b in q_bounds]),
            kv_table=kv_table,
            kv_start=i32(kv_starts),
            kv_len=i32(kv_lens),
            kv_first_pos=i64(kv_first_positions),
            write_slots=i64(write_slots),
            page_size=page_size,
            q_bounds=tuple(q_bounds),
            kv_bounds=tuple(zip(kv_starts, kv_lens, kv_first_positions)),
        )

    def key_slots(self, b: int) -> torch.Tensor:
        """Slots of request b's keys in position order (int64, on the batch's device)."""
        start, n, _ = self.kv_bounds[b]
        if self.page_size == 1:
            return self.kv_table[start : start + n].long()
        pages = self.kv_table[start : start - (-n // self.page_size)].long()
        offsets = torch.arange(self.page_size, device=pages.device)
        return (pages[:, None] * self.page_size + offsets).flatten()[:n]

    @cached_property
    def decode(self) -> DecodeTables:
        """Built on first use only (the torch path), once per step for all layers."""
        device = self.kv_table.device
        decode = [b for b, (_, n) in enumerate(self.q_bounds) if n == 1]
        if not decode:
            empty = torch.zeros(0, 0, dtype=torch.int64, device=device)
            return DecodeTables(torch.zeros(0, dtype=torch.int64, device=device), empty, empty)
        index = torch.tensor(decode, device=device)
        longest = max(self.kv_bounds[b][1] for b in decode)
        key = torch.arange(longest, device=device)
        lens = self.kv_len[index].long()[:, None]
        valid = key < lens
        entry = self.kv_start[index].long()[:, None] + key // self.page_size
        pages = self.kv_table[torch.where(valid, entry, 0)].long()
        slots = torch.where(valid, pages * self.page_size + key % self.page_size, 0)
        key_pos = torch.where(valid, self.kv_first_pos[index][:, None] + key, -1)
        return DecodeTables(torch.tensor([self.q_bounds[b][0] for b in decode], device=device), slots, key_pos)


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(tensors) if tensors else torch.zeros(0, dtype=torch.int64)


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
    decode = batch.decode
    if decode.rows.numel():
        out[decode.rows] = _decode_attention_torch(q[decode.rows], k_cache, v_cache, batch, decode, sliding_window,
                                                   sinks)
    for b, ((q0, nq), (_, nk, first)) in enumerate(zip(batch.q_bounds, batch.kv_bounds)):
        if nq == 1:
            continue
        slots = batch.key_slots(b)
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
    decode: DecodeTables,
    sliding_window: int | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    b, hq, d = q.shape
    hkv = k_cache.shape[1]
    group = hq // hkv
    keys = k_cache[decode.slots]  # [B, L, Hkv, D]
    # Padding reads slot 0, which may hold anything: zero it so 0 * value stays 0.
    values = v_cache[decode.slots].masked_fill((decode.key_pos < 0)[:, :, None, None], 0.0)  # [B, L, Hkv, Dv]
    qg = q.view(b, hkv, group, d)
    scores = torch.einsum("bhgd,blhd->bhgl", qg, keys) * d**-0.5
    q_pos = batch.q_pos[decode.rows][:, None]
    key_pos = decode.key_pos
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
