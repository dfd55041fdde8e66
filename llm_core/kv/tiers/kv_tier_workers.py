"""The KV tiers' background threads, so the engine step never waits on a
file or a copy: disk writes in order (an entry queued but not yet written is
read from the queue's copy), disk reads that bring a waiting request's
prefix into host memory, and device-to-host demotions."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from llm_core.kv.tiers.kv_disk_store import DiskKVStore

__all__ = ["Demoter", "Demotion", "DiskReader", "DiskWriter", "Fetched"]

log = logging.getLogger(__name__)


class DiskWriter:
    """One background thread writing host entries to disk in queue order."""

    def __init__(self, disk: DiskKVStore) -> None:
        self.disk = disk
        self.pending: dict[bytes, tuple[torch.Tensor, int]] = {}  # queued, not written yet
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[str, bytes, torch.Tensor | None, int] | None] = queue.Queue()
        self._failed = False
        self._thread = threading.Thread(target=self._run, name="swallow-kv-disk-writer", daemon=True)
        self._thread.start()

    def put(self, key: bytes, blob: torch.Tensor, tokens: int) -> None:
        with self._lock:
            self.pending[key] = (blob, tokens)
        self._queue.put(("put", key, blob, tokens))

    def remove(self, key: bytes) -> None:
        with self._lock:
            self.pending.pop(key, None)
        self._queue.put(("remove", key, None, 0))

    def queued(self, key: bytes) -> tuple[torch.Tensor, int] | None:
        with self._lock:
            return self.pending.get(key)

    def flush(self) -> None:
        """Wait until everything queued so far is on disk."""
        self._queue.join()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                self._apply(*item)
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def _apply(self, op: str, key: bytes, blob: torch.Tensor | None, tokens: int) -> None:
        if op == "remove":
            self.disk.remove(key)
            return
        with self._lock:
            current = self.pending.get(key)
        if current is None or current[0] is not blob:
            return  # removed or replaced while queued
        self._write(key, blob, tokens)  # type: ignore[arg-type]
        with self._lock:
            if self.pending.get(key, (None, 0))[0] is blob:
                del self.pending[key]

    def _write(self, key: bytes, blob: torch.Tensor, tokens: int) -> None:
        try:
            self.disk.put(key, blob, tokens)
        except (OSError, MemoryError, ValueError) as exc:
            # The entry is then missing on disk: its load fails and it is recomputed.
            if not self._failed:
                log.warning("KV disk tier: a write failed (%s); such pages will be recomputed", exc)
                self._failed = True


Fetched = tuple[torch.Tensor | None, int, int | None]  # (verified bytes or None, tokens, their checksum if known)


class DiskReader:
    """One background thread reading (and verifying) disk entries for
    prefetches, every key queued meanwhile in one batch."""

    BATCH = 256

    def __init__(self, read: Callable[[list[bytes]], list[Fetched]]) -> None:
        self._read = read
        self._queue: queue.Queue[bytes | None] = queue.Queue()
        self._lock = threading.Lock()
        self._done: list[tuple[bytes, Fetched]] = []
        self.ready = threading.Event()  # set when a read finishes
        self._thread = threading.Thread(target=self._run, name="swallow-kv-disk-reader", daemon=True)
        self._thread.start()

    def submit(self, key: bytes) -> None:
        self._queue.put(key)

    def take(self) -> list[tuple[bytes, Fetched]]:
        with self._lock:
            done, self._done = self._done, []
            self.ready.clear()
        return done

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (key := self._queue.get()) is not None:
            batch = [key]
            closing = False
            while len(batch) < self.BATCH:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    closing = True
                    break
                batch.append(more)
            try:
                got = self._read(batch)
            except Exception as exc:  # noqa: BLE001 - a read that fails is a miss, never a dead thread
                log.warning("KV disk tier: a prefetch failed (%s)", exc)
                got = [(None, 0, None)] * len(batch)
            with self._lock:
                self._done.extend(zip(batch, got))
                self.ready.set()
            if closing:
                return


@dataclass(eq=False)
class Demotion:
    """One entry to copy from device rows into host memory."""

    key: bytes
    part: bytes  # FULL or SWA: which pool ``ids`` go back to
    ids: list[int]  # the page or slots, not to be reused before the copy is done
    tensors: list[torch.Tensor]
    rows: list[int]  # of every tensor: a full page's rows, or the slots
    tokens: int
    ready: torch.cuda.Event | None  # on CUDA: the KV writes the copy must follow
    done: threading.Event = field(default_factory=threading.Event)


class Demoter:
    """One background thread copying evicted device KV into host entries, in
    order. The engine hands over a page (or slots) and goes on; the ids come
    back through ``finished`` only once their bytes are in host memory, so a
    slot is never reused while its copy reads it."""

    def __init__(self, copy: Callable[[Demotion], None]) -> None:
        self._copy = copy
        self._queue: queue.Queue[Demotion | None] = queue.Queue()
        self._lock = threading.Lock()
        self.pending: dict[bytes, Demotion] = {}
        self._finished: list[Demotion] = []
        self._failed = False
        self._thread = threading.Thread(target=self._run, name="swallow-kv-demoter", daemon=True)
        self._thread.start()

    def submit(self, job: Demotion) -> None:
        with self._lock:
            self.pending[job.key] = job
        self._queue.put(job)

    def settle(self, keys: Iterable[bytes]) -> None:
        """Wait until the copies of those of ``keys`` still pending are done."""
        if self.pending:
            for key in keys:
                if (job := self.pending.get(key)) is not None:
                    job.done.wait()

    def finished(self, wait: bool) -> list[Demotion]:
        if wait:
            self._queue.join()
        with self._lock:
            done, self._finished = self._finished, []
        return done

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                self._copy(job)
            except Exception as exc:  # noqa: BLE001 - a lost copy is a later miss, never a dead thread
                # The entry is then missing in host memory: its load fails and it is recomputed.
                if not self._failed:
                    log.warning("KV host tier: a demotion failed (%s); such pages will be recomputed", exc)
                    self._failed = True
            finally:
                with self._lock:
                    if self.pending.get(job.key) is job:
                        del self.pending[job.key]
                    self._finished.append(job)
                job.done.set()
                self._queue.task_done()
        self._queue.task_done()
