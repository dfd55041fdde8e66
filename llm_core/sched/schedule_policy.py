"""Which waiting request the scheduler admits first, and which running one it
preempts: the policy, apart from the mechanism (``scheduler.py``: admission
on both pools, chunking, budgets, preemption, cache locks).

* ``fcfs``: arrival order; a request that does not fit stops admission
  (head-of-line blocking, the classic behaviour), the newest running request
  is preempted first; one budget for all lengths.
* ``compute-aware``: fewest tokens left to compute first (its prompt minus
  what the prefix cache and its tiers hold, from a side-effect-free
  ``peek``), minus an aging credit of ``aging_tokens_per_s`` per second
  waited. A request that does not fit is skipped, not waited on. Once it has
  waited ``starvation_s`` it goes before every request that has not (oldest
  first), and if it does not fit nothing is admitted past it until it does
  (a reservation). So no request waits longer than ``starvation_s`` plus the
  time to serve the starved requests ahead of it and for running requests
  to free what it needs.
* ``lpm``: longest cached prefix first (SGLang's default), with the same
  skipping, starvation bound and reservation; one budget for all lengths.

Length buckets (``LengthBuckets``) group requests by prompt length (default
edges 64K / 256K tokens under a 1M context, scaled by the model's context
length). Under ``compute-aware`` each step's prefill budget is shared between
the buckets that have work, in proportion to the requests each holds (what
one cannot use goes to the others), so long prefills keep moving in chunks
while short requests are not queued behind them. Every policy's queue wait
and TTFT are reported per bucket.

Pure logic: no torch, no pools.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass
from typing import Protocol

__all__ = ["POLICIES", "ComputeAware", "Fcfs", "LengthBuckets", "LongestPrefixMatch", "SchedulePolicy", "Waiting",
           "make_policy"]


@dataclass(frozen=True)
class Waiting:
    """A waiting request as a policy sees it."""

    request_id: int
    arrival: float  # seconds, the scheduler's clock
    waited_s: float
    tokens_left: int  # to compute before its next token, after its cached prefix
    cached: int  # tokens of its prefix the cache (any tier) holds


@dataclass(frozen=True)
class Running:
    request_id: int
    arrival: float
    tokens_left: int  # still to compute before its next token (1 while decoding)


class SchedulePolicy(Protocol):
    name: str
    needs_cached_lengths: bool  # whether ``order`` reads ``Waiting.cached``/``tokens_left`` from the cache
    shares_budget_by_length: bool  # whether each step's prefill budget is shared between length buckets

    def order(self, waiting: Seq[Waiting]) -> list[int]:
        """Request ids in the order admission tries them."""
        ...

    def reserves(self, request: Waiting) -> bool:
        """Whether a request that does not fit stops admission (nothing passes it)."""
        ...

    def victim(self, running: Seq[Running]) -> int:
        """The request id to preempt when memory runs out."""
        ...


def _newest(running: Seq[Running]) -> int:
    return max(running, key=lambda r: (r.arrival, r.request_id)).request_id


@dataclass(frozen=True)
class Fcfs:
    name: str = "fcfs"
    needs_cached_lengths: bool = False
    shares_budget_by_length: bool = False

    def order(self, waiting: Seq[Waiting]) -> list[int]:
        return [w.request_id for w in sorted(waiting, key=lambda w: (w.arrival, w.request_id))]

    def reserves(self, request: Waiting) -> bool:
        return True

    def victim(self, running: Seq[Running]) -> int:
        return _newest(running)


@dataclass(frozen=True)
class ComputeAware:
    """Priority key = tokens left to compute - ``aging_tokens_per_s`` x seconds waited."""

    aging_tokens_per_s: float = 2048.0
    starvation_s: float = 30.0
    name: str = "compute-aware"
    needs_cached_lengths: bool = True
    shares_budget_by_length: bool = True

    def __post_init__(self) -> None:
        if self.aging_tokens_per_s < 0 or self.starvation_s <= 0:
            raise ValueError(f"bad compute-aware parameters: {self}")

    def key(self, w: Waiting) -> float:
        return w.tokens_left - self.aging_tokens_per_s * w.waited_s

    def order(self, waiting: Seq[Waiting]) -> list[int]:
        return _starved_first(waiting, self.starvation_s, self.key)

    def reserves(self, request: Waiting) -> bool:
        return request.waited_s >= self.starvation_s

    def victim(self, running: Seq[Running]) -> int:
        # The most work still ahead (a long prefill), newest first among equals:
        # its computed prefix stays cached, so little is lost.
        return max(running, key=lambda r: (r.tokens_left, r.arrival, r.request_id)).request_id


@dataclass(frozen=True)
class LongestPrefixMatch:
    starvation_s: float = 30.0
    name: str = "lpm"
    needs_cached_lengths: bool = True
    shares_budget_by_length: bool = False

    def order(self, waiting: Seq[Waiting]) -> list[int]:
        return _starved_first(waiting, self.starvation_s, lambda w: -w.cached)

    def reserves(self, request: Waiting) -> bool:
        return request.waited_s >= self.starvation_s

    def victim(self, running: Seq[Running]) -> int:
        return _newest(running)


def _starved_first(waiting: Seq[Waiting], starvation_s: float, key: Callable[[Waiting], float]) -> list[int]:
    """Requests that have waited ``starvation_s`` first, oldest first; then
    the rest by ``key``. Without this a long request passed over by a stream
    of cheaper ones would wait until its aging credit alone lifted it."""
    return [w.request_id for w in sorted(waiting, key=lambda w: (0, w.arrival, w.request_id)
                                         if w.waited_s >= starvation_s else (1, key(w), w.arrival, w.request_id))]


POLICIES = ("compute-aware", "fcfs", "lpm")


def make_policy(name: str) -> SchedulePolicy:
    if name == "fcfs":
        return Fcfs()
    if name == "compute-aware":
        return ComputeAware()
    if name == "lpm":
        return LongestPrefixMatch()
    raise ValueError(f"unknown schedule policy {name!r}; choose from {', '.join(POLICIES)}")


@dataclass(frozen=True)
class LengthBuckets:
    """Prompt-length buckets: ``edges`` (ascending) split lengths into
    ``len(edges) + 1`` buckets, [0, e0), [e0, e1), ..., [e_last, inf)."""

    edges: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if any(e < 1 for e in self.edges) or list(self.edges) != sorted(set(self.edges)):
            raise ValueError(f"bucket edges must be positive and ascending, got {self.edges}")

    @classmethod
    def for_context(cls, context_tokens: int) -> LengthBuckets:
        """The default edges, 64K and 256K of a 1M context, scaled to
        ``context_tokens`` (the top bucket ends at the context length)."""
        edges = tuple(sorted({max(1, context_tokens // 16), max(2, context_tokens // 4)}))
        return cls(edges)

    def __len__(self) -> int:
        return len(self.edges) + 1

    def of(self, prompt_tokens: int) -> int:
        return bisect.bisect_right(self.edges, prompt_tokens)

    @property
    def labels(self) -> list[str]:
        """Each bucket's range, e.g. ``"0-64K"``, ``"64K-256K"``, ``"256K+"``."""
        bounds = [0, *self.edges]
        return [f"{_short(lo)}-{_short(hi)}" for lo, hi in zip(bounds, self.edges)] + [f"{_short(bounds[-1])}+"]

    def shares(self, demand: Seq[int], budget: int, weights: Seq[float] | None = None) -> list[int]:
        """The budget split between buckets by weighted water-filling: each
        bucket with work gets a share in proportion to its weight (equal
        without ``weights``), and what a bucket needs less than its share goes
        to the others. ``demand[b]``: tokens bucket ``b`` could use."""
        caps = [0] * len(demand)
        weight = [(weights[b] if weights is not None else 1.0) if d > 0 else 0.0 for b, d in enumerate(demand)]
        active = sorted((b for b, d in enumerate(demand) if d > 0), key=lambda b: demand[b] / weight[b])
        left, total = budget, sum(weight)
        for b in active:
            caps[b] = min(demand[b], int(left * weight[b] / total))
            left -= caps[b]
            total -= weight[b]
        return caps


def _short(n: int) -> str:
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)
