"""KV-affinity routing over workers, window-safe.

A router keeps, per worker, a ``PrefixIndex`` rebuilt from the worker's KV
events (``kv_events.py``): which page addresses have full KV on which medium
(device, host memory, disk) and how many of each page's last positions have
SWA KV there. A request's pages are addressed the way the worker addresses
them (a hash chain over page token ids, multimodal content keys included,
seeded with the worker's model fingerprint), so the router can walk the
request's prefix through each index exactly as the worker's cache would, and
count only a *window-safe* prefix: full KV for every page and SWA KV for the
last W tokens. A prefix whose window is gone on a worker is worth nothing
there, however many of its full pages are left -- what routers that count
cached blocks alone get wrong on hybrid models.

Policies:

* ``kv-affinity`` (default): the worker with the most reusable tokens minus
  a load term (``load_weight`` x tokens it has queued to compute); a request
  no worker has cached goes to the least loaded. Loads are bounded
  (consistent hashing with bounded loads, Mirrokni, Thorup and
  Zadimoghaddam, SODA 2018): a worker whose work so far exceeds
  ``max_load_ratio`` x the mean, plus one average request, takes no request
  while another is under that bound. Queues say little where agents wait
  for their answers -- they stay short while one worker's sessions keep it
  busier than the rest -- and there the bound keeps the shares even, at the
  price of a recompute for each request it sends elsewhere.
* ``round-robin`` and ``least-load`` (fewest tokens queued to compute), the
  baselines.

A worker's queue is the prompt tokens of requests routed to it that have not
finished their prefill (less what it was expected to reuse), or what it
reports, whichever is more (several routers may share a worker); its work is
the prompt tokens routed to it not expected cached, done or queued. Pure
logic: the same router serves the API process and the trace simulation.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from llm_core.kv.kv_events import MEDIA, EventBatch, KVEvent, Medium
from llm_core.kv.tiers.kv_tiers import FULL, SWA
from llm_core.kv.page_address import CacheGeometry, token_page_addresses

__all__ = [
    "ROUTE_POLICIES",
    "NoWorkers",
    "PrefixIndex",
    "RouteDecision",
    "Router",
]

ROUTE_POLICIES = ("kv-affinity", "round-robin", "least-load")
_MEDIUM_BIT = {medium: 1 << i for i, medium in enumerate(MEDIA)}
_MEDIUM_INDEX = {medium: i for i, medium in enumerate(MEDIA)}


class NoWorkers(RuntimeError):
    """No worker is alive to take the request."""


class PrefixIndex:
    """One worker's cached pages, as its KV events tell them."""

    def __init__(self, geometry: CacheGeometry) -> None:
        self.geometry = geometry
        self._full: dict[bytes, int] = {}  # address -> bit per medium holding the page's full KV
        self._swa: dict[bytes, list[int]] = {}  # address -> SWA positions held per medium
        self.epoch = -1
        self.seq = 0

    def __len__(self) -> int:
        return len(self._full)

    def clear(self) -> None:
        self._full.clear()
        self._swa.clear()

    def apply(self, batch: EventBatch) -> bool:
        """Take a batch of events; False when it cannot be applied (events
        were missed): the caller asks the worker for a snapshot."""
        if batch.snapshot:
            self.clear()
            self._apply(batch.events)
            self.epoch, self.seq = batch.epoch, batch.start
            return True
        if batch.epoch < self.epoch:
            return True  # from before the worker's engine was rebuilt: nothing of it is true any more
        if batch.epoch > self.epoch:
            if batch.start != 0:
                return False
            self.clear()
            self.epoch, self.seq = batch.epoch, 0
        if batch.start > self.seq:
            return False
        # Events are absolute: those already known are applied again harmlessly.
        self._apply(batch.events)
        self.seq = max(self.seq, batch.end)
        return True

    def _apply(self, events: Iterable[KVEvent]) -> None:
        for event in events:
            if event.part == FULL:
                bits = self._full.get(event.address, 0)
                bits = bits | _MEDIUM_BIT[event.medium] if event.held else bits & ~_MEDIUM_BIT[event.medium]
                if bits:
                    self._full[event.address] = bits
                else:
                    self._full.pop(event.address, None)
            elif event.part == SWA:
                held = self._swa.get(event.address)
                if held is None:
                    if not event.held:
                        continue
                    held = self._swa[event.address] = [0, 0, 0]
                held[_MEDIUM_INDEX[event.medium]] = event.held
                if not any(held):
                    del self._swa[event.address]

    def reusable_tokens(self, addresses: Sequence[bytes], media: Sequence[Medium] = MEDIA) -> int:
        """The longest window-safe prefix of the pages at ``addresses`` whose
        KV is on ``media``: the walk of ``RadixCache.match`` over the events."""
        ps = self.geometry.page_size
        mask = sum(_MEDIUM_BIT[m] for m in media)
        picks = [_MEDIUM_INDEX[m] for m in media]
        covered = best = 0
        for i, address in enumerate(addresses):
            if not self._full.get(address, 0) & mask:
                break
            swa = self._swa.get(address)
            held = max(swa[j] for j in picks) if swa is not None else 0
            covered = held + covered if held == ps else held
            end = (i + 1) * ps
            if covered >= end - self.geometry.window_start(end):
                best = i + 1
        return best * ps


@dataclass
class WorkerState:
    worker_id: str
    index: PrefixIndex
    order: int  # registration order: the last tie-break
    outstanding: dict[Hashable, int] = field(default_factory=dict)  # request -> tokens to compute, until prefilled
    outstanding_tokens: int = 0
    reported_queue_tokens: int = 0
    running: int = 0
    routed: int = 0
    computed_tokens: int = 0  # prompt tokens routed here and not expected cached
    expected_cached_tokens: int = 0
    work_base: float = 0.0  # a worker that joins late starts level with the others
    role: str = "both"  # "prefill" | "decode" | "both"
    decoding: int = 0  # disaggregated requests sent here to decode, not finished yet

    @property
    def queued_tokens(self) -> int:
        return max(self.outstanding_tokens, self.reported_queue_tokens)

    @property
    def work(self) -> float:
        """Tokens routed here to compute, done or queued: this router's own
        count (a worker's report of its queue moves with when it last
        estimated its waiting requests' cache hits; shares need no report)."""
        return self.work_base + self.computed_tokens


@dataclass(frozen=True)
class RouteDecision:
    worker_id: str
    cached_tokens: int  # window-safe tokens the chosen worker is expected to reuse
    best_cached_tokens: int  # the most any worker could have reused
    # "affinity" (it reuses the most any worker could), "load" (a worker that
    # had more was too busy), "balance" (one that had more was over the load
    # bound), "miss" (nobody had any: the least loaded), "round-robin", "least-load"
    reason: str


DEFAULT_LOAD_WEIGHT = 0.2
DEFAULT_MAX_LOAD_RATIO = 1.25


class Router:
    def __init__(self, policy: str = "kv-affinity", load_weight: float = DEFAULT_LOAD_WEIGHT,
                 max_load_ratio: float = DEFAULT_MAX_LOAD_RATIO) -> None:
        """kv-affinity's trade-offs.

        ``load_weight``: tokens of queue one token of reuse is worth. At 1 a
        request goes where its own prefill would end first; but leaving its
        cache makes the other worker compute the prefix again, and in a queue
        busy rho of the time each token of added work delays the requests
        behind it by rho / (1 - rho) tokens in all (M/M/1), so a token of
        reuse is worth 1 / (1 - rho) tokens of queue: 0.2 is 1 - rho at
        rho = 0.8.

        ``max_load_ratio``: the load bound's c (> 1): a worker takes requests
        while its work is at most c x the mean plus one average request.
        1.25 is the paper's example; its guarantees hold for any c > 1."""
        if policy not in ROUTE_POLICIES:
            raise ValueError(f"unknown route policy {policy!r}; choose from {', '.join(ROUTE_POLICIES)}")
        if load_weight < 0:
            raise ValueError(f"load_weight must be >= 0, got {load_weight}")
        if max_load_ratio <= 1:
            raise ValueError(f"max_load_ratio must be > 1, got {max_load_ratio}")
        self.policy = policy
        self.load_weight = load_weight
        self.max_load_ratio = max_load_ratio
        self._workers: dict[str, WorkerState] = {}
        self._order = itertools.count()
        self._round_robin = 0
        self._routed_to: dict[Hashable, str] = {}
        self._decoding_on: dict[Hashable, str] = {}
        self.decisions: dict[tuple[str, str], int] = {}  # (worker, reason) -> requests

    # ------------------------------------------------------------ workers
    @property
    def workers(self) -> list[str]:
        return list(self._workers)

    def add_worker(self, worker_id: str, geometry: CacheGeometry, role: str = "both") -> None:
        """A worker starts taking requests, with an empty index (a worker that
        registers again -- restarted -- starts from nothing too). Its work
        starts at the others' mean: a newcomer is not sent everything until
        it has caught up with workers that ran for hours. ``role``: with
        decode workers present, prompts go to the others ("prefill" and
        "both"), and a prefill worker's requests are decoded on a decode worker."""
        if role not in ("prefill", "decode", "both"):
            raise ValueError(f"unknown worker role {role!r}")
        others = [s.work for wid, s in self._workers.items() if wid != worker_id]
        state = WorkerState(worker_id, PrefixIndex(geometry), next(self._order), role=role)
        state.work_base = sum(others) / len(others) if others else 0.0
        self._workers[worker_id] = state

    def remove_worker(self, worker_id: str) -> list[Hashable]:
        """The worker is gone; the requests it had that were still routed to it."""
        state = self._workers.pop(worker_id, None)
        lost = [rid for rid, wid in self._routed_to.items() if wid == worker_id]
        for rid in lost:
            del self._routed_to[rid]
        return lost if state is not None else []

    def state(self, worker_id: str) -> WorkerState:
        return self._workers[worker_id]

    def apply_events(self, worker_id: str, batch: EventBatch) -> bool:
        """False: events were missed; ask the worker for a snapshot."""
        state = self._workers.get(worker_id)
        return True if state is None else state.index.apply(batch)

    def report_load(self, worker_id: str, queued_tokens: int, running: int) -> None:
        state = self._workers.get(worker_id)
        if state is not None:
            state.reported_queue_tokens, state.running = queued_tokens, running

    # ------------------------------------------------------------ routing
    def cached_tokens(self, tokens: Sequence[int], states: Sequence[WorkerState] | None = None) -> dict[str, int]:
        """Window-safe tokens of ``tokens`` (cache tokens) each worker (of ``states``) can reuse."""
        out: dict[str, int] = {}
        addresses: dict[tuple[bytes, int], list[bytes]] = {}
        for state in self._workers.values() if states is None else states:
            geometry = state.index.geometry
            key = (geometry.fingerprint, geometry.page_size)
            if key not in addresses:
                addresses[key] = token_page_addresses(geometry, tokens, geometry.max_pages(len(tokens)))
            out[state.worker_id] = state.index.reusable_tokens(addresses[key])
        return out

    def route(self, request_id: Hashable, tokens: Sequence[int]) -> RouteDecision:
        """Pick the worker for a request whose prefix-cache view is ``tokens``,
        and count it in that worker's load until ``prefill_done``."""
        if not self._workers:
            raise NoWorkers("no worker is available")
        states = self._prefill_candidates()
        cached = self.cached_tokens(tokens, states) if self.policy == "kv-affinity" or len(states) > 1 else {}
        if self.policy == "round-robin":
            state = states[self._round_robin % len(states)]
            self._round_robin += 1
            reason = "round-robin"
        elif self.policy == "least-load":
            state = min(states, key=self._load_key)
            reason = "least-load"
        else:
            state, reason = self._affinity(states, cached, len(tokens))
        hit = cached.get(state.worker_id, 0)
        self._account(state, request_id, len(tokens) - hit, hit)
        self.decisions[(state.worker_id, reason)] = self.decisions.get((state.worker_id, reason), 0) + 1
        return RouteDecision(state.worker_id, hit, max(cached.values(), default=0), reason)

    def _prefill_candidates(self) -> list[WorkerState]:
        """Where prompts go: every worker but the decode-only ones (all of
        them if only decode workers are left: any worker can prefill)."""
        states = [s for s in self._workers.values() if s.role != "decode"]
        return states or list(self._workers.values())

    def pick_decode(self, request_id: Hashable, prefill_worker: str) -> str | None:
        """The decode worker for a request prefilled on ``prefill_worker``
        (counted there until ``decode_done``), or None: it decodes where it
        is prefilled (that worker does both, or no decode worker is up)."""
        state = self._workers.get(prefill_worker)
        decoders = [s for s in self._workers.values() if s.role == "decode"]
        if state is None or state.role != "prefill" or not decoders:
            return None
        chosen = min(decoders, key=lambda s: (s.running + s.decoding, s.order))
        chosen.decoding += 1
        self._decoding_on[request_id] = chosen.worker_id
        return chosen.worker_id

    def decode_done(self, request_id: Hashable) -> None:
        state = self._workers.get(self._decoding_on.pop(request_id, ""))
        if state is not None:
            state.decoding -= 1

    def _affinity(self, states: list[WorkerState], cached: dict[str, int], tokens: int) -> tuple[WorkerState, str]:
        """kv-affinity: the best score among the workers under the load bound."""
        under = self._under_bound(states, tokens)
        reusable = max((cached[s.worker_id] for s in under), default=0)
        if reusable == 0:
            state = min(under, key=self._load_key)
        else:
            state = max(under, key=lambda s: (cached[s.worker_id] - self.load_weight * s.queued_tokens,
                                              *(-k for k in self._load_key(s))))
        hit, best = cached[state.worker_id], max(cached.values(), default=0)
        if best == 0:
            return state, "miss"
        if hit == best:
            return state, "affinity"
        return state, "balance" if reusable < best else "load"

    def _under_bound(self, states: list[WorkerState], tokens: int) -> list[WorkerState]:
        """The workers whose work is within the bound (all, if none is). Work
        comes in requests, not tokens: the bound has one average request of
        slack (this one counted whole), or no worker could take the first."""
        total = sum(s.work for s in states)
        request = (total + tokens) / (sum(s.routed for s in states) + 1)
        bound = self.max_load_ratio * total / len(states) + request
        return [s for s in states if s.work <= bound] or states

    @staticmethod
    def _load_key(state: WorkerState) -> tuple[float, ...]:
        """Least loaded first: tokens queued, requests running, work sent so far, then order."""
        return (state.queued_tokens, state.running, state.work, state.order)

    def _account(self, state: WorkerState, request_id: Hashable, to_compute: int, hit: int) -> None:
        self.prefill_done(request_id)  # a request routed again (a retry) counts once
        state.outstanding[request_id] = to_compute
        state.outstanding_tokens += to_compute
        state.routed += 1
        state.computed_tokens += to_compute
        state.expected_cached_tokens += hit
        self._routed_to[request_id] = state.worker_id

    def prefill_done(self, request_id: Hashable) -> None:
        """The request's prompt is computed (its first token is out) or it ended:
        it no longer counts in its worker's queue."""
        worker_id = self._routed_to.pop(request_id, None)
        state = self._workers.get(worker_id) if worker_id is not None else None
        if state is not None:
            state.outstanding_tokens -= state.outstanding.pop(request_id, 0)

    def loads(self) -> dict[str, dict[str, int]]:
        return {s.worker_id: {"role": s.role, "decoding": s.decoding,  # type: ignore[dict-item]
                              "queued_tokens": s.queued_tokens, "running": s.running, "routed": s.routed,
                              "routed_uncached_tokens": s.computed_tokens, "work_tokens": round(s.work),
                              "routed_cached_tokens": s.expected_cached_tokens, "indexed_pages": len(s.index)}
                for s in self._workers.values()}
