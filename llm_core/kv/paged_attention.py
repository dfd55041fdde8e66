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

from llm_core.model.attention import attention_fused, sdpa_with_sinks, softmax_with_sinks
from llm_core.model.config import ModelConfig
from llm_core.device import to_device
from llm_core.kv.pool_memory import check_fits_in_memory, zeroed
from llm_core.model.fp8 import FP8_DTYPE, FP8_MAX


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
    # The same bounds as one CPU [B, 5] tensor: how a compiled forward hands
    # them to the attention op without guarding on their values.
    host_bounds: torch.Tensor | None = None

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
            host_bounds=torch.tensor([(q0, n, k0, nk, f) for (q0, n), k0, nk, f in
                                      zip(q_bounds, kv_starts, kv_lens, kv_first_positions)],
                                     dtype=torch.int64).view(-1, 5),
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
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference: gather each request's keys from the pool and attend.

    q [T, Hq, D]; k_cache [S, Hkv, D]; v_cache [S, Hkv, Dv] -> [T, Hq, Dv].
    ``kv_scales`` [2] (k, v): an FP8 pool's scales; gathered keys and values
    are dequantized to q's dtype, never the pool.
    With a window narrower than what the requests' keys span, every query of
    the batch attends to exactly its window's keys in one batched product
    (T x W scores, not chunk x keys per request). Otherwise decode rows go
    through one padded batched product and extend chunks one request at a time.
    """
    if sliding_window is not None and _windowed_is_cheaper(batch, sliding_window):
        return _windowed_attention_torch(q, k_cache, v_cache, batch, sliding_window, sinks, kv_scales)
    out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])
    decode = batch.decode
    if decode.rows.numel():
        out[decode.rows] = _decode_attention_torch(q[decode.rows], k_cache, v_cache, batch, decode, sliding_window,
                                                   sinks, kv_scales)
    for b, ((q0, nq), (_, nk, first)) in enumerate(zip(batch.q_bounds, batch.kv_bounds)):
        if nq == 1:
            continue
        slots = batch.key_slots(b)
        k_pos = torch.arange(first, first + nk, device=q.device)
        keys, values = gather_kv(k_cache, v_cache, slots, kv_scales, q.dtype)
        out[q0 : q0 + nq] = attention_fused(
            q[q0 : q0 + nq], keys, values, batch.q_pos[q0 : q0 + nq], k_pos, sliding_window, sinks,
            causal_from_zero=first == 0 and nk == nq,
        )
    return out


# Queries per block of the windowed path: a block sees its queries' windows,
# BLOCK + W - 1 keys, through products big enough to run at speed.
_WINDOW_BLOCK = 64


def _windowed_is_cheaper(batch: PagedBatch, window: int) -> bool:
    blocks = sum(-(-n // _WINDOW_BLOCK) for _, n in batch.q_bounds)
    pairs = sum(nq * nk for (_, nq), (_, nk, _) in zip(batch.q_bounds, batch.kv_bounds))
    return blocks * _WINDOW_BLOCK * (_WINDOW_BLOCK + window - 1) <= pairs


def _windowed_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: PagedBatch,
    window: int,
    sinks: torch.Tensor | None,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Every request's queries in blocks of ``_WINDOW_BLOCK``; a block attends to
    the keys its queries' windows span (positions first - W + 1 .. last), all
    blocks of the batch in one batched product."""
    device, block = q.device, _WINDOW_BLOCK
    t, hq, _ = q.shape
    starts = [(b, q0 + i, n - i) for b, (q0, n) in enumerate(batch.q_bounds) for i in range(0, n, block)]
    request = torch.tensor([b for b, _, _ in starts], device=device)
    first_row = torch.tensor([row for _, row, _ in starts], device=device)
    left = torch.tensor([n for _, _, n in starts], device=device)
    offsets = torch.arange(block, device=device)
    row_ok = offsets[None, :] < left[:, None]  # [nb, block]
    rows = torch.where(row_ok, first_row[:, None] + offsets, 0)
    q_pos = batch.q_pos[rows]  # [nb, block]
    span = block + window - 1
    key_pos = q_pos[:, :1] - window + 1 + torch.arange(span, device=device)  # [nb, span]
    index = key_pos - batch.kv_first_pos[request][:, None]
    key_ok = (index >= 0) & (index < batch.kv_len[request][:, None])
    index = torch.where(key_ok, index, 0)
    entry = batch.kv_start[request].long()[:, None] + index // batch.page_size
    slots = batch.kv_table[entry].long() * batch.page_size + index % batch.page_size
    visible = key_ok[:, None, :] & (key_pos[:, None, :] <= q_pos[:, :, None])
    visible &= (q_pos[:, :, None] - key_pos[:, None, :]) < window  # [nb, block, span]
    # Padding query rows see nothing but would make a row of -inf (NaN): let them see key 0.
    visible[:, :, 0] |= ~row_ok
    qb = q[rows].transpose(1, 2)  # [nb, Hq, block, D]
    keys, values = gather_kv(k_cache, v_cache, slots, kv_scales, q.dtype)
    out_blocks = sdpa_with_sinks(qb, keys.transpose(1, 2), values.transpose(1, 2), visible, sinks)
    out_blocks = out_blocks.transpose(1, 2)  # [nb, block, Hq, Dv]
    out = q.new_empty(t, hq, out_blocks.shape[-1])
    out[rows[row_ok]] = out_blocks[row_ok]
    return out


def _decode_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: PagedBatch,
    decode: DecodeTables,
    sliding_window: int | None,
    sinks: torch.Tensor | None,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    keys, values = gather_kv(k_cache, v_cache, decode.slots, kv_scales, q.dtype)
    return attend_gathered(q, keys, values, decode.key_pos, decode.key_pos >= 0, batch.q_pos[decode.rows],
                           sliding_window, sinks)


def gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, index: torch.Tensor, kv_scales: torch.Tensor | None,
              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``k_cache[index]``, ``v_cache[index]``, dequantized to ``dtype`` from an FP8 pool."""
    if kv_scales is None:  # a pool in the run dtype, or bfloat16 under float32 compute
        return k_cache[index].to(dtype), v_cache[index].to(dtype)
    keys, values = as_bytes(k_cache)[index].view(k_cache.dtype), as_bytes(v_cache)[index].view(v_cache.dtype)
    return dequantize_kv(keys, kv_scales[0], dtype), dequantize_kv(values, kv_scales[1], dtype)


def as_bytes(pool: torch.Tensor) -> torch.Tensor:
    """An FP8 pool seen as uint8 of the same shape: CPU torch does not index float8
    tensors, and bytes are what leave a pool anyway."""
    return pool.view(torch.uint8) if pool.dtype == FP8_DTYPE else pool


def dequantize_kv(stored: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (stored.to(torch.float32) * scale).to(dtype)


def quantize_kv(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """K or V rows as an FP8 pool stores them: value / scale, saturated at the e4m3 maximum."""
    return (values.to(torch.float32) / scale).clamp(-FP8_MAX, FP8_MAX).to(dtype)


def attend_gathered(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_pos: torch.Tensor,
    valid: torch.Tensor,
    q_pos: torch.Tensor,
    sliding_window: int | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """One query per row against its gathered keys: q [B, Hq, D], keys
    [B, L, Hkv, D], values [B, L, Hkv, Dv], key_pos / valid [B, L] -> [B, Hq, Dv].

    Pure tensor code with shapes fixed by (B, L): no host sync, nothing that
    stops ``torch.compile`` or a CUDA graph.
    """
    b, hq, d = q.shape
    hkv = keys.shape[2]
    group = hq // hkv
    # Padding reads slots that may hold anything (a freed request's NaN): zero
    # them so 0 * value stays 0.
    values = torch.where(valid[:, :, None, None], values, 0.0)
    scores = torch.einsum("bhgd,blhd->bhgl", q.view(b, hkv, group, d), keys) * d**-0.5
    visible = valid & (key_pos <= q_pos[:, None])
    if sliding_window is not None:
        visible = visible & ((q_pos[:, None] - key_pos) < sliding_window)
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    sink_logits = None if sinks is None else sinks.view(1, hkv, group, 1)
    probs = softmax_with_sinks(scores, sink_logits)
    out = torch.einsum("bhgl,blhd->bhgd", probs.to(values.dtype), values)
    return out.reshape(b, hq, -1)


@dataclass(frozen=True)
class DecodeBatch:
    """A step in which every request has exactly one query, as tensors only.

    Shapes depend on (requests, full pages of the longest request, window)
    alone and nothing in it is read on the host, so a forward over it can be
    compiled whole and captured into a CUDA graph.
    """

    positions: torch.Tensor  # [B] int64, position of each request's query
    full_pages: torch.Tensor  # [B, P] int32, the first P page ids of each request
    full_write: torch.Tensor  # [B] int64, full-pool slot of the query's K/V
    swa_slots: torch.Tensor  # [B, W] int64, SWA slots of the window's keys in position order, 0-padded
    swa_len: torch.Tensor  # [B] int64, keys in the window (the query's own included)
    swa_write: torch.Tensor  # [B] int64, SWA-pool slot of the query's K/V
    page_size: int


# (q, k_cache, v_cache, pages [B, P], page_size, kv_len [B], q_pos [B], window, sinks, kv_scales) -> [B, Hq, Dv]
DecodeAttentionFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor, torch.Tensor, "int | None",
     "torch.Tensor | None", "torch.Tensor | None"],
    torch.Tensor,
]


def attention_output(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *_: object) -> torch.Tensor:
    """The output every attention op returns, [T, Hq, Dv] (what a compiled
    graph needs to know of a kernel it does not trace)."""
    return q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])


def paged_decode_attention_torch(
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
    """Request b's keys are its last kv_len[b] positions, key i at slot
    pages[b, i // page_size] * page_size + i % page_size. Whole pages are
    gathered (one contiguous block each), not single slots."""
    b, p = pages.shape
    hkv, d, dv = k_cache.shape[1], k_cache.shape[2], v_cache.shape[2]
    n = p * page_size
    index = pages.long()
    keys, values = gather_kv(k_cache.view(-1, page_size, hkv, d), v_cache.view(-1, page_size, hkv, dv), index,
                             kv_scales, q.dtype)
    keys, values = keys.view(b, n, hkv, d), values.view(b, n, hkv, dv)
    key = torch.arange(n, device=q.device)
    valid = key[None, :] < kv_len[:, None]
    key_pos = (q_pos + 1 - kv_len)[:, None] + key[None, :]
    return attend_gathered(q, keys, values, key_pos, valid, q_pos, sliding_window, sinks)


class KVCacheTensors:
    """The pools' tensors: one [slots, kv_heads, dim] K and V per layer.

    Full-attention layers share the full pool's slot space, SWA and MTP layers
    the SWA pool's. Each layer's K and V are tensors of their own rather than
    views of one stacked tensor, so a compiled forward updates them in place.
    Past the allocator's slots each pool has one scratch page: where padding
    rows of a CUDA-graph batch write their K/V. On ``device="meta"`` nothing
    is allocated, which is how capacity is measured for model shapes that do
    not fit here.

    With speculative decoding (``draft_depths`` > 0) the SWA slot space also
    holds, per slot, the hidden states the MTP layers chain on: ``hidden(0)``
    the target's final hidden state at that position, ``hidden(j)`` MTP layer
    j-1's output, so an MTP row can be computed from what the pool holds (on a
    prefix-cache hit too). The MTP layers' K/V and these states also have
    ``draft_slots`` rows past the scratch slot, where drafts that are not yet
    tokens write theirs.

    ``kv_dtype`` (default ``dtype``) is what K and V are stored as; with
    float8_e4m3fn each layer has a (k, v) scale pair (``kv_scales``, default
    1.0): stored = value / scale. The MTP hidden states stay in ``dtype``.
    """

    def __init__(
        self,
        config: ModelConfig,
        full_slots: int,
        swa_slots: int,
        dtype: torch.dtype,
        device: torch.device | str,
        page_size: int = 1,
        mtp_layers: int | None = None,
        draft_depths: int = 0,
        draft_slots: int = 0,
        kv_dtype: torch.dtype | None = None,
        kv_scales: dict[int, tuple[float, float]] | None = None,
    ) -> None:
        full, swa = config.full_attention, config.sliding_attention
        kv_dtype = dtype if kv_dtype is None else kv_dtype
        self.kv_dtype = kv_dtype
        mtp_layers = config.num_mtp_layers if mtp_layers is None else mtp_layers
        mtp_ids = [config.num_hidden_layers + j for j in range(mtp_layers)]
        swa_layers = list(config.sliding_layer_ids) + mtp_ids
        self.page_size = page_size
        self.full_scratch_page = -(-full_slots // page_size)
        self.swa_scratch_slot = swa_slots
        self.draft_slot_base = swa_slots + 1
        full_rows = (self.full_scratch_page + 1) * page_size
        self._layers: dict[int, tuple[bool, torch.Tensor, torch.Tensor]] = {}
        for i in config.full_layer_ids:
            self._layers[i] = (False, zeroed((full_rows, full.num_kv_heads, full.head_dim), kv_dtype, device),
                               zeroed((full_rows, full.num_kv_heads, full.v_head_dim), kv_dtype, device))
        for i in swa_layers:
            rows = swa_slots + 1 + (draft_slots if i in mtp_ids else 0)
            self._layers[i] = (True, zeroed((rows, swa.num_kv_heads, swa.head_dim), kv_dtype, device),
                               zeroed((rows, swa.num_kv_heads, swa.v_head_dim), kv_dtype, device))
        # FP8 pools: one [k, v] scale pair per layer, on the pools' device (read there, never on the host).
        self._scales: dict[int, torch.Tensor] = {}
        if kv_dtype == FP8_DTYPE:
            given = kv_scales or {}
            self._scales = {i: torch.tensor(given.get(i, (1.0, 1.0)), dtype=torch.float32, device=device)
                            for i in self._layers}
        self._hidden = [zeroed((swa_slots + 1 + draft_slots, config.hidden_size), dtype, device)
                        for _ in range(draft_depths)]
        check_fits_in_memory([*(t for _, k, v in self._layers.values() for t in (k, v)), *self._hidden])
        self.shapes = {
            "full_k": [len(config.full_layer_ids), full_rows, full.num_kv_heads, full.head_dim],
            "swa_k": [len(swa_layers), swa_slots + 1, swa.num_kv_heads, swa.head_dim],
        }
        self.device = torch.device(device)
        element = torch.empty((), dtype=kv_dtype).element_size()
        hidden_element = torch.empty((), dtype=dtype).element_size()
        self.full_bytes_per_token = len(config.full_layer_ids) * full.kv_elements_per_token * element
        self.swa_bytes_per_token = (len(swa_layers) * swa.kv_elements_per_token * element
                                    + draft_depths * config.hidden_size * hidden_element)

    def mark_static(self) -> None:
        """For a compiled forward: pools never change size, so it guards on them
        as static tensors (cheap checks), not on symbolic sizes and strides.
        Only an engine that compiles calls it: it imports torch._dynamo."""
        for pool in (*(t for _, k, v in self._layers.values() for t in (k, v)), *self._hidden):
            torch._dynamo.mark_static(pool)

    def layer(self, layer_idx: int) -> tuple[bool, torch.Tensor, torch.Tensor]:
        """(is_swa_pool, K, V) of one layer."""
        return self._layers[layer_idx]

    def scales(self, layer_idx: int) -> torch.Tensor | None:
        """[k_scale, v_scale] of an FP8 pool's layer; None for a pool stored in the run dtype."""
        return self._scales.get(layer_idx)

    def scale_values(self) -> dict[int, tuple[float, float]]:
        """The FP8 pools' scales by layer (empty otherwise): part of what makes KV comparable."""
        return {i: (float(t[0]), float(t[1])) for i, t in self._scales.items() if not t.is_meta}

    @property
    def layer_ids(self) -> list[int]:
        """Every layer with KV here (main and MTP), in order."""
        return sorted(self._layers)

    @property
    def draft_depths(self) -> int:
        return len(self._hidden)

    def hidden(self, depth: int) -> torch.Tensor:
        """[SWA slots, hidden]: the hidden state MTP depth ``depth`` reads at each slot."""
        return self._hidden[depth]

    def pool_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Every tensor indexed by a full slot (each full layer's K then V), and
        every one indexed by an SWA slot (each SWA and MTP layer's K then V,
        then the MTP hidden states), in layer order: the order a page or a
        window is packed in wherever KV leaves the device pools. FP8 pools
        appear as their bytes (uint8 of the same shape)."""
        layers = [self.layer(i) for i in self.layer_ids]
        full = [as_bytes(t) for is_swa, k, v in layers if not is_swa for t in (k, v)]
        swa = [as_bytes(t) for is_swa, k, v in layers if is_swa for t in (k, v)]
        return full, swa + list(self._hidden)

    def store_target_hidden(self, slots: torch.Tensor, hidden: torch.Tensor) -> None:
        """Keep the target's final hidden state of each row at its SWA slot, when
        MTP layers will chain on it (a no-op without speculative decoding)."""
        if self._hidden:
            self._hidden[0].index_put_((slots,), hidden.to(self._hidden[0].dtype))


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, kv_scales: torch.Tensor | None = None) -> None:
    """Write a step's K/V rows into a layer's pool tensors (in place, also when
    compiled); into an FP8 pool divided by its scales."""
    if kv_scales is not None:
        k, v = quantize_kv(k, kv_scales[0], k_cache.dtype), quantize_kv(v, kv_scales[1], v_cache.dtype)
        as_bytes(k_cache).index_put_((slots,), k.view(torch.uint8))
        as_bytes(v_cache).index_put_((slots,), v.view(torch.uint8))
        return
    k_cache.index_put_((slots,), k.to(k_cache.dtype))
    v_cache.index_put_((slots,), v.to(v_cache.dtype))


# (q, k_cache, v_cache, batch, window, sinks, kv_scales) -> [T, Hq, Dv]
AttentionFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, PagedBatch, "int | None", "torch.Tensor | None",
     "torch.Tensor | None"], torch.Tensor
]
