"""An LRU cache of embedding tensors in one shared-memory segment, shared by every
server process on the machine.

Segment layout (all offsets fixed by block_size, n_blocks and n_slots, which the
header records so that ``attach`` needs nothing but the name)::

    header      16 int64 words (magic, layout version, geometry, counters)
    slots       n_slots index records: open addressing, linear probing,
                backward-shift deletion (no tombstones to pile up)
    next        int32 per block: the next block of the same value, -1 ends it
    free        int32 stack of free blocks, ``free_top`` of them valid
    data        n_blocks * block_size bytes

A value is its raw contiguous bytes spread over a chain of whole blocks, so any
size fits without fragmentation: evicting an entry frees exactly its blocks.

Concurrency: an ``flock`` on a lock file beside the segment (shared for readers,
exclusive for writers) orders processes, and the kernel drops it if a process
dies; flock does not exclude two threads sharing one open file, so each instance
also serialises its own operations with a ``threading.Lock``. A writer sets a
``dirty`` flag for the length of its mutation; finding it set means a writer died
half-way, and the next writer rebuilds the index and free stack from the records
that are intact (a slot is only ever marked occupied once its record is complete).
"""

from __future__ import annotations

import fcntl
import math
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory

import _posixshmem  # the unlink primitive without SharedMemory.unlink's tracker bookkeeping
import numpy as np
import torch
import xxhash

from embedding_cache.keys import KEY_BYTES, tensor_bytes

__all__ = ["DTYPE_CODES", "MAX_NDIM", "SharedEmbeddingStore", "StoreLayoutError"]

MAX_NDIM = 6

# Codes live in shared memory and outlive any one process: never renumber, only append.
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.int32: 4,
    torch.int64: 5,
    torch.uint8: 6,
    torch.float64: 7,
    torch.int8: 8,
    torch.int16: 9,
    torch.bool: 10,
}
_DTYPES_BY_CODE: dict[int, torch.dtype] = {code: dtype for dtype, code in DTYPE_CODES.items()}

_MAGIC = int.from_bytes(b"SWEMBCAC", "little")
_LAYOUT_VERSION = 1

# Header words.
_H_MAGIC = 0
_H_VERSION = 1
_H_BLOCK_SIZE = 2
_H_N_BLOCKS = 3
_H_N_SLOTS = 4
_H_MAX_ENTRIES = 5
_H_FREE_TOP = 6
_H_COUNT = 7
_H_EVICTIONS = 8
_H_DIRTY = 9
_HEADER_WORDS = 16
_HEADER_BYTES = 256

_SLOT_EMPTY = 0
_SLOT_OCCUPIED = 1

_SLOT_DTYPE = np.dtype(
    [
        ("key", np.uint8, (KEY_BYTES,)),
        ("nbytes", "<i8"),
        ("tick", "<i8"),
        ("shape", "<i8", (MAX_NDIM,)),
        ("first_block", "<i4"),
        ("state", np.uint8),
        ("dtype", np.uint8),
        ("ndim", np.uint8),
        ("reserved", np.uint8),
    ]
)
# Every field but "state": copied first, so a slot never shows as occupied with a half-written record.
_SLOT_PAYLOAD_FIELDS = tuple(name for name in _SLOT_DTYPE.names if name != "state")

_MIN_BLOCK_SIZE = 64
# LRU victims are picked this many at a time: one O(n_slots) partition per batch.
_EVICTION_BATCH = 16
_TICK_NEVER = np.iinfo(np.int64).max


class StoreLayoutError(ValueError):
    """The named segment is not an embedding store this code can read."""


@dataclass(frozen=True)
class StoreLayout:
    """Where each table lives in the segment; a pure function of the geometry."""

    block_size: int
    n_blocks: int
    n_slots: int
    max_entries: int

    @classmethod
    def plan(cls, capacity_bytes: int, block_size: int, max_entries: int | None) -> StoreLayout:
        if block_size < _MIN_BLOCK_SIZE or block_size % _MIN_BLOCK_SIZE:
            raise ValueError(f"block_size must be a positive multiple of {_MIN_BLOCK_SIZE}, got {block_size}")
        n_blocks = capacity_bytes // block_size
        if n_blocks < 1:
            raise ValueError(f"capacity_bytes {capacity_bytes} is smaller than one block ({block_size})")
        if n_blocks > np.iinfo(np.int32).max:
            raise ValueError("too many blocks for int32 block numbers: use a larger block_size")
        # Every entry holds at least one block, so more entries than blocks can never coexist.
        entries = n_blocks if max_entries is None else min(max_entries, n_blocks)
        if entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries}")
        # Load factor <= 1/2 keeps linear-probing runs short.
        n_slots = 1 << max(1, (2 * entries - 1).bit_length())
        return cls(block_size=block_size, n_blocks=n_blocks, n_slots=n_slots, max_entries=entries)

    @property
    def slots_offset(self) -> int:
        return _HEADER_BYTES

    @property
    def next_offset(self) -> int:
        return _align(self.slots_offset + self.n_slots * _SLOT_DTYPE.itemsize, 64)

    @property
    def free_offset(self) -> int:
        return _align(self.next_offset + 4 * self.n_blocks, 64)

    @property
    def data_offset(self) -> int:
        return _align(self.free_offset + 4 * self.n_blocks, 4096)

    @property
    def total_bytes(self) -> int:
        return self.data_offset + self.n_blocks * self.block_size


class SharedEmbeddingStore:
    """A machine-wide LRU map from 32-byte keys to tensors, in shared memory.

    Build with ``create``, ``attach`` or ``open``. One instance is safe to use from
    many threads. Other processes attach by name; an instance inherited across
    fork also works (it takes its own lock descriptor on first use).
    """

    def __init__(self, shm: SharedMemory, lock_fd: int, lock_path: str, layout: StoreLayout) -> None:
        self._shm = shm
        self._lock_fd = lock_fd
        self._lock_path = lock_path
        self._pid = os.getpid()
        self._layout = layout
        self._mask = layout.n_slots - 1
        self._thread_lock = threading.Lock()
        self._closed = False
        self._hits = 0
        self._misses = 0
        self._puts = 0
        self._map_tables()

    # ------------------------------------------------------------------ construction

    @classmethod
    def create(
        cls, name: str, capacity_bytes: int, *, block_size: int = 64 * 1024, max_entries: int | None = None
    ) -> SharedEmbeddingStore:
        """A new, empty store; FileExistsError if the name is taken."""
        layout = StoreLayout.plan(capacity_bytes, block_size, max_entries)
        return cls._under_lock_file(name, fcntl.LOCK_EX, lambda: (_create_segment(name, layout), layout))

    @classmethod
    def attach(cls, name: str) -> SharedEmbeddingStore:
        """The existing store ``name``; FileNotFoundError if there is none,
        StoreLayoutError if the segment is not a store of this layout version."""
        # attach must not leave a lock file for a store that never was.
        return cls._under_lock_file(name, fcntl.LOCK_SH, lambda: _attach_segment(name), keep_lock_file=False)

    @classmethod
    def open(
        cls, name: str, capacity_bytes: int, *, block_size: int = 64 * 1024, max_entries: int | None = None
    ) -> SharedEmbeddingStore:
        """Attach to ``name`` if it exists, else create it. Safe when many processes
        race to open the same name. An existing store keeps its own geometry."""
        layout = StoreLayout.plan(capacity_bytes, block_size, max_entries)

        def attach_or_create() -> tuple[SharedMemory, StoreLayout]:
            try:
                return _attach_segment(name)
            except FileNotFoundError:
                return _create_segment(name, layout), layout

        # Holding the exclusive lock across "is it there? else create" makes the pair atomic.
        return cls._under_lock_file(name, fcntl.LOCK_EX, attach_or_create)

    @classmethod
    def _under_lock_file(cls, name: str, mode: int, segment: Callable[[], tuple[SharedMemory, StoreLayout]],
                         *, keep_lock_file: bool = True) -> SharedEmbeddingStore:
        """The store on the segment ``segment()`` creates or attaches while the
        lock file is held in ``mode``; the store keeps the lock file's descriptor,
        unlocked. ``keep_lock_file=False``: a missing segment removes the lock file."""
        lock_fd, lock_path = _acquire_lock_file(name, mode)
        try:
            shm, layout = segment()
        except BaseException as exc:
            if not keep_lock_file and isinstance(exc, FileNotFoundError):
                _remove_quietly(lock_path)
            os.close(lock_fd)
            raise
        fcntl.flock(lock_fd, fcntl.LOCK_UN)
        return cls(shm, lock_fd, lock_path, layout)

    def _map_tables(self) -> None:
        buf = self._shm.buf
        layout = self._layout
        self._header = np.ndarray((_HEADER_WORDS,), np.int64, buf, 0)
        self._slots = np.ndarray((layout.n_slots,), _SLOT_DTYPE, buf, layout.slots_offset)
        self._slot_state = self._slots["state"]
        self._slot_key = self._slots["key"]
        self._slot_tick = self._slots["tick"]
        self._next = np.ndarray((layout.n_blocks,), np.int32, buf, layout.next_offset)
        self._free = np.ndarray((layout.n_blocks,), np.int32, buf, layout.free_offset)
        self._data = np.ndarray((layout.n_blocks * layout.block_size,), np.uint8, buf, layout.data_offset)

    # ------------------------------------------------------------------ public API

    @property
    def name(self) -> str:
        return self._shm.name

    @property
    def capacity_bytes(self) -> int:
        return self._layout.n_blocks * self._layout.block_size

    @property
    def block_size(self) -> int:
        return self._layout.block_size

    @property
    def max_entries(self) -> int:
        return self._layout.max_entries

    @property
    def used_bytes(self) -> int:
        with self._reading():
            return self._used_blocks() * self._layout.block_size

    def get(self, key: bytes) -> torch.Tensor | None:
        """A copy of the value under ``key`` (the blocks may be reused as soon as the
        lock is released), or None. A hit makes the entry most recently used."""
        _check_key(key)
        with self._reading():
            found = self._read_value(key)
            if found is None:
                self._misses += 1
                return None
            self._hits += 1
        raw, dtype, shape = found
        return raw.view(dtype).reshape(shape)

    def put(self, key: bytes, value: torch.Tensor) -> bool:
        """Store ``value`` under ``key`` (replacing any value there), evicting least
        recently used entries as needed. False, with nothing evicted, if the value is
        larger than the whole store."""
        _check_key(key)
        dtype_code = _dtype_code(value.dtype)
        if value.dim() > MAX_NDIM:
            raise ValueError(f"values have at most {MAX_NDIM} dimensions, got shape {tuple(value.shape)}")
        raw = tensor_bytes(value)
        n_blocks = self._blocks_for(raw.nbytes)
        if n_blocks > self._layout.n_blocks:
            return False
        with self._writing():
            existing = self._find(key)
            if existing >= 0:
                self._remove_entry(existing)
            self._make_room(n_blocks)
            first_block = self._store_bytes(raw, n_blocks)
            self._publish(key, dtype_code, tuple(value.shape), raw.nbytes, first_block)
            self._puts += 1
        return True

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            return False
        with self._reading():
            return not self._header[_H_DIRTY] and self._find(key) >= 0

    def delete(self, key: bytes) -> bool:
        """Remove ``key``; False if it was not there."""
        _check_key(key)
        with self._writing():
            slot = self._find(key)
            if slot < 0:
                return False
            self._remove_entry(slot)
            return True

    def clear(self) -> None:
        """Remove every entry (the machine-wide eviction count is kept)."""
        with self._writing():
            self._slot_state[:] = _SLOT_EMPTY
            self._slots[:] = np.zeros((), _SLOT_DTYPE)
            self._reset_blocks()
            self._header[_H_COUNT] = 0

    def __len__(self) -> int:
        with self._reading():
            return int(self._header[_H_COUNT])

    def stats(self) -> dict[str, int]:
        """entries, used_bytes, capacity_bytes and evictions are machine-wide;
        hits, misses and puts count this instance's calls."""
        with self._reading():
            return {
                "entries": int(self._header[_H_COUNT]),
                "used_bytes": self._used_blocks() * self._layout.block_size,
                "capacity_bytes": self.capacity_bytes,
                "evictions": int(self._header[_H_EVICTIONS]),
                "hits": self._hits,
                "misses": self._misses,
                "puts": self._puts,
            }

    def close(self) -> None:
        """Detach this instance; the segment stays for other processes. Idempotent."""
        with self._thread_lock:
            if self._closed:
                return
            self._closed = True
            # SharedMemory.close refuses while numpy views still export its buffer.
            self._header = self._slots = self._slot_state = self._slot_key = self._slot_tick = None
            self._next = self._free = self._data = None
            self._shm.close()
            os.close(self._lock_fd)

    def unlink(self) -> None:
        """Remove the segment and its lock file (processes still attached keep their
        mapping until they close). Call once, when no process needs the store."""
        lock_fd, _ = _acquire_lock_file(self._shm.name, fcntl.LOCK_EX)
        try:
            try:
                _posixshmem.shm_unlink(self._shm._name)
            except FileNotFoundError:
                pass
            _remove_quietly(self._lock_path)
        finally:
            os.close(lock_fd)

    def __enter__(self) -> SharedEmbeddingStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Release the views before SharedMemory's own finaliser tries to close the mapping.
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.capacity_bytes} bytes"
        return f"SharedEmbeddingStore({self.name!r}, {state})"

    # ------------------------------------------------------------------ locking

    @contextmanager
    def _locked(self, mode: int) -> Iterator[None]:
        """This thread alone, and the store's lock file held in ``mode`` across processes."""
        with self._thread_lock:
            self._check_open()
            fcntl.flock(self._own_lock_fd(), mode)
            try:
                yield
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _reading(self) -> AbstractContextManager[None]:
        return self._locked(fcntl.LOCK_SH)

    @contextmanager
    def _writing(self) -> Iterator[None]:
        with self._locked(fcntl.LOCK_EX):
            if self._header[_H_DIRTY]:
                self._repair()
            self._header[_H_DIRTY] = 1
            yield
            # Left set if the mutation raised: the next writer then repairs.
            self._header[_H_DIRTY] = 0

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"embedding store {self.name!r} is closed")

    def _own_lock_fd(self) -> int:
        # A forked child shares the parent's open file description, and flock does not
        # exclude holders of one description: give the child its own.
        if self._pid != os.getpid():
            inherited = self._lock_fd
            self._lock_fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o600)
            self._pid = os.getpid()
            os.close(inherited)
        return self._lock_fd

    # ------------------------------------------------------------------ index

    def _home(self, key: bytes) -> int:
        return xxhash.xxh3_64_intdigest(key) & self._mask

    def _find(self, key: bytes) -> int:
        """The slot holding ``key``, or -1. Terminates because the table is at most half full."""
        slot = self._home(key)
        while self._slot_state[slot]:
            if self._slot_key[slot].tobytes() == key:
                return slot
            slot = (slot + 1) & self._mask
        return -1

    def _publish(self, key: bytes, dtype_code: int, shape: tuple[int, ...], nbytes: int, first_block: int) -> None:
        slot = self._home(key)
        while self._slot_state[slot]:
            slot = (slot + 1) & self._mask
        record = np.zeros((), _SLOT_DTYPE)
        record["key"] = np.frombuffer(key, np.uint8)
        record["nbytes"] = nbytes
        record["tick"] = time.monotonic_ns()
        record["shape"][: len(shape)] = shape
        record["first_block"] = first_block
        record["dtype"] = dtype_code
        record["ndim"] = len(shape)
        self._write_record(slot, record)
        self._header[_H_COUNT] += 1

    def _write_record(self, slot: int, record: np.void | np.ndarray) -> None:
        # The value's blocks and every field are in place before the slot becomes visible.
        self._slot_state[slot] = _SLOT_EMPTY
        for field in _SLOT_PAYLOAD_FIELDS:
            self._slots[field][slot] = record[field]
        self._slot_state[slot] = _SLOT_OCCUPIED

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
        self._slot_state[hole] = _SLOT_EMPTY

    def _remove_entry(self, slot: int) -> None:
        blocks = self._chain(int(self._slots["first_block"][slot]), int(self._slots["nbytes"][slot]))
        # Unlink before freeing, so no occupied slot ever points at a free block.
        self._unlink_slot(slot)
        self._header[_H_COUNT] -= 1
        self._push_free(blocks)

    # ------------------------------------------------------------------ blocks

    def _blocks_for(self, nbytes: int) -> int:
        # Even an empty value takes a block: an entry always owns a chain.
        return max(1, math.ceil(nbytes / self._layout.block_size))

    def _used_blocks(self) -> int:
        return self._layout.n_blocks - int(self._header[_H_FREE_TOP])

    def _chain(self, first_block: int, nbytes: int) -> list[int]:
        blocks = [first_block]
        for _ in range(self._blocks_for(nbytes) - 1):
            blocks.append(int(self._next[blocks[-1]]))
        return blocks

    def _pop_free(self, count: int) -> np.ndarray:
        top = int(self._header[_H_FREE_TOP])
        blocks = self._free[top - count : top][::-1].copy()
        self._header[_H_FREE_TOP] = top - count
        return blocks

    def _push_free(self, blocks: list[int]) -> None:
        # Reversed, so a later pop hands them out in the same (often consecutive) order.
        top = int(self._header[_H_FREE_TOP])
        self._free[top : top + len(blocks)] = blocks[::-1]
        self._header[_H_FREE_TOP] = top + len(blocks)

    def _reset_blocks(self) -> None:
        n_blocks = self._layout.n_blocks
        # Descending on the stack, so pops start at block 0 and runs stay consecutive.
        self._free[:] = np.arange(n_blocks - 1, -1, -1, dtype=np.int32)
        self._next[:] = -1
        self._header[_H_FREE_TOP] = n_blocks

    def _store_bytes(self, raw: np.ndarray, n_blocks: int) -> int:
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

    def _read_value(self, key: bytes) -> tuple[torch.Tensor, torch.dtype, tuple[int, ...]] | None:
        # A dead writer may have left a slot mid-move: serve misses until a writer repairs.
        if self._header[_H_DIRTY]:
            return None
        slot = self._find(key)
        if slot < 0:
            return None
        record = self._slots[slot]
        nbytes = int(record["nbytes"])
        shape = tuple(record["shape"][: int(record["ndim"])].tolist())
        dtype = _DTYPES_BY_CODE[int(record["dtype"])]
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
            int(self._header[_H_FREE_TOP]) < n_blocks
            or int(self._header[_H_COUNT]) >= self._layout.max_entries
        )

    def _make_room(self, n_blocks: int) -> None:
        while self._needs_room(n_blocks):
            victims = self._least_recent_keys(_EVICTION_BATCH)
            if not victims:
                raise RuntimeError("embedding store is full yet holds no entries: index corrupt")
            for key in victims:
                self._remove_entry(self._find(key))
                self._header[_H_EVICTIONS] += 1
                if not self._needs_room(n_blocks):
                    return

    def _least_recent_keys(self, limit: int) -> list[bytes]:
        count = min(limit, int(self._header[_H_COUNT]))
        if count <= 0:
            return []
        ticks = np.where(self._slot_state != _SLOT_EMPTY, self._slot_tick, _TICK_NEVER)
        oldest = np.argpartition(ticks, count - 1)[:count]
        oldest = oldest[np.argsort(ticks[oldest], kind="stable")]
        # Keys, not slots: removing one entry shifts others to new slots.
        return [self._slot_key[slot].tobytes() for slot in oldest.tolist()]

    # ------------------------------------------------------------------ recovery and checks

    def _repair(self) -> None:
        """Rebuild the index and free stack after a writer died mid-mutation: keep every
        occupied record whose chain is valid and disjoint from the ones kept before it
        (newest first, so of two copies of one key the fresher wins)."""
        occupied = np.flatnonzero(self._slot_state != _SLOT_EMPTY)
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
        self._slot_state[:] = _SLOT_EMPTY
        for record in kept:
            slot = self._home(record["key"].tobytes())
            while self._slot_state[slot]:
                slot = (slot + 1) & self._mask
            self._write_record(slot, record)
        free_blocks = np.flatnonzero(~block_used).astype(np.int32)
        self._free[: free_blocks.size] = free_blocks[::-1]
        self._next[free_blocks] = -1
        self._header[_H_FREE_TOP] = free_blocks.size
        self._header[_H_COUNT] = len(kept)

    def _valid_chain(self, record: np.void) -> list[int] | None:
        """The record's blocks if it describes a well-formed value, else None."""
        code = int(record["dtype"])
        ndim = int(record["ndim"])
        if code not in _DTYPES_BY_CODE or ndim > MAX_NDIM:
            return None
        shape = record["shape"][:ndim].tolist()
        nbytes = int(record["nbytes"])
        itemsize = _DTYPES_BY_CODE[code].itemsize
        if min(shape, default=0) < 0 or nbytes != math.prod(shape) * itemsize:
            return None
        blocks = [int(record["first_block"])]
        for _ in range(self._blocks_for(nbytes)):
            if not 0 <= blocks[-1] < self._layout.n_blocks:
                return None
            blocks.append(int(self._next[blocks[-1]]))
        if blocks.pop() != -1 or len(set(blocks)) != len(blocks):
            return None
        return blocks

    def _check_invariants(self) -> None:
        """Recompute the structure from scratch and raise AssertionError on any
        inconsistency (for tests and debugging; O(n_slots + n_blocks))."""
        with self._reading():
            _require(not self._header[_H_DIRTY], "dirty flag set with no writer active")
            occupied = np.flatnonzero(self._slot_state != _SLOT_EMPTY).tolist()
            _require(len(occupied) == int(self._header[_H_COUNT]), "entry count differs from occupied slots")
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
            top = int(self._header[_H_FREE_TOP])
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


# ---------------------------------------------------------------------- segment helpers


def _align(offset: int, alignment: int) -> int:
    return -(-offset // alignment) * alignment


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def _check_key(key: bytes) -> None:
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise ValueError(f"keys are {KEY_BYTES} bytes (see embedding_cache.media_key), got {key!r:.80}")


def _dtype_code(dtype: torch.dtype) -> int:
    try:
        return DTYPE_CODES[dtype]
    except KeyError:
        supported = ", ".join(str(d) for d in DTYPE_CODES)
        raise TypeError(f"cannot store {dtype} values; supported: {supported}") from None


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


def _lock_path(name: str) -> str:
    if not name or "/" in name or "\0" in name or len(name) > 200:
        raise ValueError(f"invalid store name {name!r}")
    directory = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    return os.path.join(directory, f"{name}.lock")


def _acquire_lock_file(name: str, mode: int) -> tuple[int, str]:
    """An open, flock'ed descriptor on the store's lock file, and its path."""
    path = _lock_path(name)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, mode)
            if _is_file_at(fd, path):
                return fd, path
        except BaseException:
            os.close(fd)
            raise
        # unlink() removed the file while we waited: lock the file that is there now.
        os.close(fd)


def _is_file_at(fd: int, path: str) -> bool:
    try:
        at_path = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (at_path.st_dev, at_path.st_ino)


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _untrack(shm: SharedMemory) -> None:
    # Python 3.11's resource tracker unlinks a segment when any process that merely
    # attached it exits; this store's lifetime is managed explicitly by unlink().
    resource_tracker.unregister(shm._name, "shared_memory")


def _create_segment(name: str, layout: StoreLayout) -> SharedMemory:
    """A new initialised segment (caller holds the exclusive lock)."""
    shm = SharedMemory(name, create=True, size=layout.total_bytes)
    _untrack(shm)
    header = np.ndarray((_HEADER_WORDS,), np.int64, shm.buf, 0)
    free = np.ndarray((layout.n_blocks,), np.int32, shm.buf, layout.free_offset)
    next_block = np.ndarray((layout.n_blocks,), np.int32, shm.buf, layout.next_offset)
    free[:] = np.arange(layout.n_blocks - 1, -1, -1, dtype=np.int32)
    next_block[:] = -1
    header[_H_VERSION] = _LAYOUT_VERSION
    header[_H_BLOCK_SIZE] = layout.block_size
    header[_H_N_BLOCKS] = layout.n_blocks
    header[_H_N_SLOTS] = layout.n_slots
    header[_H_MAX_ENTRIES] = layout.max_entries
    header[_H_FREE_TOP] = layout.n_blocks
    # Magic last: a segment is recognisable only once fully initialised.
    header[_H_MAGIC] = _MAGIC
    del header, free, next_block
    return shm


def _attach_segment(name: str) -> tuple[SharedMemory, StoreLayout]:
    """The existing segment and its layout (caller holds the lock)."""
    shm = SharedMemory(name)
    _untrack(shm)
    try:
        return shm, _read_layout(shm)
    except BaseException:
        shm.close()
        raise


def _read_layout(shm: SharedMemory) -> StoreLayout:
    if shm.size < _HEADER_BYTES:
        raise StoreLayoutError(f"shared memory {shm.name!r} is too small to be an embedding store")
    header = np.ndarray((_HEADER_WORDS,), np.int64, shm.buf, 0).tolist()
    if header[_H_MAGIC] != _MAGIC:
        raise StoreLayoutError(f"shared memory {shm.name!r} is not an embedding store (or was never initialised)")
    if header[_H_VERSION] != _LAYOUT_VERSION:
        raise StoreLayoutError(
            f"embedding store {shm.name!r} has layout version {header[_H_VERSION]}, this code reads {_LAYOUT_VERSION}"
        )
    layout = StoreLayout(
        block_size=header[_H_BLOCK_SIZE],
        n_blocks=header[_H_N_BLOCKS],
        n_slots=header[_H_N_SLOTS],
        max_entries=header[_H_MAX_ENTRIES],
    )
    if layout.total_bytes > shm.size or layout.n_slots & (layout.n_slots - 1):
        raise StoreLayoutError(f"embedding store {shm.name!r} has a corrupt header")
    return layout
