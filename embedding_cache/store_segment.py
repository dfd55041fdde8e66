"""The shared-memory segment of an embedding store: its byte layout, the record
formats in it, and creating, attaching and validating a segment.

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
"""

from __future__ import annotations

from dataclasses import dataclass
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory

import numpy as np

from embedding_cache.keys import KEY_BYTES

MAX_NDIM = 6

# Codes live in shared memory and outlive any one process: never renumber, only append.
# Keyed by torch's dtype names (``torch.float32`` is "float32"), with each one's
# element size: the segment is made and checked by processes that never import
# torch (a stack's supervisor).
_DTYPES: dict[str, tuple[int, int]] = {  # name: (code, bytes per element)
    "float32": (1, 4),
    "float16": (2, 2),
    "bfloat16": (3, 2),
    "int32": (4, 4),
    "int64": (5, 8),
    "uint8": (6, 1),
    "float64": (7, 8),
    "int8": (8, 1),
    "int16": (9, 2),
    "bool": (10, 1),
}
DTYPE_NAMES: dict[str, int] = {name: code for name, (code, _) in _DTYPES.items()}
NAMES_BY_CODE: dict[int, str] = {code: name for name, (code, _) in _DTYPES.items()}
ITEMSIZES: dict[int, int] = {code: size for code, size in _DTYPES.values()}

_MAGIC = int.from_bytes(b"SWEMBCAC", "little")
_LAYOUT_VERSION = 1

# Header words.
H_MAGIC = 0
H_VERSION = 1
H_BLOCK_SIZE = 2
H_N_BLOCKS = 3
H_N_SLOTS = 4
H_MAX_ENTRIES = 5
H_FREE_TOP = 6
H_COUNT = 7
H_EVICTIONS = 8
H_DIRTY = 9
HEADER_WORDS = 16
HEADER_BYTES = 256

SLOT_EMPTY = 0
SLOT_OCCUPIED = 1

SLOT_DTYPE = np.dtype(
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
SLOT_PAYLOAD_FIELDS = tuple(name for name in SLOT_DTYPE.names if name != "state")

_MIN_BLOCK_SIZE = 64


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
        return HEADER_BYTES

    @property
    def next_offset(self) -> int:
        return _align(self.slots_offset + self.n_slots * SLOT_DTYPE.itemsize, 64)

    @property
    def free_offset(self) -> int:
        return _align(self.next_offset + 4 * self.n_blocks, 64)

    @property
    def data_offset(self) -> int:
        return _align(self.free_offset + 4 * self.n_blocks, 4096)

    @property
    def total_bytes(self) -> int:
        return self.data_offset + self.n_blocks * self.block_size


def _align(offset: int, alignment: int) -> int:
    return -(-offset // alignment) * alignment


def _untrack(shm: SharedMemory) -> None:
    # Python 3.11's resource tracker unlinks a segment when any process that merely
    # attached it exits; this store's lifetime is managed explicitly by unlink().
    resource_tracker.unregister(shm._name, "shared_memory")


def create_segment(name: str, layout: StoreLayout) -> SharedMemory:
    """A new initialised segment (caller holds the exclusive lock)."""
    shm = SharedMemory(name, create=True, size=layout.total_bytes)
    _untrack(shm)
    header = np.ndarray((HEADER_WORDS,), np.int64, shm.buf, 0)
    free = np.ndarray((layout.n_blocks,), np.int32, shm.buf, layout.free_offset)
    next_block = np.ndarray((layout.n_blocks,), np.int32, shm.buf, layout.next_offset)
    free[:] = np.arange(layout.n_blocks - 1, -1, -1, dtype=np.int32)
    next_block[:] = -1
    header[H_VERSION] = _LAYOUT_VERSION
    header[H_BLOCK_SIZE] = layout.block_size
    header[H_N_BLOCKS] = layout.n_blocks
    header[H_N_SLOTS] = layout.n_slots
    header[H_MAX_ENTRIES] = layout.max_entries
    header[H_FREE_TOP] = layout.n_blocks
    # Magic last: a segment is recognisable only once fully initialised.
    header[H_MAGIC] = _MAGIC
    del header, free, next_block
    return shm


def attach_segment(name: str) -> tuple[SharedMemory, StoreLayout]:
    """The existing segment and its layout (caller holds the lock)."""
    shm = SharedMemory(name)
    _untrack(shm)
    try:
        return shm, _read_layout(shm)
    except BaseException:
        shm.close()
        raise


def _read_layout(shm: SharedMemory) -> StoreLayout:
    if shm.size < HEADER_BYTES:
        raise StoreLayoutError(f"shared memory {shm.name!r} is too small to be an embedding store")
    header = np.ndarray((HEADER_WORDS,), np.int64, shm.buf, 0).tolist()
    if header[H_MAGIC] != _MAGIC:
        raise StoreLayoutError(f"shared memory {shm.name!r} is not an embedding store (or was never initialised)")
    if header[H_VERSION] != _LAYOUT_VERSION:
        raise StoreLayoutError(
            f"embedding store {shm.name!r} has layout version {header[H_VERSION]}, this code reads {_LAYOUT_VERSION}"
        )
    layout = StoreLayout(
        block_size=header[H_BLOCK_SIZE],
        n_blocks=header[H_N_BLOCKS],
        n_slots=header[H_N_SLOTS],
        max_entries=header[H_MAX_ENTRIES],
    )
    if layout.total_bytes > shm.size or layout.n_slots & (layout.n_slots - 1):
        raise StoreLayoutError(f"embedding store {shm.name!r} has a corrupt header")
    return layout
