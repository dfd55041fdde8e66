"""The data structures inside one mapped store segment and every operation on
them: the open-addressing index (linear probing, backward-shift deletion), block
chains and the free stack, LRU eviction, and the rebuild after a writer died.

Takes no locks: ``SharedEmbeddingStore`` calls it with the lock file held
(shared to read, exclusive to change anything) and its thread lock taken.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from embedding_cache.store_segment import (
    H_COUNT,
    H_DIRTY,
    H_EVICTIONS,
    H_FREE_TOP,
    HEADER_WORDS,
    ITEMSIZES,
    MAX_NDIM,
    NAMES_BY_CODE,
    SLOT_DTYPE,
    SLOT_EMPTY,
    SLOT_OCCUPIED,
    SLOT_PAYLOAD_FIELDS,
    StoreLayout,
)

if TYPE_CHECKING:
    import torch

# LRU victims are picked this many at a time: one O(n_slots) partition per batch.
_EVICTION_BATCH = 16
_TICK_NEVER = np.iinfo(np.int64).max


class StoreTables:
    """Numpy views of a segment's header, slots, block links, free stack and data,
    and the index, block and eviction operations on them."""

    def __init__(self, buf: memoryview, layout: StoreLayout) -> None:
        self._layout = layout
        self._mask = layout.n_slots - 1
        self._header = np.ndarray((HEADER_WORDS,), np.int64, buf, 0)
        self._slots = np.ndarray((layout.n_slots,), SLOT_DTYPE, buf, layout.slots_offset)
        self._slot_state = self._slots["state"]
        self._slot_key = self._slots["key"]
        self._slot_tick = self._slots["tick"]
        self._next = np.ndarray((layout.n_blocks,), np.int32, buf, layout.next_offset)
        self._free = np.ndarray((layout.n_blocks,), np.int32, buf, layout.free_offset)
        self._data = np.ndarray((layout.n_blocks * layout.block_size,), np.uint8, buf, layout.data_offset)

    def release(self) -> None:
        """Drop every view of the segment (SharedMemory.close refuses while numpy
        views still export its buffer)."""
        self._header = self._slots = self._slot_state = self._slot_key = self._slot_tick = None
        self._next = self._free = self._data = None

    @property
    def count(self) -> int:
        """Entries in the store (machine-wide)."""
        return int(self._header[H_COUNT])

    @property
    def evictions(self) -> int:
        """Entries evicted since the segment was created (machine-wide)."""
        return int(self._header[H_EVICTIONS])

    @property
    def dirty(self) -> bool:
        """A writer is mid-mutation, or died in one."""
        return bool(self._header[H_DIRTY])

    @dirty.setter
    def dirty(self, value: bool) -> None:
        self._header[H_DIRTY] = int(value)

    def clear(self) -> None:
        """Remove every entry (the eviction count is kept)."""
        self._slot_state[:] = SLOT_EMPTY
        self._slots[:] = np.zeros((), SLOT_DTYPE)
        self._reset_blocks()
        self._header[H_COUNT] = 0

    # ------------------------------------------------------------------ index

    def _home(self, key: bytes) -> int:
        return xxhash.xxh3_64_intdigest(key) & self._mask

    def find(self, key: bytes) -> int:
        """The slot holding ``key``, or -1. Terminates because the table is at most half full."""
        slot = self._home(key)
        while self._slot_state[slot]:
            if self._slot_key[slot].tobytes() == key:
                return slot
            slot = (slot + 1) & self._mask
        return -1

    def publish(self, key: bytes, dtype_code: int, shape: tuple[int, ...], nbytes: int, first_block: int) -> None:
        slot = self._home(key)
        while self._slot_state[slot]:
            slot = (slot + 1) & self._mask
        record = np.zeros((), SLOT_DTYPE)
        record["key"] = np.frombuffer(key, np.uint8)
        record["nbytes"] = nbytes
        record["tick"] = time.monotonic_ns()
        record["shape"][: len(shape)] = shape
        record["first_block"] = first_block
        record["dtype"] = dtype_code
        record["ndim"] = len(shape)
        self._write_record(slot, record)
        self._header[H_COUNT] += 1

    def _write_record(self, slot: int, record: np.void | np.ndarray) -> None:
        # The value's blocks and every field are in place before the slot becomes visible.
        self._slot_state[slot] = SLOT_EMPTY
        for field in SLOT_PAYLOAD_FIELDS:
            self._slots[field][slot] = record[field]
        self._slot_state[slot] = SLOT_OCCUPIED

    def _unlink_slot(self, hole: int) -> None:
        """Empty ``hole`` by backward shift: later entries of its probe run that may
        legally sit earlier move up, so lookups never need tombstones."""
        mask = self._mask
        slot = hole
        while True:
            slot = (slot + 1) & mask
            if not self._slot_state[slot]:
                break
            home = self._home(self._slot_key[slot].tobytes())
            # Movable iff its home is not cyclically inside (hole, slot].
            if (slot - home) & mask >= (slot - hole) & mask:
                self._write_record(hole, self._slots[slot].copy())
                hole = slot
        self._slot_state[hole] = SLOT_EMPTY

    def remove_entry(self, slot: int) -> None:
        blocks = self._chain(int(self._slots["first_block"][slot]), int(self._slots["nbytes"][slot]))
        # Unlink before freeing, so no occupied slot ever points at a free block.
        self._unlink_slot(slot)
        self._header[H_COUNT] -= 1
        self._push_free(blocks)

    # ------------------------------------------------------------------ blocks

    def blocks_for(self, nbytes: int) -> int:
        # Even an empty value takes a block: an entry always owns a chain.
        return max(1, math.ceil(nbytes / self._layout.block_size))

    def used_blocks(self) -> int:
        return self._layout.n_blocks - int(self._header[H_FREE_TOP])

    def _chain(self, first_block: int, nbytes: int) -> list[int]:
        blocks = [first_block]
        for _ in range(self.blocks_for(nbytes) - 1):
            blocks.append(int(self._next[blocks[-1]]))
        return blocks

    def _pop_free(self, count: int) -> np.ndarray:
        top = int(self._header[H_FREE_TOP])
        blocks = self._free[top - count : top][::-1].copy()
        self._header[H_FREE_TOP] = top - count
        return blocks

    def _push_free(self, blocks: list[int]) -> None:
        # Reversed, so a later pop hands them out in the same (often consecutive) order.
        top = int(self._header[H_FREE_TOP])
        self._free[top : top + len(blocks)] = blocks[::-1]
        self._header[H_FREE_TOP] = top + len(blocks)

    def _reset_blocks(self) -> None:
        n_blocks = self._layout.n_blocks
        # Descending on the stack, so pops start at block 0 and runs stay consecutive.
        self._free[:] = np.arange(n_blocks - 1, -1, -1, dtype=np.int32)
        self._next[:] = -1
        self._header[H_FREE_TOP] = n_blocks

    def store_bytes(self, raw: np.ndarray, n_blocks: int) -> int:
        blocks = self._pop_free(n_blocks)
        self._next[blocks[:-1]] = blocks[1:]
        self._next[blocks[-1]] = -1
        block_size = self._layout.block_size
        position = 0
        for first, count in _runs(blocks.tolist()):
            length = min(count * block_size, raw.nbytes - position)
            start = first * block_size
            self._data[start : start + length] = raw[position : position + length]
            position += length
        return int(blocks[0])

    def read_value(self, key: bytes) -> tuple[torch.Tensor, torch.dtype, tuple[int, ...]] | None:
        import torch  # only a process that reads values (it holds tensors already)

        # A dead writer may have left a slot mid-move: serve misses until a writer repairs.
        if self._header[H_DIRTY]:
            return None
        slot = self.find(key)
        if slot < 0:
            return None
        record = self._slots[slot]
        nbytes = int(record["nbytes"])
        shape = tuple(record["shape"][: int(record["ndim"])].tolist())
        dtype = getattr(torch, NAMES_BY_CODE[int(record["dtype"])])
        # Allocated by torch, not numpy: an empty numpy array converts with stride 0,
        # which torch then refuses to view as a wider dtype.
        raw = torch.empty(nbytes, dtype=torch.uint8)
        out = raw.numpy()
        block_size = self._layout.block_size
        position = 0
        for first, count in _runs(self._chain(int(record["first_block"]), nbytes)):
            length = min(count * block_size, nbytes - position)
            start = first * block_size
            out[position : position + length] = self._data[start : start + length]
            position += length
        # Racing readers may overwrite each other's tick: LRU among them is approximate, which is fine.
        self._slot_tick[slot] = time.monotonic_ns()
        return raw, dtype, shape

    # ------------------------------------------------------------------ eviction

    def _needs_room(self, n_blocks: int) -> bool:
        return (
            int(self._header[H_FREE_TOP]) < n_blocks
            or int(self._header[H_COUNT]) >= self._layout.max_entries
        )

    def make_room(self, n_blocks: int) -> None:
        while self._needs_room(n_blocks):
            victims = self._least_recent_keys(_EVICTION_BATCH)
            if not victims:
                raise RuntimeError("embedding store is full yet holds no entries: index corrupt")
            for key in victims:
                self.remove_entry(self.find(key))
                self._header[H_EVICTIONS] += 1
                if not self._needs_room(n_blocks):
                    return

    def _least_recent_keys(self, limit: int) -> list[bytes]:
        count = min(limit, int(self._header[H_COUNT]))
        if count <= 0:
            return []
        ticks = np.where(self._slot_state != SLOT_EMPTY, self._slot_tick, _TICK_NEVER)
        oldest = np.argpartition(ticks, count - 1)[:count]
        oldest = oldest[np.argsort(ticks[oldest], kind="stable")]
        # Keys, not slots: removing one entry shifts others to new slots.
        return [self._slot_key[slot].tobytes() for slot in oldest.tolist()]

    # ------------------------------------------------------------------ recovery and checks

    def repair(self) -> None:
        """Rebuild the index and free stack after a writer died mid-mutation: keep every
        occupied record whose chain is valid and disjoint from the ones kept before it
        (newest first, so of two copies of one key the fresher wins)."""
        occupied = np.flatnonzero(self._slot_state != SLOT_EMPTY)
        occupied = occupied[np.argsort(-self._slot_tick[occupied], kind="stable")]
        records = self._slots[occupied].copy()
        block_used = np.zeros(self._layout.n_blocks, dtype=bool)
        kept: list[np.void] = []
        seen_keys: set[bytes] = set()
        for record in records:
            key = record["key"].tobytes()
            blocks = self._valid_chain(record)
            if key in seen_keys or blocks is None or block_used[blocks].any():
                continue
            seen_keys.add(key)
            block_used[blocks] = True
            kept.append(record)
        self._slot_state[:] = SLOT_EMPTY
        for record in kept:
            slot = self._home(record["key"].tobytes())
            while self._slot_state[slot]:
                slot = (slot + 1) & self._mask
            self._write_record(slot, record)
        free_blocks = np.flatnonzero(~block_used).astype(np.int32)
        self._free[: free_blocks.size] = free_blocks[::-1]
        self._next[free_blocks] = -1
        self._header[H_FREE_TOP] = free_blocks.size
        self._header[H_COUNT] = len(kept)

    def _valid_chain(self, record: np.void) -> list[int] | None:
        """The record's blocks if it describes a well-formed value, else None."""
        code = int(record["dtype"])
        ndim = int(record["ndim"])
        if code not in ITEMSIZES or ndim > MAX_NDIM:
            return None
        shape = record["shape"][:ndim].tolist()
        nbytes = int(record["nbytes"])
        itemsize = ITEMSIZES[code]
        if min(shape, default=0) < 0 or nbytes != math.prod(shape) * itemsize:
            return None
        blocks = [int(record["first_block"])]
        for _ in range(self.blocks_for(nbytes)):
            if not 0 <= blocks[-1] < self._layout.n_blocks:
                return None
            blocks.append(int(self._next[blocks[-1]]))
        if blocks.pop() != -1 or len(set(blocks)) != len(blocks):
            return None
        return blocks

    def check_invariants(self) -> None:
        """Recompute the structure from scratch and raise AssertionError on any
        inconsistency (for tests and debugging; O(n_slots + n_blocks))."""
        _require(not self._header[H_DIRTY], "dirty flag set with no writer active")
        occupied = np.flatnonzero(self._slot_state != SLOT_EMPTY).tolist()
        _require(len(occupied) == int(self._header[H_COUNT]), "entry count differs from occupied slots")
        _require(len(occupied) <= self._layout.max_entries, "more entries than max_entries")
        owner = np.full(self._layout.n_blocks, -1, dtype=np.int64)
        keys: set[bytes] = set()
        for slot in occupied:
            record = self._slots[slot]
            key = record["key"].tobytes()
            _require(key not in keys, f"key {key.hex()} occupies two slots")
            keys.add(key)
            self._check_reachable(slot, key)
            blocks = self._valid_chain(record)
            _require(blocks is not None, f"slot {slot} holds a malformed record or chain")
            _require(bool((owner[blocks] == -1).all()), f"slot {slot} shares a block with another entry")
            owner[blocks] = slot
        top = int(self._header[H_FREE_TOP])
        free = self._free[:top]
        _require(0 <= top <= self._layout.n_blocks, "free-stack top out of range")
        _require(bool(((free >= 0) & (free < self._layout.n_blocks)).all()), "free stack holds a bad block")
        _require(np.unique(free).size == top, "a block is on the free stack twice")
        _require(bool((owner[free] == -1).all()), "a block is both free and in a chain")
        _require(int((owner >= 0).sum()) + top == self._layout.n_blocks, "blocks leaked")

    def _check_reachable(self, slot: int, key: bytes) -> None:
        probe = self._home(key)
        while probe != slot:
            _require(bool(self._slot_state[probe]), f"slot {slot} is unreachable from its home {self._home(key)}")
            probe = (probe + 1) & self._mask


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def _runs(blocks: list[int]) -> Iterator[tuple[int, int]]:
    """(first block, count) for each run of consecutive block numbers: one slice copy per run."""
    start = blocks[0]
    count = 1
    for block in blocks[1:]:
        if block == start + count:
            count += 1
        else:
            yield start, count
            start, count = block, 1
    yield start, count
