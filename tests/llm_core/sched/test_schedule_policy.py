"""Schedule policies: their order, the aging bound, no head-of-line blocking,
preemption victims; outputs identical whatever the order of service."""

from __future__ import annotations

from pathlib import Path

import pytest

from llm_core import LLM, SamplingParams
from llm_core.kv.kv_pool import FullKVPool, KVAllocator, SWAKVPool
from llm_core.kv.prefix_cache import RadixCache
from llm_core.sched.schedule_policy import (
    ComputeAware,
    Fcfs,
    LengthBuckets,
    LongestPrefixMatch,
    Running,
    Waiting,
    make_policy,
)
from llm_core.sched.scheduler import Scheduler, SchedulerConfig, Sequence


def _w(rid: int, arrival: float, waited: float, left: int, cached: int = 0) -> Waiting:
    return Waiting(rid, arrival, waited, left, cached)


def test_each_policy_orders_as_documented() -> None:
    waiting = [_w(1, 0.0, 10.0, 5000, 0), _w(2, 5.0, 5.0, 300, 4000), _w(3, 9.0, 1.0, 40, 100)]
    assert Fcfs().order(waiting) == [1, 2, 3]
    assert LongestPrefixMatch().order(waiting) == [2, 3, 1]
    assert ComputeAware(aging_tokens_per_s=0.0).order(waiting) == [3, 2, 1]
    # Aging: 10 s waited at 1000 tokens/s outweighs 5000 tokens left.
    assert ComputeAware(aging_tokens_per_s=1000.0).order(waiting)[0] == 1
    running = [Running(1, 0.0, 1), Running(2, 3.0, 900), Running(3, 5.0, 1)]
    assert Fcfs().victim(running) == 3  # the newest
    assert ComputeAware().victim(running) == 2  # the most work still ahead
    with pytest.raises(ValueError, match="unknown schedule policy"):
        make_policy("sjf")


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _scheduler(policy: str, full_tokens: int = 256, max_running: int = 8, clock: _Clock | None = None) -> Scheduler:
    allocator = KVAllocator(FullKVPool(full_tokens // 4, 4), SWAKVPool(4096, 1), 9)
    return Scheduler(allocator, SchedulerConfig(max_running, 4096, 4096, policy), RadixCache(allocator),
                     clock=clock or _Clock())


def _seq(rid: int, n: int, scheduler: Scheduler) -> Sequence:
    return Sequence(rid, [1000 + rid * 7919 % 997 + i for i in range(n)], 1, scheduler.allocator.new_view())


@pytest.mark.parametrize("policy", ["compute-aware", "lpm"])
def test_a_request_that_does_not_fit_is_skipped_not_waited_on(policy: str) -> None:
    scheduler = _scheduler(policy)
    holder = _seq(0, 150, scheduler)
    scheduler.add(holder)
    scheduler.advance(scheduler.schedule())  # 150 of 256 tokens held by a running request ...
    holder.output.append(7)  # ... now decoding
    big, small = _seq(1, 200, scheduler), _seq(2, 20, scheduler)
    scheduler.add(big)
    scheduler.add(small)
    chunks = scheduler.schedule()
    assert [c.seq.request_id for c in chunks] == [0, 2]
    assert big.cache_lock is None  # it holds nothing while it waits
    fcfs = _scheduler("fcfs")
    other = _seq(0, 150, fcfs)
    fcfs.add(other)
    fcfs.advance(fcfs.schedule())
    other.output.append(7)
    fcfs.add(_seq(1, 200, fcfs))
    fcfs.add(_seq(2, 20, fcfs))
    # Head-of-line blocking: the small one waits behind the big one.
    assert [c.seq.request_id for c in fcfs.schedule()] == [0]


@pytest.mark.parametrize("policy", ["fcfs", "compute-aware"])
def test_a_preempted_request_is_served_again_before_later_arrivals(policy: str) -> None:
    clock = _Clock()
    scheduler = _scheduler(policy, clock=clock)
    first = _seq(0, 150, scheduler)
    scheduler.add(first)
    scheduler.advance(scheduler.schedule())
    clock.now = 1.0
    later = _seq(1, 150, scheduler)
    scheduler.add(later)  # does not fit beside the first
    scheduler.preempt(first)
    assert first not in scheduler.running and first in scheduler.waiting and len(scheduler.waiting) == 2
    # Under either policy the first goes again (earlier, and its prefix is cached), the later one waits.
    assert [c.seq.request_id for c in scheduler.schedule()] == [0]
    assert first in scheduler.running and later in scheduler.waiting
    scheduler.finish(later, "abort")
    assert later not in scheduler.waiting and len(scheduler.waiting) == 0


def test_a_long_request_waits_at_most_the_aging_bound_under_a_stream_of_short_ones() -> None:
    clock = _Clock()
    scheduler = _scheduler("compute-aware", full_tokens=4096, max_running=1, clock=clock)
    policy = scheduler.policy
    assert isinstance(policy, ComputeAware)
    long_tokens, short_tokens = 2000, 10
    scheduler.add(_seq(0, long_tokens, scheduler))
    admitted_at = None
    for step in range(1, 200):
        clock.now = float(step)
        scheduler.add(_seq(step, short_tokens, scheduler))  # a new short request every second
        for chunk in scheduler.schedule():
            scheduler.advance([chunk])
            if chunk.seq.request_id == 0:
                admitted_at = clock.now
            scheduler.finish(chunk.seq, "length")
        if admitted_at is not None:
            break
    # The key of the long request falls below a fresh short one's after (long - short) / rate seconds.
    bound = (long_tokens - short_tokens) / policy.aging_tokens_per_s + 1
    assert admitted_at is not None and admitted_at <= bound


def test_a_starved_request_goes_first_whatever_its_key() -> None:
    # Without aging credit, a long request would wait behind cheaper ones forever;
    # once it has waited the starvation bound it goes first, oldest first.
    fresh = [_w(10 + i, 100.0 + i, 0.5, 10, cached=5) for i in range(3)]
    starved = [_w(2, 50.0, 51.0, 90_000), _w(1, 40.0, 61.0, 200_000)]
    for policy in (ComputeAware(aging_tokens_per_s=0.0, starvation_s=30.0), LongestPrefixMatch(starvation_s=30.0)):
        assert policy.order(fresh + starved)[:2] == [1, 2]
        assert policy.order(fresh + [_w(3, 90.0, 20.0, 90_000)])[-1] == 3  # not yet starved: by key


def test_a_starved_request_gets_a_reservation() -> None:
    clock = _Clock()
    scheduler = _scheduler("compute-aware", clock=clock)
    holder = _seq(0, 150, scheduler)
    scheduler.add(holder)
    scheduler.advance(scheduler.schedule())
    holder.output.append(7)
    big = _seq(1, 200, scheduler)
    scheduler.add(big)
    clock.now = ComputeAware().starvation_s + 1  # it has waited past the bound
    scheduler.add(_seq(2, 20, scheduler))
    assert [c.seq.request_id for c in scheduler.schedule()] == [0]  # nothing passes it now
    scheduler.finish(holder, "length")
    assert [c.seq.request_id for c in scheduler.schedule()] == [1, 2]  # it first, then what still fits


@pytest.mark.parametrize("policy", ["fcfs", "compute-aware", "lpm"])
def test_outputs_do_not_depend_on_the_policy(tiny_checkpoint: Path, policy: str) -> None:
    shared = list(range(20, 52))
    prompts = [shared + list(range(60 + i, 64 + 3 * i)) for i in range(5)] + [list(range(5, 45))]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    expected = [o.token_ids for o in LLM(tiny_checkpoint, enable_prefix_caching=False).generate(prompts, params)]
    llm = LLM(tiny_checkpoint, kv_budget_bytes=512 << 10, page_size=4, chunked_prefill_size=8, max_running_requests=4,
              schedule_policy=policy, schedule_bucket_edges=(40,))
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert llm.stats()["preemptions"] > 0
    # Prompts of 36-44 tokens: both buckets served, every request's queue wait and TTFT counted once.
    buckets = llm.stats()["schedule"]["buckets"]
    assert list(buckets) == ["0-40", "40+"]
    assert [b["ttft"]["count"] for b in buckets.values()] == [2, 4]
    assert sum(b["queue_wait"]["count"] for b in buckets.values()) == 6


def test_length_buckets_scale_with_the_context_and_share_the_budget_by_water_filling() -> None:
    assert LengthBuckets.for_context(1 << 20).edges == (1 << 16, 1 << 18)
    assert LengthBuckets.for_context(1 << 20).labels == ["0-64K", "64K-256K", "256K+"]
    assert LengthBuckets.for_context(32768).edges == (2048, 8192)
    buckets = LengthBuckets((100, 1000))
    assert [buckets.of(n) for n in (0, 99, 100, 999, 1000, 10**6)] == [0, 0, 1, 1, 2, 2]
    assert buckets.shares([0, 0, 0], 64) == [0, 0, 0]
    assert buckets.shares([500, 0, 900], 64) == [32, 0, 32]  # idle buckets take nothing
    assert buckets.shares([20, 500, 900], 64) == [20, 22, 22]  # what one needs less goes to the others
    with pytest.raises(ValueError, match="ascending"):
        LengthBuckets((10, 5))


def _bucketed(policy: str, edges: tuple[int, ...] = (100,)) -> Scheduler:
    allocator = KVAllocator(FullKVPool(4096, 4), SWAKVPool(4096, 1), 9)
    return Scheduler(allocator, SchedulerConfig(16, 64, 64, policy, edges), RadixCache(allocator), clock=_Clock())


def _step(scheduler: Scheduler) -> list:
    """One step (a millisecond: aging plays no part) as the engine runs it:
    commit, sample, then after_step."""
    scheduler.clock.now += 0.001  # type: ignore[attr-defined]
    chunks = scheduler.schedule()
    assert sum(c.length for c in chunks) <= 64
    for c in chunks:
        sampled = c.samples
        scheduler.commit(c)
        if sampled:
            c.seq.output.append(5)
    scheduler.after_step(chunks)
    return chunks


@pytest.mark.parametrize("policy", ["fcfs", "compute-aware"])
def test_short_requests_are_not_queued_behind_a_long_prefill(policy: str) -> None:
    scheduler = _bucketed(policy)
    long = _seq(0, 1000, scheduler)
    scheduler.add(long)
    _step(scheduler)  # the long prefill is running, a chunk a step
    short = _seq(1, 20, scheduler)
    scheduler.add(short)
    steps = 0
    while not short.answered:
        _step(scheduler)
        steps += 1
    if policy == "compute-aware":  # served in the step it arrives; the long one still moves
        assert steps == 1 and long.num_computed == 64 + 44
    else:  # FCFS, one budget: it waits for the long prefill to end
        assert steps > 10
    # The short one's bucket counted its TTFT (and under FCFS the long one's, which came first).
    first = scheduler.latency_stats()["buckets"]["0-100"]  # type: ignore[index]
    assert first["ttft"]["count"] == 1 and first["queue_wait"]["count"] == 1


def test_a_long_prefill_keeps_moving_under_a_burst_of_short_requests() -> None:
    scheduler = _bucketed("compute-aware")
    long = _seq(0, 1000, scheduler)
    scheduler.add(long)
    _step(scheduler)
    shorts = [_seq(1 + i, 20, scheduler) for i in range(10)]
    for seq in shorts:
        scheduler.add(seq)
    before = long.num_computed
    chunks = _step(scheduler)
    # Its bucket's share (1 request of 11) plus what the short ones' bucket cannot use.
    assert long.num_computed - before >= 64 // 11
    assert sum(c.length for c in chunks if c.seq is not long) >= 40
    without = _bucketed("compute-aware", ())
    other = _seq(0, 1000, without)
    without.add(other)
    _step(without)
    for i in range(10):
        without.add(_seq(1 + i, 20, without))
    before = other.num_computed
    _step(without)
    assert other.num_computed == before  # one budget: the short ones take it all
