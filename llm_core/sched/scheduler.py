"""Continuous batching with chunked prefill, over the KV allocator only.

Each step: every running request in decode gets one token; requests still
prefilling get the next chunk of their prompt; waiting requests are admitted
in policy order (``schedule_policy.py``) while the token budget, the
running limit and both pools allow. When a decode cannot get memory, a
request the policy picks is preempted by recompute (its KV is freed, its
computed prefix stays cached, and it waits again).
No torch here: the engine turns the schedule into a forward batch.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field

from llm_core.kv.kv_pool import KVAllocator, SequenceView
from llm_core.kv.prefix_cache import RadixCache
from llm_core.kv.prefix_cache_records import CacheLock
from llm_core.sched.schedule_policy import POLICIES, LengthBuckets, Running, Waiting, make_policy


@dataclass
class Sequence:
    request_id: int
    prompt: list[int]
    max_tokens: int
    view: SequenceView
    output: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in the pools
    finish_reason: str | None = None
    cache_lock: CacheLock | None = None  # set while it holds prefix-cache nodes
    cached_tokens: int | None = None  # prompt tokens served by the cache at first admission
    # Speculative decoding: draft tokens waiting to be verified in the next
    # step, and the first position whose MTP rows are not final yet.
    num_drafts: int = 0
    mtp_done: int = 0
    # Its cached prefix is being read from disk into host memory: it waits
    # (others are admitted past it) and matches again once that is done. One
    # such round per request: what is still on disk then is read in place.
    loading_keys: tuple[bytes, ...] = ()  # the tier entries it waits for
    prefetched: bool = False
    is_running: bool = False  # in Scheduler.running (a flag: O(1) where the list would be O(B))
    arrival: float | None = None  # the scheduler's clock when it was added
    # (step, tokens) of its last cached-length estimate: peeks are reused for a few steps.
    peeked: tuple[int, int] | None = None
    admitted: bool = False  # admitted at least once (its queue wait is counted)
    answered: bool = False  # its first token is out (its TTFT is counted)
    # Prompt positions just past each media span: follow-up questions about the
    # same picture or clip share the prompt up to there and branch after it.
    media_ends: tuple[int, ...] = ()

    def tokens(self, end: int) -> list[int]:
        return self.token_slice(0, end)

    @property
    def loading(self) -> bool:
        return bool(self.loading_keys)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    def token_slice(self, start: int, end: int) -> list[int]:
        n = len(self.prompt)
        if start >= n:
            return self.output[start - n : end - n]
        if end <= n:
            return self.prompt[start:end]
        return self.prompt[start:] + self.output[: end - n]

    @property
    def in_decode(self) -> bool:
        return self.num_tokens - self.num_computed == 1 and len(self.output) > 0


class RequestTooLarge(MemoryError):
    """One request needs more KV memory than the pools have, even with everything
    else preempted: that request must fail, the others can go on."""

    def __init__(self, seq: Sequence) -> None:
        super().__init__(f"request {seq.request_id} needs more KV memory than the pools have "
                         f"({seq.num_tokens} tokens)")
        self.seq = seq


@dataclass(frozen=True)
class ScheduledChunk:
    seq: Sequence
    start: int  # first position computed in this step
    length: int  # known tokens computed
    drafts: int = 0  # draft tokens verified after them (rows start + length ...)

    @property
    def rows(self) -> int:
        return self.length + self.drafts

    @property
    def samples(self) -> bool:
        """Whether the step's last position ends the known tokens (a token is sampled)."""
        return self.start + self.length == self.seq.num_tokens


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int = 64
    max_num_batched_tokens: int = 4096
    chunked_prefill_size: int = 1024
    policy: str = "compute-aware"  # see schedule_policy.py
    # Prompt-length bucket edges: latency is reported per bucket, and under a
    # policy that shares budget by length (compute-aware) each step's prefill
    # budget is shared between the buckets with work; () is one bucket.
    bucket_edges: tuple[int, ...] = ()
    # Once a step's prefill holds this many tokens, no further waiting request
    # is admitted into it (None: only the budget limits admission). Where
    # prefill costs about the same per token at any batch size (CPU), a second
    # prompt in the same step only delays the first one's first token by its
    # own compute; the next step takes it. A first prompt longer than this
    # still goes whole (up to ``chunked_prefill_size``).
    prefill_batch_tokens: int | None = None

    def __post_init__(self) -> None:
        if min(self.max_running_requests, self.max_num_batched_tokens, self.chunked_prefill_size) < 1:
            raise ValueError("scheduler limits must be positive")
        if self.prefill_batch_tokens is not None and self.prefill_batch_tokens < 1:
            raise ValueError(f"prefill_batch_tokens must be positive, got {self.prefill_batch_tokens}")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown schedule policy {self.policy!r}; choose from {', '.join(POLICIES)}")
        LengthBuckets(self.bucket_edges)  # validates


class RequestQueue:
    """Requests in the order they were put in, with O(1) append, removal and
    membership by request id (a list's ``remove`` and ``in`` would make a
    step O(B^2) over B requests). Policies order admission and pick victims:
    no decision depends on this order."""

    def __init__(self) -> None:
        self._seqs: dict[int, Sequence] = {}

    def append(self, seq: Sequence) -> None:
        self._seqs[seq.request_id] = seq

    def remove(self, seq: Sequence) -> None:
        del self._seqs[seq.request_id]

    def first(self) -> Sequence:
        return next(iter(self._seqs.values()))

    def __contains__(self, seq: object) -> bool:
        return isinstance(seq, Sequence) and self._seqs.get(seq.request_id) is seq

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._seqs.values())

    def __len__(self) -> int:
        return len(self._seqs)


# Upper bounds (seconds) of the queue-wait and TTFT histograms.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


@dataclass
class LatencyHistogram:
    """Counts per LATENCY_BUCKETS bound (the last: above them all), and the sum."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    total_s: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.total_s += seconds

    def as_dict(self) -> dict[str, object]:
        n = sum(self.counts)
        return {"count": n, "sum_s": self.total_s, "mean_s": self.total_s / n if n else 0.0,
                "counts": list(self.counts)}


# Steps a waiting request's cached-length estimate is reused before it is peeked again.
PEEK_EVERY = 8


class Scheduler:
    def __init__(self, allocator: KVAllocator, config: SchedulerConfig, cache: RadixCache | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.allocator = allocator
        self.config = config
        self.cache = cache
        self.policy = make_policy(config.policy)
        self.clock = clock
        self.waiting = RequestQueue()
        self.running = RequestQueue()
        self._steps = 0
        self.buckets = LengthBuckets(config.bucket_edges)
        self.reset_stats()

    def reset_stats(self) -> None:
        """Preemptions and latencies counted from now (after a warm-up)."""
        self.num_preemptions = 0
        self.queue_wait = [LatencyHistogram() for _ in range(len(self.buckets))]
        self.ttft = [LatencyHistogram() for _ in range(len(self.buckets))]

    def add(self, seq: Sequence) -> None:
        if seq.arrival is None:
            seq.arrival = self.clock()
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def adopt(self, seq: Sequence) -> None:
        """Run a request whose prompt was computed elsewhere (its KV is in the
        view already): it decodes from the next step, its TTFT counted there."""
        if seq.arrival is None:
            seq.arrival = self.clock()
        seq.admitted = seq.answered = True
        self.running.append(seq)
        seq.is_running = True

    def schedule(self) -> list[ScheduledChunk]:
        if self.cache is not None and self.cache.tiers is not None:
            self.cache.tiers.poll()
            self.cache.reclaim()
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        # Decodes first: they hold memory already and each costs one token.
        for seq in [s for s in self.running if s.in_decode]:
            if not seq.is_running:
                continue  # preempted below to make room for an earlier one
            drafts = min(seq.num_drafts, budget - 1)
            if budget < 1 or not self._grow_or_preempt(seq, seq.num_computed + 1 + drafts, chunks):
                continue
            chunks.append(ScheduledChunk(seq, seq.num_computed, 1, drafts))
            budget -= 1 + drafts
        self._steps += 1
        budget = self._prefills(budget, chunks)
        if not chunks and self.loading():
            return chunks  # nothing to run until a disk read finishes
        if not chunks and len(self.running) > 1:
            # Every running request is stuck on memory: free one (by policy) and retry.
            self.preempt(self._victim())
            return self.schedule()
        if not chunks and self.has_unfinished():
            raise RequestTooLarge((self.running or self.waiting).first())
        return chunks

    def _prefills(self, budget: int, chunks: list[ScheduledChunk]) -> int:
        """Chunks of running prefills and admissions, all in policy order (a
        short new request may go before a long prefill's next chunk), under a
        budget shared between length buckets; then whatever is left of it to
        anyone still unscheduled. Returns the budget left."""
        order = self._prefill_order()
        sharing = self.policy.shares_budget_by_length and len(self.buckets) > 1
        share_of: Callable[[Sequence], int] = self._bucket if sharing else (lambda seq: 0)
        if sharing:
            demand = [0] * len(self.buckets)
            population = [0] * len(self.buckets)
            for seq, info in order:
                demand[self._bucket(seq)] += min(info.tokens_left, self.config.chunked_prefill_size)
                population[self._bucket(seq)] += 1
            left = self.buckets.shares(demand, budget, population)
        else:
            left = [budget]
        scheduled: set[int] = set()
        batch_limit = self.config.prefill_batch_tokens
        prefill_tokens = 0

        def take(chunk: ScheduledChunk) -> None:
            nonlocal budget, prefill_tokens
            chunks.append(chunk)
            scheduled.add(chunk.seq.request_id)
            budget -= chunk.length
            prefill_tokens += chunk.length
            left[share_of(chunk.seq)] -= chunk.length

        for shared in (True, False):
            reserved = False
            for seq, info in order:
                if budget < 1:
                    break
                n = min(left[share_of(seq)], budget) if shared else budget
                if seq.request_id in scheduled or n < 1:
                    continue  # scheduled already, or its bucket's share is spent (the second round may take it)
                if seq.is_running:
                    if chunk := self._prefill_chunk(seq, n):
                        take(chunk)
                    continue
                if reserved or len(self.running) >= self.config.max_running_requests:
                    continue  # no admission past a reservation, or no room to run more
                if batch_limit is not None and prefill_tokens >= batch_limit:
                    continue  # the step's prefill is full enough: the next step admits it
                chunk = self._prefill_chunk(seq, n)
                if chunk is None:
                    # Not admitted: it must not pin the cached prefix it matched, or
                    # the running requests could not evict those pages to grow.
                    self._unpin(seq)
                    if seq.loading or not self.policy.reserves(info):
                        continue  # skipped, not waited on: the next one may fit
                    reserved = True  # it has waited long enough: nothing is admitted past it
                    continue
                self._admit(seq)
                take(chunk)
            if reserved or budget < 1 or len(left) == 1:
                break
        return budget

    def _prefill_order(self) -> list[tuple[Sequence, Waiting]]:
        """Running prefills and waiting requests in the order the policy
        serves them (a running one's work left is what it has not computed)."""
        now = self.clock()
        prefilling = [seq for seq in self.running if not seq.in_decode]
        infos = {seq.request_id: (seq, self._waiting(seq, now)) for seq in (*self.waiting, *prefilling)}
        return [infos[rid] for rid in self.policy.order([info for _, info in infos.values()])]

    def _bucket(self, seq: Sequence) -> int:
        return self.buckets.of(len(seq.prompt))

    def _admit(self, seq: Sequence) -> None:
        self.waiting.remove(seq)
        self.running.append(seq)
        seq.is_running = True
        if not seq.admitted and seq.arrival is not None:
            seq.admitted = True
            self.queue_wait[self._bucket(seq)].observe(self.clock() - seq.arrival)

    def _waiting(self, seq: Sequence, now: float) -> Waiting:
        """How the policy sees ``seq`` (a running prefill: its computed prefix as cached)."""
        if seq.is_running:
            cached = seq.num_computed
        else:
            cached = self._cached_length(seq) if self.policy.needs_cached_lengths else 0
        arrival = now if seq.arrival is None else seq.arrival
        return Waiting(seq.request_id, arrival, now - arrival, seq.num_tokens - max(cached, seq.num_computed), cached)

    def _cached_length(self, seq: Sequence) -> int:
        """Tokens of its prefix some tier holds (a side-effect-free peek,
        reused for PEEK_EVERY steps)."""
        if self.cache is None:
            return 0
        if seq.peeked is None or self._steps - seq.peeked[0] >= PEEK_EVERY:
            keys = self.cache.page_keys(seq.tokens(seq.num_tokens))
            cached = self.cache.peek(keys, max_pages=(seq.num_tokens - 1) // self.cache.page_size).disk
            seq.peeked = (self._steps, cached)
        return seq.peeked[1]

    def _victim(self, scheduled: Collection[int] = ()) -> Sequence:
        """The running request to preempt, by policy, among those without a
        chunk in this step yet (a scheduled chunk's KV must stay)."""
        candidates = [s for s in self.running if s.request_id not in scheduled]
        rid = self.policy.victim([Running(s.request_id, 0.0 if s.arrival is None else s.arrival,
                                          s.num_tokens - s.num_computed) for s in candidates])
        return next(s for s in candidates if s.request_id == rid)

    def latency_stats(self) -> dict[str, object]:
        """Queue wait (arrival to first admission) and TTFT per length bucket."""
        return {"policy": self.policy.name, "bucket_edges": list(self.buckets.edges),
                "latency_buckets_s": list(LATENCY_BUCKETS),
                "buckets": {label: {"queue_wait": self.queue_wait[b].as_dict(), "ttft": self.ttft[b].as_dict()}
                            for b, label in enumerate(self.buckets.labels)}}

    def queued_tokens(self) -> int:
        """Prompt tokens still to compute: waiting requests (less their last
        cache estimate) and running prefills. What a router balances."""
        total = 0
        for seq in self.waiting:
            total += seq.num_tokens - max(seq.num_computed, seq.peeked[1] if seq.peeked is not None else 0)
        for seq in self.running:
            if not seq.in_decode:
                total += seq.num_tokens - seq.num_computed
        return total

    def loading(self) -> bool:
        """Whether a waiting request waits for its prefix to come from disk."""
        return any(seq.loading for seq in self.waiting)

    def _prefill_chunk(self, seq: Sequence, budget: int) -> ScheduledChunk | None:
        if self.cache is not None and seq.cache_lock is None:
            self._match_prefix(seq)
            if seq.loading:
                return None
        n = min(seq.num_tokens - seq.num_computed, self.config.chunked_prefill_size, budget)
        if n < 1 or not self._has_room(seq.view, seq.num_computed + n):
            return None
        self.allocator.grow(seq.view, seq.num_computed + n)
        return ScheduledChunk(seq, seq.num_computed, n)

    def _match_prefix(self, seq: Sequence) -> None:
        """Reuse the longest window-safe cached prefix: no copy, no prefill."""
        assert self.cache is not None
        tiers = self.cache.tiers
        if seq.loading:  # a disk read is on its way: check it without matching again
            if any(key in tiers.loading for key in seq.loading_keys):  # type: ignore[union-attr]
                return
            seq.loading_keys = ()
        keys = self.cache.page_keys(seq.tokens(seq.num_tokens))
        while True:
            # At least one token must run to produce the next logits.
            match = self.cache.match(keys, max_pages=(seq.num_tokens - 1) // self.cache.page_size)
            if tiers is not None and not seq.prefetched:
                disk = self.cache.disk_keys(match)
                if tiers.prefetch(disk):
                    seq.prefetched, seq.loading_keys = True, tuple(disk)
                    return
            lock = self.cache.attach(seq.view, match)
            if lock is not None:
                break  # else a page failed to load from a tier and is forgotten: match again
        seq.cache_lock = lock
        seq.num_computed = seq.mtp_done = seq.view.num_tokens
        if seq.cached_tokens is None:
            stats = self.cache.stats
            seq.cached_tokens = seq.view.num_tokens
            stats.cached_prompt_tokens += seq.cached_tokens
            stats.computed_prompt_tokens += len(seq.prompt) - seq.cached_tokens
            by_tier = match.tokens_by_tier(self.cache.page_size)
            if seq.cached_tokens != match.length:  # no room to restore: the device part alone
                by_tier = {tier: seq.cached_tokens if tier == "device" else 0 for tier in by_tier}
            for tier, tokens in by_tier.items():
                stats.cached_tokens_by_tier[tier] += tokens

    def _has_room(self, view: SequenceView, new_len: int) -> bool:
        """Whether ``view`` can grow, evicting cached prefixes if that helps."""
        if self.allocator.can_grow(view, new_len):
            return True
        if self.cache is None:
            return False
        self.cache.make_room(*self.allocator.pages_needed(view, new_len))
        return self.allocator.can_grow(view, new_len)

    def _grow_or_preempt(self, seq: Sequence, new_len: int, chunks: list[ScheduledChunk]) -> bool:
        if not self._has_room(seq.view, new_len):
            scheduled = {c.seq.request_id for c in chunks}  # built only when a victim is needed
            while not self._has_room(seq.view, new_len):
                victim = self._victim(scheduled)
                self.preempt(victim)
                if victim is seq:
                    return False
        self.allocator.grow(seq.view, new_len)
        return True

    def _unpin(self, seq: Sequence) -> None:
        if seq.cache_lock is not None:
            self._release_kv(seq, insert=False)
            seq.num_computed = seq.mtp_done = 0

    def preempt(self, seq: Sequence) -> None:
        """Free a running request's KV; it resumes later by re-matching the
        prefix cache, where its computed prefix now is (evictable like any
        other, and demoted to the tiers if evicted)."""
        self._release_kv(seq, insert=True)
        seq.num_computed = seq.num_drafts = seq.mtp_done = 0
        self.running.remove(seq)
        seq.is_running = False
        self.waiting.append(seq)  # its arrival, not its place here, puts it ahead under FCFS
        self.num_preemptions += 1

    def commit(self, chunk: ScheduledChunk, accepted: int = 0) -> None:
        """The chunk's known tokens and its first ``accepted`` drafts are computed;
        the slots of rejected drafts go back to both pools."""
        seq = chunk.seq
        seq.num_computed = chunk.start + chunk.length + accepted
        seq.num_drafts = 0
        if chunk.drafts:
            self.allocator.truncate(seq.view, seq.num_computed)

    def advance(self, chunks: list[ScheduledChunk]) -> None:
        """A step without drafts: commit every chunk, then ``after_step``."""
        for chunk in chunks:
            self.commit(chunk)
        self.after_step(chunks)

    def after_step(self, chunks: list[ScheduledChunk]) -> None:
        """Take checkpoints and return SWA slots that left the window, once every
        chunk is committed (and its MTP rows are final)."""
        now = self.clock()
        for chunk in chunks:
            seq = chunk.seq
            if seq.output and not seq.answered and seq.arrival is not None:  # its first token came out in this step
                seq.answered = True
                self.ttft[self._bucket(seq)].observe(now - seq.arrival)
            if self.cache is not None:
                for boundary, durable in self._checkpoints_crossed(seq, chunk.start):
                    self.cache.insert(seq.view, self.cache.page_keys(seq.tokens(boundary)), boundary,
                                      seq.cache_lock, durable=durable)  # type: ignore[arg-type]
            self.allocator.release_out_of_window(seq.view, seq.num_computed)

    def _prompt_checkpoints(self, seq: Sequence) -> set[int]:
        """Where the prompt keeps SWA for later requests (page-aligned down): its
        last full page, and the ends of its media spans."""
        ps = self.allocator.full.page_size
        assert self.cache is not None
        if not self.cache.prompt_checkpoints:
            return set()
        return {p // ps * ps for p in (len(seq.prompt), *seq.media_ends)}

    def _checkpoints_crossed(self, seq: Sequence, start: int) -> list[tuple[int, bool]]:
        """(position, durable) of the checkpoints reached in this step: the
        prompt's (see ``_prompt_checkpoints``; durable), and every
        ``checkpoint_interval`` tokens."""
        ps = self.allocator.full.page_size
        assert self.cache is not None
        durable = self._prompt_checkpoints(seq)
        points: list[int] = [*durable]
        if self.cache.checkpoint_interval:
            step = self.cache.checkpoint_interval
            points += range((start // step + 1) * step, seq.num_computed + 1, step)
        crossed = sorted({p // ps * ps for p in points if start < p <= seq.num_computed and p >= ps})
        return [(p, p in durable) for p in crossed]

    def _release_kv(self, seq: Sequence, insert: bool) -> None:
        if self.cache is not None and seq.cache_lock is not None:
            if insert:
                keys = self.cache.page_keys(seq.tokens(seq.num_computed))
                self.cache.insert(seq.view, keys, seq.num_computed, seq.cache_lock)
            self.cache.release(seq.cache_lock)
            seq.cache_lock = None
        self.allocator.free(seq.view)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a request (done, aborted or failed). What it computed goes to the
        cache, unless it failed: its KV may be what made it fail."""
        seq.finish_reason = reason
        self._release_kv(seq, insert=reason != "error")
        if seq.is_running:
            self.running.remove(seq)
            seq.is_running = False
        elif seq in self.waiting:
            self.waiting.remove(seq)
