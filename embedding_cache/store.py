"""An LRU cache of embedding tensors in one shared-memory segment, shared by every
server process on the machine: ``SharedEmbeddingStore``, the public API.

The segment's layout is in ``store_segment``, the index, blocks and eviction
inside it in ``store_tables``, the lock file beside it in ``store_lock``.

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
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from multiprocessing.shared_memory import SharedMemory
from typing import TYPE_CHECKING

import _posixshmem  # the unlink primitive without SharedMemory.unlink's tracker bookkeeping

from embedding_cache.keys import KEY_BYTES, tensor_bytes
from embedding_cache.store_lock import acquire_lock_file, remove_quietly
from embedding_cache.store_segment import DTYPE_NAMES, MAX_NDIM, StoreLayout, attach_segment, create_segment
from embedding_cache.store_tables import StoreTables

if TYPE_CHECKING:
    import torch

__all__ = ["SharedEmbeddingStore"]


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
        self._thread_lock = threading.Lock()
        self._closed = False
        self._hits = 0
        self._misses = 0
        self._puts = 0
        self._tables = StoreTables(shm.buf, layout)

    # ------------------------------------------------------------------ construction

    @classmethod
    def create(
        cls, name: str, capacity_bytes: int, *, block_size: int = 64 * 1024, max_entries: int | None = None
    ) -> SharedEmbeddingStore:
        """A new, empty store; FileExistsError if the name is taken."""
        layout = StoreLayout.plan(capacity_bytes, block_size, max_entries)
        return cls._under_lock_file(name, fcntl.LOCK_EX, lambda: (create_segment(name, layout), layout))

    @classmethod
    def attach(cls, name: str) -> SharedEmbeddingStore:
        """The existing store ``name``; FileNotFoundError if there is none,
        StoreLayoutError if the segment is not a store of this layout version."""
        # attach must not leave a lock file for a store that never was.
        return cls._under_lock_file(name, fcntl.LOCK_SH, lambda: attach_segment(name), keep_lock_file=False)

    @classmethod
    def open(
        cls, name: str, capacity_bytes: int, *, block_size: int = 64 * 1024, max_entries: int | None = None
    ) -> SharedEmbeddingStore:
        """Attach to ``name`` if it exists, else create it. Safe when many processes
        race to open the same name. An existing store keeps its own geometry."""
        layout = StoreLayout.plan(capacity_bytes, block_size, max_entries)

        def attach_or_create() -> tuple[SharedMemory, StoreLayout]:
            try:
                return attach_segment(name)
            except FileNotFoundError:
                return create_segment(name, layout), layout

        # Holding the exclusive lock across "is it there? else create" makes the pair atomic.
        return cls._under_lock_file(name, fcntl.LOCK_EX, attach_or_create)

    @classmethod
    def _under_lock_file(cls, name: str, mode: int, segment: Callable[[], tuple[SharedMemory, StoreLayout]],
                         *, keep_lock_file: bool = True) -> SharedEmbeddingStore:
        """The store on the segment ``segment()`` creates or attaches while the
        lock file is held in ``mode``; the store keeps the lock file's descriptor,
        unlocked. ``keep_lock_file=False``: a missing segment removes the lock file."""
        lock_fd, lock_path = acquire_lock_file(name, mode)
        try:
            shm, layout = segment()
        except BaseException as exc:
            if not keep_lock_file and isinstance(exc, FileNotFoundError):
                remove_quietly(lock_path)
            os.close(lock_fd)
            raise
        fcntl.flock(lock_fd, fcntl.LOCK_UN)
        return cls(shm, lock_fd, lock_path, layout)

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
            return self._tables.used_blocks() * self._layout.block_size

    def get(self, key: bytes) -> torch.Tensor | None:
        """A copy of the value under ``key`` (the blocks may be reused as soon as the
        lock is released), or None. A hit makes the entry most recently used."""
        _check_key(key)
        with self._reading():
            found = self._tables.read_value(key)
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
        n_blocks = self._tables.blocks_for(raw.nbytes)
        if n_blocks > self._layout.n_blocks:
            return False
        with self._writing():
            existing = self._tables.find(key)
            if existing >= 0:
                self._tables.remove_entry(existing)
            self._tables.make_room(n_blocks)
            first_block = self._tables.store_bytes(raw, n_blocks)
            self._tables.publish(key, dtype_code, tuple(value.shape), raw.nbytes, first_block)
            self._puts += 1
        return True

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            return False
        with self._reading():
            return not self._tables.dirty and self._tables.find(key) >= 0

    def delete(self, key: bytes) -> bool:
        """Remove ``key``; False if it was not there."""
        _check_key(key)
        with self._writing():
            slot = self._tables.find(key)
            if slot < 0:
                return False
            self._tables.remove_entry(slot)
            return True

    def clear(self) -> None:
        """Remove every entry (the machine-wide eviction count is kept)."""
        with self._writing():
            self._tables.clear()

    def __len__(self) -> int:
        with self._reading():
            return self._tables.count

    def stats(self) -> dict[str, int]:
        """entries, used_bytes, capacity_bytes and evictions are machine-wide;
        hits, misses and puts count this instance's calls."""
        with self._reading():
            return {
                "entries": self._tables.count,
                "used_bytes": self._tables.used_blocks() * self._layout.block_size,
                "capacity_bytes": self.capacity_bytes,
                "evictions": self._tables.evictions,
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
            self._tables.release()
            self._shm.close()
            os.close(self._lock_fd)

    def unlink(self) -> None:
        """Remove the segment and its lock file (processes still attached keep their
        mapping until they close). Call once, when no process needs the store."""
        lock_fd, _ = acquire_lock_file(self._shm.name, fcntl.LOCK_EX)
        try:
            try:
                _posixshmem.shm_unlink(self._shm._name)
            except FileNotFoundError:
                pass
            remove_quietly(self._lock_path)
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
            if self._tables.dirty:
                self._tables.repair()
            self._tables.dirty = True
            yield
            # Left set if the mutation raised: the next writer then repairs.
            self._tables.dirty = False

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

    # ------------------------------------------------------------------ checks

    def _check_invariants(self) -> None:
        """``StoreTables.check_invariants`` under the read lock: AssertionError on
        any inconsistency (for tests and debugging)."""
        with self._reading():
            self._tables.check_invariants()


def _check_key(key: bytes) -> None:
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise ValueError(f"keys are {KEY_BYTES} bytes (see embedding_cache.media_key), got {key!r:.80}")


def _dtype_code(dtype: torch.dtype) -> int:
    try:
        return DTYPE_NAMES[str(dtype).removeprefix("torch.")]
    except KeyError:
        supported = ", ".join(f"torch.{name}" for name in DTYPE_NAMES)
        raise TypeError(f"cannot store {dtype} values; supported: {supported}") from None
