"""KV events: what a worker's cache holds, told to whoever routes to it.

Every change to what a page address holds on one medium -- a full page
stored on the device, demoted to host memory, spilled to disk, dropped; the
SWA (and MTP) KV of a page's last positions kept as part of a checkpoint
window, or tombstoned -- is one ``KVEvent``. The prefix cache and the tiers'
indexes record them here as they change; a worker drains the log and sends
the batches to its routers, which rebuild from them, per worker, which
window-safe prefixes it can reuse (``router.py``).

The log also keeps the current state, so a router that joins late, or sees
a gap in the sequence numbers, asks for a ``snapshot`` instead of replaying
history. ``reset`` starts a new epoch (the engine was rebuilt: nothing is
cached any more). Pure Python; thread-safe, because the engine thread records
while the worker's event loop drains.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Literal

from llm_core.kv.tiers.kv_tiers import FULL, SWA
from llm_core.kv.page_address import ADDRESS_BYTES

Medium = Literal["device", "host", "disk"]
MEDIA: tuple[Medium, ...] = ("device", "host", "disk")
PARTS = (FULL, SWA)

__all__ = ["MEDIA", "EventBatch", "KVEvent", "KVEventLog", "Medium"]


@dataclass(frozen=True, slots=True)
class KVEvent:
    medium: Medium
    address: bytes  # the page's address: a hash chain over the prefix's tokens (page_address.page_address)
    part: bytes  # FULL (the page's full-attention KV) or SWA (a window's SWA KV on this page)
    held: int  # after the event -- FULL: 1 present, 0 gone; SWA: the page's last positions held, 0 gone


@dataclass(frozen=True, slots=True)
class EventBatch:
    """Events ``start + 1 .. start + len(events)`` of ``epoch``; or, with
    ``snapshot``, the whole state as of event ``start``."""

    epoch: int
    start: int
    events: tuple[KVEvent, ...]
    snapshot: bool = False

    @property
    def end(self) -> int:
        return self.start if self.snapshot else self.start + len(self.events)


class KVEventLog:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state: dict[tuple[Medium, bytes, bytes], int] = {}
        self._pending: list[KVEvent] = []
        self._drained = 0  # sequence number of the last event drained
        self.epoch = 0
        self.seq = 0  # events recorded in this epoch

    def record(self, medium: Medium, address: bytes, part: bytes, held: int) -> None:
        """``address`` now holds ``held`` of ``part`` on ``medium`` (a no-op when unchanged)."""
        key = (medium, address, part)
        with self._lock:
            if held:
                if self._state.get(key) == held:
                    return
                self._state[key] = held
            elif self._state.pop(key, None) is None:
                return
            self._pending.append(KVEvent(medium, address, part, held))
            self.seq += 1

    def record_tier_key(self, medium: Medium, key: bytes, held: int) -> None:
        """The same, for a tier entry's key (address + part)."""
        self.record(medium, key[:ADDRESS_BYTES], key[ADDRESS_BYTES:], held)

    def drain(self) -> EventBatch:
        """The events recorded since the last drain."""
        with self._lock:
            batch = EventBatch(self.epoch, self._drained, tuple(self._pending))
            self._pending = []
            self._drained = self.seq
        return batch

    def snapshot(self) -> EventBatch:
        """Everything held now, as of the last recorded event. Events are
        absolute (what an address holds after them), so applying any later
        batch on top -- even one that starts before the snapshot -- ends in
        the right state: a router takes a batch whenever it starts at or
        before what it knows."""
        with self._lock:
            events = tuple(KVEvent(m, a, p, held) for (m, a, p), held in self._state.items())
            return EventBatch(self.epoch, self.seq, events, snapshot=True)

    def reset(self) -> None:
        """A new epoch with nothing held: the cache this log described is gone."""
        with self._lock:
            self.epoch += 1
            self.seq = self._drained = 0
            self._state.clear()
            self._pending = []

    def __len__(self) -> int:
        with self._lock:
            return len(self._state)
