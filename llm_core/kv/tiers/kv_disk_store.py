"""The disk KV store: checksummed page files under a model's namespace
(the guarantees every store gives are in ``kv_store.py``).

Disk layout::

    root / namespace.hex()[:32] / key.hex()[:2] / f"{key.hex()}.kv"

The namespace is a model fingerprint, so another model's pages are never even
listed. Only its first 16 bytes name the directory: pass a digest (two
fingerprints sharing a 16-byte prefix would share files). A file is a fixed little-endian header (magic, format version, key length,
tokens, payload length, payload checksum), the key, then the payload. Files are
written to a temp file in the same directory and renamed into place, so a reader
sees either the old or the new complete file. One ``DiskKVStore`` owns a namespace
directory: at startup it deletes every leftover temp file there, which would
include a live writer's if two processes shared one namespace.
"""

from __future__ import annotations

import io
import itertools
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from llm_core.kv.tiers.kv_store import (
    MAX_KEY_BYTES,
    ByteBudget,
    ByteData,
    WarnOnce,
    check_key,
    check_out_sizes,
    check_tokens,
    blob_checksum,
    copy_into,
    flat_bytes,
)

__all__ = ["READ_STATUS", "DiskEntry", "DiskKVStore"]

# magic, format version, key length, tokens, payload length, payload xxh3-64.
_HEADER = struct.Struct("<4sHHQQQ")
_MAGIC = b"SWKV"
# Bump on any change to the header or payload encoding: files of another version
# are treated as garbled (dropped and recomputed), never misread.
_FORMAT_VERSION = 1
_SUFFIX = ".kv"
# Leading dot: never mistaken for an entry, and skipped by the scan's suffix test.
_TMP_PREFIX = ".tmp-"
# What a native reader (csrc/kv_page_copy.cpp) reports per file, by code.
READ_STATUS = ("ok", "missing file", "unreadable file", "truncated file", "garbled header", "checksum mismatch")

class DiskEntry(NamedTuple):
    file_bytes: int  # the whole file, header and key included
    tokens: int


@dataclass(frozen=True)
class _IndexEntry:
    file_bytes: int
    tokens: int
    mtime_ns: int


class _BadFile(Exception):
    """A file that is not a valid entry; ``kind`` names the failure for logging."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


def _parse_header(raw: bytes, key: bytes | None, file_size: int) -> tuple[bytes, int, int, int]:
    """(key, tokens, payload length, checksum) from the start of a file; raises
    _BadFile unless the header is well formed, names ``key`` (when given) and
    accounts for exactly ``file_size`` bytes."""
    if len(raw) < _HEADER.size:
        raise _BadFile("truncated file")
    magic, version, key_len, tokens, payload_len, checksum = _HEADER.unpack_from(raw)
    if magic != _MAGIC or version != _FORMAT_VERSION or not 0 < key_len <= MAX_KEY_BYTES:
        raise _BadFile("garbled header")
    stored_key = raw[_HEADER.size : _HEADER.size + key_len]
    if len(stored_key) < key_len:
        raise _BadFile("truncated file")
    if key is not None and stored_key != key:
        raise _BadFile("garbled header")
    expected = _HEADER.size + key_len + payload_len
    if file_size < expected:
        raise _BadFile("truncated file")
    if file_size > expected:
        raise _BadFile("garbled header")
    return stored_key, tokens, payload_len, checksum


def _read_exact(f: io.FileIO, view: memoryview) -> bool:
    """Fill ``view`` from the raw file ``f``; False if the file ends first."""
    filled = 0
    while filled < len(view):
        n = f.readinto(view[filled:])
        if not n:
            return False
        filled += n
    return True


def _payload_view(data: ByteData) -> memoryview:
    """``data`` as a flat byte memoryview, without copying when it is contiguous."""
    if isinstance(data, torch.Tensor):
        if data.device.type != "cpu":
            # The disk writer runs on a background thread; a hidden device sync
            # there would be a surprise, so the caller stages through host memory.
            raise TypeError(f"tensor data must be on the CPU, not {data.device}")
        return memoryview(flat_bytes(data).numpy())
    if isinstance(data, np.ndarray):
        return memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
    if isinstance(data, (bytes, bytearray, memoryview)):
        view = memoryview(data)
        return view.cast("B") if view.c_contiguous else memoryview(view.tobytes())
    raise TypeError(f"unsupported data type {type(data).__name__}")


class DiskKVStore(ByteBudget):
    """Local-disk key -> bytes store for KV blobs, one file per entry, with a byte
    capacity counted in file sizes.

    Thread safety: one writer thread may ``put`` while other threads ``get``,
    ``remove`` or look up. The index is guarded by a lock; reading and writing file
    contents happens outside it. The rename that publishes a file and the unlink
    that removes one happen under it, so the index and the directory never
    disagree for long enough for a concurrent reader to see a half-state.
    """

    def __init__(self, root: str | Path, capacity_bytes: int, namespace: bytes, fsync: bool = False) -> None:
        super().__init__(capacity_bytes)
        if not isinstance(namespace, bytes) or not namespace:
            raise ValueError("namespace must be non-empty bytes")
        self._fsync = fsync
        self._dir = Path(root) / namespace.hex()[:32]
        self._dir.mkdir(parents=True, exist_ok=True)
        self._dir_prefix = f"{self._dir}{os.sep}"  # str paths: a Path join costs more than a small read
        self._index: dict[bytes, _IndexEntry] = {}
        self._warn = WarnOnce(f"DiskKVStore({self._dir})")
        # Random per instance, so two stores in one process never pick the same
        # temp name; O_EXCL would refuse a clash anyway.
        self._tmp_prefix = f"{_TMP_PREFIX}{os.getpid()}-{os.urandom(4).hex()}-"
        self._tmp_counter = itertools.count()
        self.checksum_failures = 0  # files found corrupt, truncated or garbled on read
        self.missing = 0  # indexed files that had vanished on read
        self.scan_dropped = 0  # files deleted at startup for an unreadable header
        self._scan()

    # ------------------------------------------------------------------ queries

    @property
    def directory(self) -> Path:
        """The namespace directory holding this store's files."""
        return self._dir

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, key: object) -> bool:
        return key in self._index

    def tokens(self, key: bytes) -> int:
        """The entry's token count; KeyError when missing."""
        return self._index[key].tokens

    def entries(self) -> list[tuple[bytes, DiskEntry]]:
        """(key, (file_bytes, tokens)) for every entry, oldest file mtime first:
        after a restart the bookkeeping seeds its LRU from this order."""
        with self._lock:
            items = list(self._index.items())
        # Stable sort: entries written within one mtime tick keep put order.
        items.sort(key=lambda item: item[1].mtime_ns)
        return [(key, DiskEntry(entry.file_bytes, entry.tokens)) for key, entry in items]

    def path(self, key: bytes) -> Path:
        """Where ``key``'s file lives (whether or not it exists)."""
        return Path(self._file(key))

    def _file(self, key: bytes) -> str:
        name = key.hex()
        return f"{self._dir_prefix}{name[:2]}{os.sep}{name}{_SUFFIX}"

    # ------------------------------------------------------------------ writes

    def put(self, key: bytes, data: ByteData, tokens: int) -> int:
        """Write ``data`` under ``key`` atomically, replacing any entry already
        there; returns the file's size in bytes, header included.

        ValueError if the entry alone exceeds the capacity; MemoryError if it does
        not fit next to the entries already held (the caller evicts, then retries).
        OSError from the file system propagates, with no temp file left behind and
        any previous entry intact.
        """
        check_key(key)
        check_tokens(tokens)
        payload = _payload_view(data)
        size = _HEADER.size + len(key) + payload.nbytes
        if size > self._capacity:
            raise ValueError(f"entry of {size} bytes exceeds the store capacity of {self._capacity} bytes")
        self._reserve(key, size)
        try:
            header = _HEADER.pack(_MAGIC, _FORMAT_VERSION, len(key), tokens, payload.nbytes, blob_checksum(payload))
            final = self.path(key)
            final.parent.mkdir(parents=True, exist_ok=True)
            tmp = final.parent / f"{self._tmp_prefix}{next(self._tmp_counter)}"
            mtime_ns = self._write_file(tmp, header + key, payload)
        except BaseException:
            with self._lock:
                self._reserved -= size
            raise
        self._publish(key, tmp, final, _IndexEntry(size, tokens, mtime_ns))
        return size

    def _entry_bytes(self, key: bytes) -> int:
        old = self._index.get(key)
        return old.file_bytes if old is not None else 0

    def _write_file(self, tmp: Path, head: bytes, payload: memoryview) -> int:
        """Write a complete file at ``tmp``; returns its mtime. Removes ``tmp`` on
        any failure."""
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(head)
                f.write(payload)
                f.flush()
                if self._fsync:
                    os.fsync(f.fileno())
                return os.fstat(f.fileno()).st_mtime_ns
        except BaseException:
            self._unlink(tmp)
            raise

    def _publish(self, key: bytes, tmp: Path, final: Path, entry: _IndexEntry) -> None:
        # Rename and index update together under the lock: a remove or a failed
        # get's cleanup in between could otherwise unlink the new file while the
        # index still lists it. The reservation turns into used bytes in the same
        # critical section, so a concurrent put never sees them as free.
        with self._lock:
            self._reserved -= entry.file_bytes
            try:
                os.replace(tmp, final)
            except BaseException:
                self._unlink(tmp)
                raise
            old = self._index.pop(key, None)
            self._used += entry.file_bytes - (old.file_bytes if old is not None else 0)
            self._index[key] = entry  # re-inserted: ties in entries() keep put order
        if self._fsync:
            self._fsync_dir(final.parent)

    @staticmethod
    def _fsync_dir(directory: Path) -> None:
        # The rename is durable only once the directory itself is on disk.
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def remove(self, key: bytes) -> None:
        """Drop the entry and delete its file; no error when missing."""
        path = self.path(key)
        with self._lock:
            entry = self._index.pop(key, None)
            if entry is not None:
                self._used -= entry.file_bytes
            self._unlink(path)

    def _unlink(self, path: Path | str) -> None:
        """Delete a file, tolerating its absence; other errors are logged, not
        raised: a file we failed to delete is dropped again at the next scan or get."""
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            self._warn("unlink failed", str(exc))

    # ------------------------------------------------------------------ reads

    def get(self, key: bytes) -> tuple[memoryview, int] | None:
        """(payload, tokens) of a verified entry, or None when it is missing or its
        file is bad (a bad file is deleted and counted; this never raises on one)."""
        found = self._read(key)
        if found is None:
            return None
        payload, tokens = found
        return memoryview(payload), tokens

    def read_into(self, key: bytes, outs: Sequence[torch.Tensor]) -> bool:
        """Copy a verified entry's payload into ``outs`` in order (the layout of
        ``HostKVPool.get_into``); False, with nothing copied, on any miss or bad
        file. ValueError if ``outs`` do not hold exactly the payload's bytes."""
        found = self._read(key)
        if found is None:
            return False
        payload, _ = found
        check_out_sizes(payload.nbytes, outs)
        copy_into(torch.from_numpy(payload), outs)
        return True

    def file_specs(self, keys: Sequence[bytes]) -> list[tuple[str, int] | None]:
        """(path, file size) of each of ``keys``, None where not indexed, for a
        native reader that checks the files like ``get`` does (header layout,
        key, size, checksum) and reports each failure with ``report_read``."""
        specs: list[tuple[str, int] | None] = []
        for key in keys:
            entry = self._index.get(key)
            specs.append((self._file(key), entry.file_bytes) if entry is not None else None)
        return specs

    @property
    def header_format(self) -> tuple[bytes, int]:
        """(magic, format version) a native reader expects in a file header."""
        return _MAGIC, _FORMAT_VERSION

    def report_read(self, key: bytes, status: int) -> None:
        """A native read of ``key``'s file failed with ``status`` (an index
        into READ_STATUS): counted, logged once, the file dropped."""
        kind = READ_STATUS[status]
        path = Path(self._file(key))
        if kind == "missing file":
            self._drop_missing(key, path)
        else:
            self._drop_bad(key, path, None, kind, f"key {key.hex()}")

    def _read(self, key: bytes) -> tuple[np.ndarray, int] | None:
        check_key(key)
        entry = self._index.get(key)
        if entry is None:
            return None  # not an entry: not a failure either
        file = self._file(key)
        try:
            f = open(file, "rb", buffering=0)
        except FileNotFoundError:
            path = Path(file)
            self._drop_missing(key, path)
            return None
        except OSError as exc:
            self._drop_bad(key, Path(file), None, "unreadable file", str(exc))
            return None
        with f:
            try:
                # The opened file's own size, not the index's: a put may have
                # renamed a replacement of another size into place since the
                # index was read, and a published file never changes.
                return self._read_verified(f, key, os.fstat(f.fileno()).st_size)
            except _BadFile as bad:
                reason, detail = bad.kind, f"key {key.hex()}"
            except OSError as exc:
                reason, detail = "unreadable file", str(exc)
            stat = os.fstat(f.fileno())
        self._drop_bad(key, Path(file), stat, reason, detail)
        return None

    @staticmethod
    def _read_verified(f: io.FileIO, key: bytes, expected_size: int) -> tuple[np.ndarray, int]:
        """The whole file in one read (a restore costs what a plain read of the
        file does, plus the checksum); one byte more than expected is asked for,
        so a file that grew is caught as well as one that shrank."""
        # np.empty, not bytearray: a page can be megabytes, no need to zero it first.
        raw = np.empty(expected_size + 1, dtype=np.uint8)
        view = memoryview(raw)
        size = 0
        while size < len(view) and (n := f.readinto(view[size:])):
            size += n
        head = raw[: min(size, _HEADER.size + len(key))].tobytes()
        _, tokens, payload_len, checksum = _parse_header(head, key, size)
        payload = raw[size - payload_len : size]
        if blob_checksum(payload) != checksum:
            raise _BadFile("checksum mismatch")
        return payload, tokens

    def _drop_missing(self, key: bytes, path: Path) -> None:
        with self._lock:
            # Gone from the index already: a remove that raced us, not a loss.
            # The file back in place: a put landed meanwhile; leave it.
            if key not in self._index or path.exists():
                return
            entry = self._index.pop(key)
            self._used -= entry.file_bytes
            self.missing += 1
        self._warn("missing file", f"{path} indexed but gone")

    def _drop_bad(self, key: bytes, path: Path, seen: os.stat_result | None, kind: str, detail: str) -> None:
        with self._lock:
            self.checksum_failures += 1
            if self._still_same_file(path, seen):
                self._unlink(path)
                entry = self._index.pop(key, None)
                if entry is not None:
                    self._used -= entry.file_bytes
        self._warn(kind, f"{detail}; file deleted")

    @staticmethod
    def _still_same_file(path: Path, seen: os.stat_result | None) -> bool:
        """Whether ``path`` is still the file that failed (not a replacement that a
        concurrent put renamed into place after we opened the old one)."""
        try:
            now = os.stat(path)
        except FileNotFoundError:
            return seen is None  # could not open it either: drop the index entry
        if seen is None:
            return True
        return (now.st_dev, now.st_ino) == (seen.st_dev, seen.st_ino)

    # ------------------------------------------------------------------ startup

    def _scan(self) -> None:
        """Rebuild the index from the namespace directory, reading headers only:
        payloads are verified on get, so startup stays fast with a full disk."""
        found: list[tuple[bytes, _IndexEntry]] = []
        for sub in os.scandir(self._dir):
            if not sub.is_dir(follow_symlinks=False) or len(sub.name) != 2:
                continue  # not a shard directory of ours: leave it alone
            for item in os.scandir(sub.path):
                if item.name.startswith(_TMP_PREFIX):
                    # A write interrupted by a crash: never renamed, never an entry.
                    self._unlink(item.path)
                elif item.name.endswith(_SUFFIX) and item.is_file(follow_symlinks=False):
                    entry = self._scan_file(sub.name, item)
                    if entry is not None:
                        found.append(entry)
        found.sort(key=lambda pair: pair[1].mtime_ns)
        self._index = dict(found)
        self._used = sum(entry.file_bytes for _, entry in found)

    def _scan_file(self, shard: str, item: os.DirEntry[str]) -> tuple[bytes, _IndexEntry] | None:
        try:
            stat = item.stat(follow_symlinks=False)
            with open(item.path, "rb", buffering=0) as f:
                head = f.read(_HEADER.size + MAX_KEY_BYTES)
            key, tokens, _, _ = _parse_header(head, None, stat.st_size)
            name = key.hex()
            if item.name != f"{name}{_SUFFIX}" or shard != name[:2]:
                raise _BadFile("misplaced file")  # its header names another key
        except _BadFile as bad:
            kind, detail = bad.kind, item.path
        except OSError as exc:
            kind, detail = "unreadable file", str(exc)
        else:
            return key, _IndexEntry(stat.st_size, tokens, stat.st_mtime_ns)
        self._unlink(item.path)
        self.scan_dropped += 1
        self._warn(f"{kind} at startup", f"{detail}; file deleted")
        return None
