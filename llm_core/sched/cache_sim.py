"""Prefix-cache simulator: the engine's scheduler, allocator and radix cache
driven by token sequences, without any model forward.

Requests run one after another; outputs are given, not sampled. Memory
behaves as in the engine: prompts are prefilled in chunks with the SWA ring
released between chunks, checkpoints are taken at the same points, and
eviction happens on pool pressure.

With ``verify=True`` the simulator keeps a shadow of what every pool slot
holds (which token prefix's KV was written there, cleared when the slot is
freed) and checks every hit against it: a hit whose pages or window hold
anything else is counted as a false hit.

With host and disk tiers (``host_tokens``, ``disk_tokens``) the same
``KVTiers`` bookkeeping as the engine's runs under the cache, transfers as
byte counts; with ``verify`` a shadow of every tier entry moves with the
demotions, spills and restores, so a restored hit is checked the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Literal

from llm_core.kv.kv_events import KVEventLog
from llm_core.kv.kv_pool import FullKVPool, KVAllocator, SWAKVPool
from llm_core.kv.tiers.kv_tiers import TIERS, KVTiers, Tier, TierConfig
from llm_core.kv.page_address import token_bytes
from llm_core.kv.prefix_cache import RadixCache
from llm_core.kv.prefix_cache_records import PageKey
from llm_core.sched.scheduler import ScheduledChunk, Scheduler, SchedulerConfig, Sequence

Policy = Literal["window", "keep_all", "no_checkpoints"]
POLICIES: tuple[Policy, ...] = ("window", "keep_all", "no_checkpoints")
# How the shadow tells token runs apart: by the tokens themselves, or, for
# traces whose pages are determined by their first token, by that token (cheap).
PageIdentity = Literal["tokens", "first_token"]
# Tier "bytes" are 1/16 of a token of full-layer KV: a fractional SWA cost stays exact enough.
TIER_UNIT = 16


@dataclass
class SimResult:
    requests: int = 0
    failed: int = 0  # requests that could not fit in the pools at all
    prompt_tokens: int = 0
    cached_tokens: int = 0
    false_hits: int = 0
    verified_hits: int = 0
    peak_full_tokens: int = 0
    peak_swa_tokens: int = 0
    cached_tokens_by_tier: dict[str, int] = field(default_factory=lambda: {"device": 0, **{t: 0 for t in TIERS}})

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class CacheSimulator:
    """``policy``: ``window`` (this engine: SWA ring, checkpoints, fallback),
    ``keep_all`` (SWA KV kept for every token, as engines without SWA support
    do), ``no_checkpoints`` (SWA ring, SWA kept only where requests end,
    tombstones without fallback).

    ``host_tokens`` / ``disk_tokens``: tier budgets in tokens of full-layer KV;
    a position of SWA KV costs ``swa_token_cost`` of them (the byte ratio of
    the model's SWA and full layers)."""

    def __init__(
        self,
        page_size: int,
        window: int,
        full_tokens: int,
        swa_tokens: int,
        policy: Policy = "window",
        chunk: int = 8192,
        checkpoint_interval: int | None = None,
        verify: bool = False,
        page_identity: PageIdentity = "tokens",
        host_tokens: int = 0,
        disk_tokens: int = 0,
        swa_token_cost: float = 1.0,
        events: KVEventLog | None = None,
    ) -> None:
        mode = "full" if policy == "keep_all" else "hybrid"
        self.page_size = page_size
        self.allocator = KVAllocator(
            FullKVPool(full_tokens // page_size, page_size), SWAKVPool(swa_tokens, 1), window, mode
        )
        self._shadow = _ShadowPools(self.allocator, page_size, page_identity) if verify else None
        self.tiers: KVTiers | None = None
        if host_tokens:
            unit = TIER_UNIT
            config = TierConfig(host_tokens * unit, disk_tokens * unit, page_size * unit,
                                max(1, round(swa_token_cost * unit)))
            self.tiers = KVTiers(config, ShadowTierIO(self._shadow) if self._shadow is not None else None,
                                 events.record_tier_key if events is not None else None)
        self.cache = RadixCache(
            self.allocator,
            checkpoint_interval,
            fallback=policy != "no_checkpoints",
            prompt_checkpoints=policy != "no_checkpoints",
            tiers=self.tiers,
            key_bytes=_first_token_bytes if page_identity == "first_token" else token_bytes,
            events=events,
        )
        self.scheduler = Scheduler(self.allocator, SchedulerConfig(1, chunk, chunk), self.cache)
        self.result = SimResult()
        self._next_id = 0
        self._verified: set[int] = set()  # requests whose hit was checked

    def run(
        self,
        prompt: list[int],
        output: list[int],
        on_compute: Callable[[ScheduledChunk], None] | None = None,
    ) -> int:
        """Serve one request to completion; returns its cached prompt tokens.
        ``on_compute`` sees every chunk where a forward would run."""
        seq = Sequence(self._next_id, prompt, max(len(output), 1), self.allocator.new_view())
        self._next_id += 1
        self.scheduler.add(seq)
        shadow = self._shadow
        if shadow is not None:
            shadow.start(seq)
        try:
            while seq.finish_reason is None:
                chunks = self.scheduler.schedule()
                for chunk in chunks:
                    if shadow is not None:
                        self._verify_hit(chunk)
                        shadow.write(chunk)
                    if on_compute is not None:
                        on_compute(chunk)
                self.scheduler.advance(chunks)
                self._track_peaks()
                if any(c.samples for c in chunks):
                    if seq.output or not output:
                        self.scheduler.finish(seq, "length")
                    else:
                        seq.output.extend(output)  # decode, as one extension of the sequence
        except MemoryError:
            self.scheduler.finish(seq, "abort")
            self.result.failed += 1
        cached = seq.cached_tokens or 0
        self.result.cached_tokens_by_tier = dict(self.cache.stats.cached_tokens_by_tier)
        self.result.requests += 1
        self.result.prompt_tokens += len(prompt)
        self.result.cached_tokens += cached
        return cached

    def tier_stats(self) -> dict[str, object] | None:
        """The tiers' statistics with sizes in tokens of full-layer KV."""
        if self.tiers is None:
            return None
        out: dict[str, object] = {}
        for name, value in self.tiers.as_dict().items():
            name = name.replace("_bytes", "_tokens")
            if isinstance(value, dict):
                out[name] = {k: v / TIER_UNIT for k, v in value.items()} if "tokens" in name else value
            else:
                out[name] = value / TIER_UNIT if "tokens" in name else value  # type: ignore[operator]
        return out

    def _verify_hit(self, chunk: ScheduledChunk) -> None:
        seq = chunk.seq
        if chunk.start == 0 or chunk.start != seq.cached_tokens or seq.request_id in self._verified:
            return  # not a hit, or already checked
        self._verified.add(seq.request_id)
        self.result.verified_hits += 1
        assert self._shadow is not None
        if not self._shadow.holds(seq, chunk.start, self.cache.window_tokens):
            self.result.false_hits += 1

    def _track_peaks(self) -> None:
        full, swa = self.allocator.full, self.allocator.swa
        self.result.peak_full_tokens = max(self.result.peak_full_tokens, full.capacity - full.free_slots)
        self.result.peak_swa_tokens = max(self.result.peak_swa_tokens, swa.capacity - swa.free_slots)


class _ShadowPools:
    """What each full page and SWA slot truly holds: an id of the token prefix
    whose KV was written there; None once freed."""

    def __init__(self, allocator: KVAllocator, page_size: int, identity: PageIdentity) -> None:
        self.page_size = page_size
        self.identity = identity
        self.full: list[Hashable | None] = [None] * allocator.full.num_pages
        self.swa: list[Hashable | None] = [None] * allocator.swa.capacity
        self._chain_ids: dict[tuple[int, Hashable], int] = {}
        self._chain: list[int] = []  # prefix id after each complete page of the current request
        self._seq: Sequence | None = None
        for pool, shadow in ((allocator.full, self.full), (allocator.swa, self.swa)):
            pool.release = self._clearing(pool.release, shadow)  # type: ignore[method-assign]

    @staticmethod
    def _clearing(release: Callable[[list[int]], None], shadow: list[Hashable | None]):  # noqa: ANN205
        def wrapped(items: list[int]) -> None:
            for item in items:
                shadow[item] = None
            release(items)

        return wrapped

    def start(self, seq: Sequence) -> None:
        self._seq, self._chain = seq, []

    def _run_id(self, start: int, end: int) -> Hashable:
        """Identity of the tokens [start, end) of the current request (one page at most)."""
        assert self._seq is not None
        if self.identity == "first_token":
            return self._seq.token_slice(start, start + 1)[0]
        return tuple(self._seq.token_slice(start, end))

    def _prefix_id(self, pages: int) -> int:
        while len(self._chain) < pages:
            p = len(self._chain)
            key = (self._chain[-1] if p else 0, self._run_id(p * self.page_size, (p + 1) * self.page_size))
            self._chain.append(self._chain_ids.setdefault(key, len(self._chain_ids) + 1))
        return self._chain[pages - 1] if pages else 0

    def _content(self, pos: int) -> Hashable:
        page, offset = divmod(pos, self.page_size)
        if self.identity == "first_token":
            # The page's first token fixes the rest: one id per (page, offset).
            return self._page_base(page) * self.page_size + offset
        return (self._prefix_id(page), self._run_id(page * self.page_size, pos + 1), offset)

    def _page_base(self, page: int) -> int:
        key = ("base", self._prefix_id(page), self._run_id(page * self.page_size, page * self.page_size + 1))
        return self._chain_ids.setdefault(key, len(self._chain_ids) + 1)  # type: ignore[arg-type]

    def write(self, chunk: ScheduledChunk) -> None:
        view, ps = chunk.seq.view, self.page_size
        end = chunk.start + chunk.length
        slots = view.swa_slots(chunk.start, end)
        if self.identity == "first_token":
            pos = chunk.start
            while pos < end:
                stop = min(end, (pos // ps + 1) * ps)
                base = self._page_base(pos // ps) * ps
                i = pos - chunk.start
                for slot, offset in zip(slots[i : i + stop - pos], range(pos % ps, pos % ps + stop - pos)):
                    self.swa[slot] = base + offset
                pos = stop
        else:
            for pos, slot in zip(range(chunk.start, end), slots):
                self.swa[slot] = self._content(pos)
        for page in range(chunk.start // ps, end // ps):  # pages completed in this chunk
            self.full[view.full_pages[page]] = self._prefix_id(page + 1)

    def holds(self, seq: Sequence, hit: int, window_tokens: int) -> bool:
        view, ps = seq.view, self.page_size
        for page in range(hit // ps):
            if self.full[view.full_pages[page]] != self._prefix_id(page + 1):
                return False
        first = max(0, hit - window_tokens)
        return all(self.swa[slot] == self._content(pos)
                   for pos, slot in zip(range(first, hit), view.swa_slots(first, hit)))


def _first_token_bytes(key: PageKey) -> bytes:
    """Trace pages are fixed by their first token: address them by it alone."""
    return int(key[0]).to_bytes(8, "little", signed=True)  # type: ignore[index]


class ShadowTierIO:
    """A ``TierIO`` over the shadow pools: each tier entry holds the shadow
    ids of the slots it was saved from, and a restore writes them back, so
    a hit through the tiers is checked against what it really restored.
    ``corrupt`` marks an entry whose next load fails (as a checksum would)."""

    def __init__(self, shadow: _ShadowPools) -> None:
        self.shadow = shadow
        self.entries: dict[Tier, dict[bytes, object]] = {t: {} for t in TIERS}
        self.corrupted: set[tuple[Tier, bytes]] = set()

    def save_full(self, key: bytes, page: int) -> None:
        self.entries["host"][key] = self.shadow.full[page]

    def save_swa(self, key: bytes, slots: list[int]) -> None:
        self.entries["host"][key] = [self.shadow.swa[s] for s in slots]

    def spill(self, key: bytes) -> None:
        self.entries["disk"][key] = self.entries["host"][key]

    def discard(self, tier: Tier, key: bytes) -> None:
        self.entries[tier].pop(key, None)
        self.corrupted.discard((tier, key))

    def corrupt(self, tier: Tier, key: bytes) -> None:
        self.corrupted.add((tier, key))

    def load_full_many(self, tier: Tier, keys: list[bytes], pages: list[int]) -> int:
        for done, (key, page) in enumerate(zip(keys, pages)):
            if (tier, key) in self.corrupted:
                return done
            self.shadow.full[page] = self.entries[tier][key]  # type: ignore[assignment]
        return len(keys)

    def load_swa(self, tier: Tier, key: bytes, slots: list[int]) -> bool:
        if (tier, key) in self.corrupted:
            return False
        held = self.entries[tier][key]
        for slot, content in zip(slots, held[len(held) - len(slots):]):  # type: ignore[index,arg-type]
            self.shadow.swa[slot] = content
        return True
