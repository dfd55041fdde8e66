"""Byte stores under the KV-cache tiers: host memory and local disk.

The prefix cache demotes KV pages it evicts from device memory to host memory,
then to disk, and restores them on a later hit. Deciding *what* to demote or drop
(LRU order, byte budgets) is policy and lives in pure-Python bookkeeping; this
module is only the mechanism: dumb key -> bytes stores that never decide to evict
anything themselves. A put that does not fit raises ``MemoryError`` and the caller,
which knows what is coldest, evicts and retries.

What the stores do guarantee is that a restored page is the page that was stored:
every blob carries an xxh3-64 checksum, verified on every read. A blob that fails
verification is dropped and reported as a miss (the engine then recomputes the
KV), never served and never raised as an error: a flipped bit in host memory or a
torn file on disk must cost a recompute, not a wrong answer or a crashed engine.

Keys are opaque non-empty ``bytes`` of at most 64 bytes (in the engine a 16-byte
page hash plus a 1-byte part tag). Each entry also records ``tokens``, the number
of token positions the blob covers, which the disk store keeps in the file header
so that it survives a restart.

The host store and what both stores share are here; the disk store and its
file format are in ``kv_disk_store.py``.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeAlias

import numpy as np
import torch
import xxhash

__all__ = ["MAX_KEY_BYTES", "ByteBudget", "ByteData", "HostKVPool", "WarnOnce", "check_key", "check_out_sizes",
           "check_tokens", "blob_checksum", "copy_into", "flat_bytes"]

_LOG = logging.getLogger(__name__)

MAX_KEY_BYTES = 64
_MAX_U64 = (1 << 64) - 1

ByteData: TypeAlias = bytes | bytearray | memoryview | torch.Tensor | np.ndarray


def check_key(key: bytes) -> None:
    if not isinstance(key, bytes):
        raise TypeError(f"key must be bytes, not {type(key).__name__}")
    if not 0 < len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"key must be 1..{MAX_KEY_BYTES} bytes, got {len(key)}")


def check_tokens(tokens: int) -> None:
    if isinstance(tokens, bool) or not isinstance(tokens, int):
        raise TypeError(f"tokens must be int, not {type(tokens).__name__}")
    if not 0 <= tokens <= _MAX_U64:
        raise ValueError(f"tokens must be in [0, 2**64), got {tokens}")


def _check_capacity(capacity_bytes: int) -> None:
    if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
        raise TypeError(f"capacity_bytes must be int, not {type(capacity_bytes).__name__}")
    if capacity_bytes < 0:
        raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as one flat uint8 tensor on its own device (row-major;
    a view when it is already contiguous)."""
    # reshape before view: view(uint8) of a 0-dim tensor is an error.
    flat = tensor.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    return flat.view(torch.uint8)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def blob_checksum(blob: torch.Tensor | np.ndarray | memoryview) -> int:
    """xxh3-64 of a flat uint8 CPU tensor, array or byte view, hashed in place."""
    array = blob.numpy() if isinstance(blob, torch.Tensor) else blob
    return xxhash.xxh3_64_intdigest(array)


def check_out_sizes(total: int, outs: Sequence[torch.Tensor]) -> None:
    wanted = sum(_nbytes(out) for out in outs)
    if wanted != total:
        raise ValueError(f"outs hold {wanted} bytes but the entry has {total}")


def copy_into(blob: torch.Tensor, outs: Sequence[torch.Tensor]) -> None:
    """Copy the flat uint8 ``blob`` into ``outs`` in order (sizes already checked)."""
    offset = 0
    for out in outs:
        size = _nbytes(out)
        chunk = blob[offset : offset + size]
        offset += size
        if out.is_contiguous():
            # A contiguous tensor can be written through a byte view of itself,
            # whatever its dtype and device.
            out.view(-1).view(torch.uint8).copy_(chunk)
        else:
            # view(dtype) to a wider type needs an aligned offset, which a chunk
            # after an odd-sized part does not have: clone to realign.
            out.copy_(chunk.clone().view(out.dtype).view(out.shape))


class WarnOnce:
    """Logs each kind of failure once per store: a bad disk produces thousands of
    bad pages, and one line per kind says as much as thousands."""

    def __init__(self, store: str) -> None:
        self._store = store
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, kind: str, detail: str) -> None:
        with self._lock:
            if kind in self._seen:
                return
            self._seen.add(kind)
        _LOG.warning("%s: %s (%s); further %s failures are counted, not logged", self._store, kind, detail, kind)


# --------------------------------------------------------------------------- host


@dataclass(frozen=True, eq=False)
class _HostEntry:
    blob: torch.Tensor  # flat uint8, never written after put (so views stay valid)
    checksum: int
    tokens: int
    array: np.ndarray  # the blob's bytes as numpy sees them: hashing it costs no conversion
    address: int  # where the bytes start, for native copies that take addresses


class ByteBudget:
    """A store's byte capacity, the bytes its entries use and the bytes puts
    have reserved between their capacity check and their commit, all under
    ``_lock``. A store says how big an entry already under a key is."""

    def __init__(self, capacity_bytes: int) -> None:
        _check_capacity(capacity_bytes)
        self._capacity = capacity_bytes
        self._used = 0
        self._reserved = 0
        self._lock = threading.Lock()

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        return self._used

    def _entry_bytes(self, key: bytes) -> int:
        """Bytes the entry under ``key`` holds (0 if none); called under ``_lock``."""
        raise NotImplementedError

    def _reserve(self, key: bytes, size: int) -> None:
        """Room for ``size`` bytes replacing ``key``'s entry, or MemoryError."""
        with self._lock:
            if self._used + self._reserved - self._entry_bytes(key) + size > self._capacity:
                raise MemoryError(
                    f"{type(self).__name__} full: {self._used} of {self._capacity} bytes used, "
                    f"{size} more needed; evict before put"
                )
            self._reserved += size


class HostKVPool(ByteBudget):
    """Host-memory key -> bytes store for KV blobs, with a byte capacity.

    Safe to share between the engine thread and a spill thread: the index is
    guarded by a lock, and a stored blob is never modified (a replacement is a new
    tensor), so a view handed out by ``get_bytes`` stays the bytes it was.
    """

    def __init__(self, capacity_bytes: int, pin_memory: bool = False) -> None:
        super().__init__(capacity_bytes)
        # Pinning needs a CUDA runtime; without one there is no transfer to speed up.
        self._pin = bool(pin_memory) and torch.cuda.is_available()
        self._entries: dict[bytes, _HostEntry] = {}
        self._warn = WarnOnce("HostKVPool")
        self._held: dict[int, list[_HostEntry]] = {}  # entries native restores are reading
        self._holds = itertools.count()
        self.checksum_failures = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def keys(self) -> list[bytes]:
        """A snapshot of the keys, oldest put first."""
        with self._lock:
            return list(self._entries)

    def tokens(self, key: bytes) -> int:
        """The entry's token count; KeyError when missing."""
        return self._entries[key].tokens

    def put(self, key: bytes, parts: Sequence[torch.Tensor], tokens: int) -> None:
        """Store a copy of the concatenated bytes of ``parts`` under ``key``,
        replacing any entry already there.

        ValueError if the entry alone exceeds the capacity; MemoryError if it does
        not fit next to the entries already held (the caller evicts, then retries).
        """
        flats = [flat_bytes(part) for part in parts]
        size = sum(flat.numel() for flat in flats)

        def copied() -> _HostEntry:
            blob = torch.empty(size, dtype=torch.uint8, pin_memory=self._pin)
            offset = 0
            for flat in flats:
                blob[offset : offset + flat.numel()].copy_(flat)
                offset += flat.numel()
            # Hash the host copy, not the source: the checksum must vouch for
            # exactly the bytes that get_into will hand back.
            array = blob.numpy()
            return _HostEntry(blob, blob_checksum(array), tokens, array, blob.data_ptr())

        self._store(key, tokens, size, copied)

    def put_verified(self, key: bytes, blob: torch.Tensor, checksum: int, tokens: int) -> None:
        """Adopt ``blob`` (flat uint8, CPU, never written again by the caller)
        as the entry, its ``checksum`` already verified against the bytes: a
        disk read lands in host memory without a second copy or hash. Errors
        as ``put``."""
        if blob.dtype != torch.uint8 or blob.dim() != 1 or blob.device.type != "cpu" or not blob.is_contiguous():
            raise ValueError("a flat contiguous uint8 CPU tensor is adopted")
        self._store(key, tokens, blob.numel(),
                    lambda: _HostEntry(blob, checksum, tokens, blob.numpy(), blob.data_ptr()))

    def _store(self, key: bytes, tokens: int, size: int, make: Callable[[], _HostEntry]) -> None:
        """Reserve ``size`` bytes, build the entry, commit it in place of any old one."""
        check_key(key)
        check_tokens(tokens)
        if size > self._capacity:
            raise ValueError(f"entry of {size} bytes exceeds the pool capacity of {self._capacity} bytes")
        self._reserve(key, size)
        try:
            entry = make()
        except BaseException:
            with self._lock:
                self._reserved -= size
            raise
        # Reservation and commit swap in one critical section, so a concurrent
        # put never sees the bytes as free in between.
        with self._lock:
            self._reserved -= size
            old = self._entries.pop(key, None)
            self._used += size - (old.blob.numel() if old is not None else 0)
            self._entries[key] = entry  # re-inserted: keys() stays in put order

    def _entry_bytes(self, key: bytes) -> int:
        old = self._entries.get(key)
        return old.blob.numel() if old is not None else 0

    def get_into(self, key: bytes, outs: Sequence[torch.Tensor]) -> bool:
        """Copy the entry's bytes into ``outs`` in order (the layout ``put`` took).

        False, with nothing copied, when the key is missing or the checksum fails
        (a failed entry is also removed). ValueError if ``outs`` do not hold exactly
        the entry's byte count.
        """
        entry = self._entries.get(key)
        if entry is None:
            return False
        check_out_sizes(entry.blob.numel(), outs)
        if not self._verify(key, entry):
            return False
        copy_into(entry.blob, outs)
        return True

    def get_bytes(self, key: bytes) -> torch.Tensor | None:
        """The verified flat uint8 blob (a view of the stored bytes, not a copy),
        or None when missing or corrupt. Meant for spilling to disk."""
        entry = self._entries.get(key)
        if entry is None or not self._verify(key, entry):
            return None
        return entry.blob

    @property
    def pinned(self) -> bool:
        """Whether blobs live in pinned memory (a CUDA host)."""
        return self._pin

    def stored(self, keys: Sequence[bytes]) -> tuple[int, list[tuple[int, int, int]]]:
        """(address, size, checksum) of each of ``keys`` up to the first
        missing, unverified, for a native restore that checks the checksums
        itself (and calls ``report_corrupt`` on the first that fails); with
        a hold on them. Until ``release_stored(hold)`` the bytes stay
        readable: a remove meanwhile drops an entry from the pool, never
        frees its bytes under a copy still reading them."""
        entries = self._entries
        got = list(itertools.takewhile(lambda e: e is not None, (entries.get(key) for key in keys)))
        with self._lock:
            hold = next(self._holds)
            self._held[hold] = got
        return hold, [(e.address, e.blob.numel(), e.checksum) for e in got]

    def release_stored(self, hold: int) -> None:
        """The bytes of that ``stored`` call are no longer read."""
        with self._lock:
            del self._held[hold]

    def report_corrupt(self, key: bytes, address: int) -> None:
        """A restore found the entry (at ``address``, from ``stored``) failing its checksum."""
        entry = self._entries.get(key)
        if entry is not None and entry.address == address:
            self._drop_corrupt(key, entry)

    def remove(self, key: bytes) -> None:
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is not None:
                self._used -= entry.blob.numel()

    def _verify(self, key: bytes, entry: _HostEntry) -> bool:
        # Hashing happens outside the lock: blobs are immutable, and a large page
        # should not stall the other thread.
        if blob_checksum(entry.array) == entry.checksum:
            return True
        self._drop_corrupt(key, entry)
        return False

    def _drop_corrupt(self, key: bytes, entry: _HostEntry) -> None:
        with self._lock:
            self.checksum_failures += 1
            # Only drop the entry that failed, not a replacement put meanwhile.
            if self._entries.get(key) is entry:
                del self._entries[key]
                self._used -= entry.blob.numel()
        self._warn("checksum mismatch", f"key {key.hex()}, entry dropped")
