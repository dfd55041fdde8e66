"""The scheduler's mechanism, whatever the policy: a step's token budget,
decodes before prefills, chunked prefill, the admission cap, preemption when
memory runs out, and a request too large for the pools failing alone."""

from __future__ import annotations

import pytest

from llm_core.kv.kv_pool import FullKVPool, KVAllocator, SWAKVPool
from llm_core.sched.scheduler import RequestTooLarge, ScheduledChunk, Scheduler, SchedulerConfig, Sequence


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 0.001
        return self.now


def _scheduler(*, pages: int = 256, budget: int = 64, chunk: int = 32, running: int = 8,
               policy: str = "fcfs", prefill_batch: int | None = None) -> Scheduler:
    allocator = KVAllocator(FullKVPool(pages, 4), SWAKVPool(4096, 1), 9)
    config = SchedulerConfig(running, budget, chunk, policy, prefill_batch_tokens=prefill_batch)
    return Scheduler(allocator, config, clock=_Clock())


def _request(scheduler: Scheduler, rid: int, prompt: int, max_tokens: int = 4) -> Sequence:
    seq = Sequence(rid, [10 + (rid * 31 + i) % 900 for i in range(prompt)], max_tokens,
                   scheduler.allocator.new_view())
    scheduler.add(seq)
    return seq


def _step(scheduler: Scheduler) -> list[ScheduledChunk]:
    """One engine step without a model: every chunk computed, a token sampled
    where a chunk ends the known tokens, finished requests ended."""
    chunks = scheduler.schedule()
    scheduler.advance(chunks)
    for chunk in chunks:
        seq = chunk.seq
        if chunk.samples:
            seq.output.append(7)
            if len(seq.output) >= seq.max_tokens:
                scheduler.finish(seq, "length")
    return chunks


def test_decodes_go_first_and_the_step_stays_within_its_budget() -> None:
    scheduler = _scheduler(budget=20, chunk=64)
    early = [_request(scheduler, i, 6, max_tokens=50) for i in range(3)]
    _step(scheduler)  # the three prompts, 18 tokens
    late = _request(scheduler, 3, 40)
    chunks = _step(scheduler)
    assert [c.seq for c in chunks[:3]] == early and all(c.length == 1 for c in chunks[:3])
    assert chunks[3].seq is late and chunks[3].length == 20 - 3  # what the decodes left
    assert sum(c.rows for c in chunks) == 20


def test_a_long_prompt_is_prefilled_a_chunk_at_a_time() -> None:
    scheduler = _scheduler(budget=64, chunk=16)
    seq = _request(scheduler, 0, 50, max_tokens=2)
    starts = []
    while not seq.output:
        (chunk,) = _step(scheduler)
        starts.append((chunk.start, chunk.length))
    assert starts == [(0, 16), (16, 16), (32, 16), (48, 2)]
    assert seq.num_computed == 50


def test_a_full_enough_prefill_admits_nothing_more_in_its_step() -> None:
    # Shortest first (compute-aware): prompts join the step until its prefill
    # holds 20 tokens; the rest wait for the next steps, beside the decodes.
    scheduler = _scheduler(budget=256, chunk=64, policy="compute-aware", prefill_batch=20)
    seqs = {n: _request(scheduler, i, n, max_tokens=8) for i, n in enumerate((30, 4, 12, 9))}
    admitted = []
    for _ in range(4):
        chunks = _step(scheduler)
        admitted.append([c.length for c in chunks if c.start == 0])
        assert all(c.length == 1 for c in chunks if c.start > 0)  # the earlier ones decode meanwhile
    assert admitted == [[4, 9, 12], [30], [], []]
    assert all(s.is_running for s in seqs.values())


def test_a_long_prompt_goes_whole_and_its_chunks_go_on_past_the_batch_limit() -> None:
    scheduler = _scheduler(budget=64, chunk=24, prefill_batch=8)
    long, short = _request(scheduler, 0, 40, max_tokens=2), _request(scheduler, 1, 3, max_tokens=2)
    assert [(c.seq, c.length) for c in _step(scheduler)] == [(long, 24)]  # over the limit alone
    assert [(c.seq, c.length) for c in _step(scheduler)] == [(long, 16)]  # its next chunk still goes
    assert [(c.seq, c.length) for c in _step(scheduler)] == [(long, 1), (short, 3)]


def test_no_more_requests_run_than_the_cap() -> None:
    scheduler = _scheduler(running=2)
    seqs = [_request(scheduler, i, 4, max_tokens=3) for i in range(5)]
    _step(scheduler)
    assert [s.is_running for s in seqs] == [True, True, False, False, False]
    while scheduler.has_unfinished():
        _step(scheduler)
        assert len(scheduler.running) <= 2
    assert all(s.finish_reason == "length" for s in seqs)


def test_memory_running_out_preempts_and_every_request_still_finishes() -> None:
    scheduler = _scheduler(pages=12, budget=64, chunk=64)  # 48 full-pool tokens
    seqs = [_request(scheduler, i, 16, max_tokens=12) for i in range(3)]
    for _ in range(200):
        if not scheduler.has_unfinished():
            break
        _step(scheduler)
    assert not scheduler.has_unfinished()
    assert scheduler.num_preemptions > 0
    assert all(s.finish_reason == "length" and len(s.output) == 12 for s in seqs)
    allocator = scheduler.allocator  # nothing leaked (no prefix cache here to keep pages)
    assert allocator.full.free_slots == allocator.full.capacity and allocator.swa.free_slots == allocator.swa.capacity


def test_a_request_larger_than_the_pools_fails_alone() -> None:
    scheduler = _scheduler(pages=4)  # 16 tokens
    with pytest.raises(RequestTooLarge, match="request 0 needs more KV memory"):
        _request(scheduler, 0, 40)
        _step(scheduler)


def test_limits_are_checked_when_the_config_is_made() -> None:
    with pytest.raises(ValueError, match="must be positive"):
        SchedulerConfig(max_running_requests=0)
    with pytest.raises(ValueError, match="unknown schedule policy"):
        SchedulerConfig(policy="sjf")
    with pytest.raises(ValueError, match="prefill_batch_tokens must be positive"):
        SchedulerConfig(prefill_batch_tokens=0)
