"""Host-memory and disk tiers under the device KV pools: the bookkeeping.

The radix prefix cache (``prefix_cache.py``) holds what is on the device.
When it evicts a page, the page is *demoted* to host memory instead of lost;
when host memory is full its least recently used entries *spill* to local
disk, and the disk drops its least recently used ones. A request whose prefix
continues past the device tree into these tiers has the pages *restored*.

Entries are addressed by content, not by slot (``page_address.py``), so the
same prefix has the same address in every process and after a restart, and
another model's pages are never read. Two kinds of entry per address: the page's full-attention KV (``FULL``) and the SWA
(and MTP) KV of the last ``tokens`` positions of the page (``SWA``), which
is all a checkpoint's window needs: SWA KV is never stored for a whole
prefix.

This module is pure Python: byte budgets, LRU order, statistics. The bytes
move through a ``TierIO`` (the engine's copies and files); with none (the
trace simulator) transfers are only counted.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from llm_core.kv.page_address import ADDRESS_BYTES

Tier = Literal["host", "disk"]
TIERS: tuple[Tier, ...] = ("host", "disk")
FULL, SWA = b"F", b"S"


class TierIO(Protocol):
    """Moves the bytes (the mechanism): device slots <-> host <-> disk."""

    # True: the copy runs on in the background and the page (slots) may not be
    # reused until ``finished`` hands it back; False/None: done, reuse at once.
    def save_full(self, key: bytes, page: int) -> bool | None: ...
    def save_swa(self, key: bytes, slots: Sequence[int]) -> bool | None: ...
    def spill(self, key: bytes) -> None: ...
    def discard(self, tier: Tier, key: bytes) -> None: ...
    def load_full_many(self, tier: Tier, keys: Sequence[bytes], pages: Sequence[int]) -> int: ...
    def load_swa(self, tier: Tier, key: bytes, slots: Sequence[int]) -> bool: ...


class AsyncDemotionIO(TierIO, Protocol):
    """A ``TierIO`` whose saves copy in the background."""

    def finished(self, wait: bool) -> list[tuple[bytes, list[int]]]: ...  # (FULL or SWA, ids) copied since the last call


class PrefetchIO(TierIO, Protocol):
    """A ``TierIO`` that reads disk entries into host memory in the background."""

    def prefetch(self, key: bytes) -> None: ...
    def prefetched(self) -> list[tuple[bytes, bool]]: ...  # finished reads since the last call: (key, ok)
    def adopt_prefetched(self, key: bytes) -> None: ...  # a finished read's bytes become the host entry


@dataclass(frozen=True)
class TierConfig:
    """Byte budgets, and what one entry costs: a full page (every full
    layer) and one SWA position (every SWA and MTP layer)."""

    host_bytes: int
    disk_bytes: int
    full_page_bytes: int
    swa_token_bytes: int

    def __post_init__(self) -> None:
        if min(self.host_bytes, self.disk_bytes) < 0 or min(self.full_page_bytes, self.swa_token_bytes) < 1:
            raise ValueError(f"bad tier sizes: {self}")
        if self.disk_bytes and self.host_bytes < self.full_page_bytes:
            raise ValueError("a disk tier needs a host tier of at least one page: disk writes go through it")

    @property
    def enabled(self) -> bool:
        return self.host_bytes >= self.full_page_bytes


@dataclass
class TierStats:
    demoted_bytes: int = 0  # device -> host
    spilled_bytes: int = 0  # host -> disk
    restored_bytes: dict[str, int] = field(default_factory=lambda: {t: 0 for t in TIERS})
    restored_entries: dict[str, int] = field(default_factory=lambda: {t: 0 for t in TIERS})
    load_failures: int = 0  # checksum mismatches, short or missing files: misses from that page on
    dropped_entries: int = 0  # evicted from the last tier


# Told of every entry added or removed: (tier, key, what it holds: 1 for a
# full page, its positions for SWA; 0 once removed).
TierChange = Callable[[Tier, bytes, int], None]


class TierIndex:
    """One tier's entries in LRU order (oldest first), under a byte budget."""

    def __init__(self, name: Tier, capacity_bytes: int, on_change: TierChange | None = None) -> None:
        self.name = name
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._entries: OrderedDict[bytes, tuple[int, int]] = OrderedDict()  # key -> (bytes, tokens)
        self._on_change = on_change

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def tokens(self, key: bytes) -> int:
        entry = self._entries.get(key)
        return entry[1] if entry is not None else 0

    def entry(self, key: bytes) -> tuple[int, int]:
        """(bytes, tokens) of a present entry."""
        return self._entries[key]

    def add(self, key: bytes, nbytes: int, tokens: int) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.used_bytes -= entry[0]
        self._entries[key] = (nbytes, tokens)
        self.used_bytes += nbytes
        if self._on_change is not None:
            self._on_change(self.name, key, tokens if key[ADDRESS_BYTES:] == SWA else 1)

    def remove(self, key: bytes) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self.used_bytes -= entry[0]
        if self._on_change is not None:
            self._on_change(self.name, key, 0)
        return True

    def touch(self, key: bytes) -> None:
        if key in self._entries:
            self._entries.move_to_end(key)

    def oldest(self) -> bytes | None:
        return next(iter(self._entries), None)

    def keys(self) -> Iterator[bytes]:
        return iter(self._entries)


class KVTiers:
    """Demotion, spilling, eviction and restores for the host and disk tiers."""

    def __init__(self, config: TierConfig, io: TierIO | None = None, on_change: TierChange | None = None) -> None:
        """``on_change`` hears of every entry added to or removed from either tier."""
        self.config = config
        self.io = io
        self.host = TierIndex("host", config.host_bytes, on_change)
        self.disk = TierIndex("disk", config.disk_bytes, on_change)
        self.stats = TierStats()
        self.loading: set[bytes] = set()  # disk entries being read into host memory
        self.from_disk: set[bytes] = set()  # host entries a prefetch brought: their hits count as disk hits

    def index(self, tier: Tier) -> TierIndex:
        return self.host if tier == "host" else self.disk

    # ------------------------------------------------------------- lookup
    def origin(self, address: bytes, tier: Tier) -> Tier:
        """Where a hit on this page counts: a host entry a prefetch brought
        from disk counts as disk."""
        return "disk" if tier == "host" and address + FULL in self.from_disk else tier

    def full_tier(self, address: bytes, tiers: Sequence[Tier] = TIERS) -> Tier | None:
        """The nearest of ``tiers`` holding the page's full KV."""
        key = address + FULL
        for tier in tiers:
            if key in self.index(tier):
                return tier
        return None

    def swa_tokens(self, address: bytes, tiers: Sequence[Tier] = TIERS) -> int:
        """How many of the page's last positions have SWA KV in one of ``tiers``."""
        key = address + SWA
        return max((self.index(t).tokens(key) for t in tiers), default=0)

    def touch(self, key: bytes) -> None:
        self.host.touch(key)
        self.disk.touch(key)

    # ----------------------------------------------------------- demotion
    def demote_full(self, address: bytes, page: int) -> bool:
        """The device is about to free ``page``: keep its KV unless a tier
        already has it. True when the copy is still running: the page comes
        back through ``finished_demotions``, not to be reused before."""
        self._settle_restores()
        key = address + FULL
        if key in self.host or key in self.disk:
            self.touch(key)
            return False
        return self._store(key, self.config.full_page_bytes, 0, lambda: self.io.save_full(key, page))  # type: ignore[union-attr]

    def demote_swa(self, address: bytes, slots: Sequence[int]) -> bool:
        """The device is about to free the SWA slots of a page's last
        ``len(slots)`` positions (a checkpoint window's part on this page);
        True as for ``demote_full``."""
        self._settle_restores()
        key = address + SWA
        if not slots:
            return False
        if self.swa_tokens(address) >= len(slots):
            self.touch(key)
            return False
        for tier in TIERS:  # a shorter window of this page: the longer one replaces it
            if self.index(tier).remove(key):
                self._discard(tier, key)
        nbytes = len(slots) * self.config.swa_token_bytes
        return self._store(key, nbytes, len(slots), lambda: self.io.save_swa(key, list(slots)))  # type: ignore[union-attr]

    def _store(self, key: bytes, nbytes: int, tokens: int, save: Callable[[], bool | None]) -> bool:
        if nbytes > self.host.capacity_bytes:
            return False
        self._make_room(self.host, nbytes)
        running = bool(save()) if self.io is not None else False
        self.host.add(key, nbytes, tokens)
        self.from_disk.discard(key)
        self.stats.demoted_bytes += nbytes
        return running

    def _settle_restores(self) -> None:
        """A page leaving the device (copied out, or reused at once) must not
        still be the target of a restore running beside the forward."""
        finish = getattr(self.io, "finish_restores", None)
        if finish is not None:
            finish()

    def finished_demotions(self, wait: bool = False) -> list[tuple[bytes, list[int]]]:
        """(FULL or SWA, device ids) whose background copies finished since the
        last call (``wait``: all, once they finish): free to reuse."""
        finished = getattr(self.io, "finished", None)
        return finished(wait) if finished is not None else []

    def _make_room(self, index: TierIndex, nbytes: int) -> None:
        while index.used_bytes + nbytes > index.capacity_bytes:
            oldest = index.oldest()
            assert oldest is not None, "an entry larger than its tier was not refused"
            self._evict(index, oldest)

    def _evict(self, index: TierIndex, key: bytes) -> None:
        """Host entries spill to disk (unless it is off or has them already);
        the disk drops its entries."""
        nbytes, tokens = index.entry(key)
        index.remove(key)
        self.from_disk.discard(key)
        if index is self.host and nbytes <= self.disk.capacity_bytes:
            if not (key in self.disk and self.disk.tokens(key) >= tokens):
                self._make_room(self.disk, nbytes)
                if self.io is not None:
                    self.io.spill(key)  # before the host copy is discarded: it reads it
                self.disk.add(key, nbytes, tokens)
                self.stats.spilled_bytes += nbytes
        else:
            self.stats.dropped_entries += 1
        self._discard(index.name, key)

    def _discard(self, tier: Tier, key: bytes) -> None:
        if self.io is not None:
            self.io.discard(tier, key)

    # ----------------------------------------------------------- prefetch
    def prefetch(self, keys: Iterable[bytes]) -> bool:
        """Start reading the disk-only ones of ``keys`` into host memory, in the
        background (when the mechanism can); True while any of them is still
        on its way, so the request waits and others run."""
        if not hasattr(self.io, "prefetch"):  # a PrefetchIO; without one, restores read disk in place
            return False
        waiting = False
        for key in keys:
            if key in self.loading:
                waiting = True
            elif key in self.disk and key not in self.host:
                self.loading.add(key)
                self.io.prefetch(key)  # type: ignore[union-attr]
                waiting = True
        return waiting

    def poll(self) -> None:
        """Take in the background reads that finished: each becomes a host
        entry, or, when its file was bad, a miss from that page on."""
        if not self.loading:
            return
        for key, ok in self.io.prefetched():  # type: ignore[union-attr]
            self.loading.discard(key)
            if not ok:
                self.stats.load_failures += 1
                self.disk.remove(key)
                continue
            if key not in self.disk:
                continue  # evicted from disk meanwhile: forgotten
            nbytes, tokens = self.disk.entry(key)
            if key in self.host or nbytes > self.host.capacity_bytes:
                continue
            self._make_room(self.host, nbytes)
            self.io.adopt_prefetched(key)  # type: ignore[union-attr]
            self.host.add(key, nbytes, tokens)
            self.from_disk.add(key)
            self.stats.restored_bytes["disk"] += nbytes
            self.stats.restored_entries["disk"] += 1

    # ------------------------------------------------------------ restore
    def touch_page(self, address: bytes) -> None:
        """A match will read this page's entries: most recently used."""
        self.touch(address + FULL)
        self.touch(address + SWA)

    def load_full_run(self, addresses: Sequence[bytes], pages: Sequence[int]) -> int:
        """Copy consecutive pages' full KV into device ``pages`` (a run from one
        tier in one transfer); how many, from the first, were restored. The
        first that fails is forgotten (a bad checksum, a short or missing file)."""
        done = 0
        while done < len(addresses):
            tier = self.full_tier(addresses[done])
            if tier is None:
                return done
            index = self.index(tier)
            end = done
            while end < len(addresses) and addresses[end] + FULL in index:
                end += 1
            keys = [a + FULL for a in addresses[done:end]]
            loaded = self.io.load_full_many(tier, keys, pages[done:end]) if self.io is not None else len(keys)
            for key in keys[:loaded]:
                index.touch(key)
            self.stats.restored_bytes[tier] += loaded * self.config.full_page_bytes
            self.stats.restored_entries[tier] += loaded
            done += loaded
            if loaded < len(keys):
                self.stats.load_failures += 1
                index.remove(keys[loaded])
                self._discard(tier, keys[loaded])
                return done
        return done

    def load_swa(self, address: bytes, slots: Sequence[int]) -> bool:
        """Copy the SWA KV of the page's last ``len(slots)`` positions into ``slots``."""
        key = address + SWA
        return self._load(key, len(slots), len(slots) * self.config.swa_token_bytes,
                          lambda tier: self.io.load_swa(tier, key, list(slots)))  # type: ignore[union-attr]

    def _load(self, key: bytes, tokens: int, nbytes: int, load: Callable[[Tier], bool]) -> bool:
        """False when no tier has the entry (any more) or its load failed (bad
        checksum, short or missing file): a failed entry is forgotten, so the
        next match stops before it."""
        for tier in TIERS:
            index = self.index(tier)
            if key not in index or index.tokens(key) < tokens:
                continue
            if self.io is not None and not load(tier):
                self.stats.load_failures += 1
                index.remove(key)
                self._discard(tier, key)
                return False
            index.touch(key)
            self.stats.restored_bytes[tier] += nbytes
            self.stats.restored_entries[tier] += 1
            return True
        return False

    def persist(self) -> None:
        """Copy every host entry the disk lacks to disk (a shutdown: host memory
        is about to go, and the next process starts from the disk)."""
        if not self.disk.capacity_bytes:
            return
        for key in list(self.host.keys()):
            nbytes, tokens = self.host.entry(key)
            if nbytes > self.disk.capacity_bytes or (key in self.disk and self.disk.tokens(key) >= tokens):
                continue
            self._make_room(self.disk, nbytes)
            if self.io is not None:
                self.io.spill(key)
            self.disk.add(key, nbytes, tokens)
            self.stats.spilled_bytes += nbytes

    def spill_host(self) -> None:
        """Move every host entry to disk (host memory is wanted back)."""
        self.persist()
        for key in list(self.host.keys()):
            self.host.remove(key)
            self._discard("host", key)
        self.from_disk.clear()

    def adopt_disk_entries(self, entries: Iterable[tuple[bytes, int]]) -> None:
        """Index what an earlier process left on disk ((key, tokens), oldest
        first), within the budget: a restart restores those prefixes."""
        for key, tokens in entries:
            part = key[ADDRESS_BYTES:]
            if len(key) != ADDRESS_BYTES + 1 or part not in (FULL, SWA):
                continue
            nbytes = self.config.full_page_bytes if part == FULL else tokens * self.config.swa_token_bytes
            if nbytes > self.disk.capacity_bytes:
                self._discard("disk", key)
                continue
            self._make_room(self.disk, nbytes)
            self.disk.add(key, nbytes, 0 if part == FULL else tokens)

    def clear(self) -> None:
        """Drop every entry of both tiers."""
        self.from_disk.clear()
        for index in (self.host, self.disk):
            for key in list(index.keys()):
                index.remove(key)
                self._discard(index.name, key)

    def as_dict(self) -> dict[str, object]:
        s = self.stats
        return {
            "host_bytes_used": self.host.used_bytes, "host_bytes_capacity": self.host.capacity_bytes,
            "disk_bytes_used": self.disk.used_bytes, "disk_bytes_capacity": self.disk.capacity_bytes,
            "host_entries": len(self.host), "disk_entries": len(self.disk),
            "demoted_bytes": s.demoted_bytes, "spilled_bytes": s.spilled_bytes,
            "restored_bytes": dict(s.restored_bytes), "restored_entries": dict(s.restored_entries),
            "load_failures": s.load_failures, "dropped_entries": s.dropped_entries,
        }
