"""Schedule policies on trace replay: the engine's scheduler, pools and prefix
cache serve a trace with its arrival times, and a cost model
(``bench/replay_cost.py``) says how long each step takes, so TTFT is
measured on a virtual clock. The same replay runs N such workers on one
clock behind a dispatcher (``replay_workers``: the router bench,
``bench/router.py``). The load a trace offers a replay, and the time scale
that sets it, are ``bench/replay_load.py``'s.

Pure logic: no model runs in a replay.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Protocol

from bench.prefix_cache import MIMO_WINDOW, TokenFactory, TraceRequest, trace_page_size
from bench.replay_cost import CostModel, step_shape
from llm_core.kv.kv_events import KVEventLog
from llm_core.kv.kv_pool import FullKVPool, KVAllocator, SWAKVPool
from llm_core.kv.prefix_cache import RadixCache
from llm_core.sched.schedule_policy import LengthBuckets
from llm_core.sched.scheduler import RequestTooLarge, ScheduledChunk, Scheduler, SchedulerConfig, Sequence

__all__ = ["Dispatch", "ReplayConfig", "ReplayResult", "ReplayWorker", "RequestTimes", "VirtualClock", "WorkerStats",
           "replay", "replay_workers", "summarize"]


@dataclass(frozen=True)
class ReplayConfig:
    policy: str = "compute-aware"
    full_tokens: int = 4_000_000
    swa_fraction: float = 0.05
    window: int = MIMO_WINDOW
    checkpoint_interval: int | None = 4096
    # SGLang's default step budget on an H200 (8K): at 16K a step that carries
    # a full prefill chunk lasts about 0.33 s, and so does every decode in it.
    max_num_batched_tokens: int = 8192
    chunked_prefill_size: int = 8192
    max_running_requests: int = 256
    bucket_edges: tuple[int, ...] = LengthBuckets.for_context(1 << 20).edges  # MiMo-V2.5-Pro's 1M context
    # A session's request is sent only once its previous one is answered (an
    # agent waits for its answer); False: every request at its trace time.
    closed_sessions: bool = True


@dataclass
class RequestTimes:
    arrival: float
    prompt_tokens: int
    output_tokens: int
    bucket: int
    first_token: float | None = None
    finished: float | None = None
    failed: bool = False
    worker: int = 0  # the worker that served it
    cached_tokens: int = 0  # of its prompt, served by the worker's prefix cache


@dataclass
class WorkerStats:
    """What one worker did in a replay."""

    steps: int = 0
    busy_s: float = 0.0
    prefill_tokens: int = 0  # prompt rows computed (a preempted request's recompute counts again)
    decode_tokens: int = 0
    preemptions: int = 0
    cached_prompt_tokens: int = 0  # the worker's own cache statistics
    computed_prompt_tokens: int = 0

    @property
    def computed_tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens


@dataclass
class ReplayResult:
    times: list[RequestTimes] = field(default_factory=list)
    steps: int = 0
    busy_s: float = 0.0
    preemptions: int = 0
    cached_tokens: int = 0
    workers: list[WorkerStats] = field(default_factory=list)


class VirtualClock:
    """The replay's one clock: every worker's scheduler reads it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class ReplayWorker:
    """One engine on the virtual clock: its scheduler, pools and prefix cache
    (recording KV events to ``events`` when given), and the step it runs."""

    def __init__(self, config: ReplayConfig, page_size: int, clock: VirtualClock,
                 events: KVEventLog | None = None) -> None:
        self.allocator = KVAllocator(FullKVPool(config.full_tokens // page_size, page_size),
                                     SWAKVPool(int(config.full_tokens * config.swa_fraction), 1), config.window)
        self.cache = RadixCache(self.allocator, config.checkpoint_interval, events=events)
        self.scheduler = Scheduler(self.allocator, SchedulerConfig(
            config.max_running_requests, config.max_num_batched_tokens, config.chunked_prefill_size,
            config.policy, config.bucket_edges), self.cache, clock=clock)
        self.events = events
        self.window = config.window
        self.stats = WorkerStats()
        self.chunks: list[ScheduledChunk] | None = None  # the step in flight
        self.step_end = 0.0

    @property
    def idle(self) -> bool:
        return self.chunks is None

    def start_step(self, cost: CostModel, now: float) -> None:
        """Schedule a step (``RequestTooLarge`` passes through); it ends at ``step_end``."""
        chunks = self.scheduler.schedule()
        shape = step_shape(chunks, self.window)
        seconds = cost.step_seconds(shape)
        self.chunks, self.step_end = chunks, now + seconds
        stats = self.stats
        stats.busy_s += seconds
        stats.steps += 1
        stats.prefill_tokens += shape.prefill_tokens
        stats.decode_tokens += shape.decode_rows

    def final_stats(self) -> WorkerStats:
        self.stats.preemptions = self.scheduler.num_preemptions
        self.stats.cached_prompt_tokens = self.cache.stats.cached_prompt_tokens
        self.stats.computed_prompt_tokens = self.cache.stats.computed_prompt_tokens
        return self.stats


class Dispatch(Protocol):
    """Where requests go, and what it is told as they progress."""

    def route(self, request_id: int, prompt: list[int]) -> int:
        """The index of the worker that serves the request."""
        ...

    def prefilled(self, request_id: int) -> None:
        """Its first token is out (or it failed): its prompt is no longer queued."""
        ...

    def stepped(self, worker: int) -> None:
        """A step of ``worker`` ended (its cache changed)."""
        ...


class OneWorker:
    """Every request to the one worker."""

    def route(self, request_id: int, prompt: list[int]) -> int:
        return 0

    def prefilled(self, request_id: int) -> None:
        pass

    def stepped(self, worker: int) -> None:
        pass


def replay(requests: Seq[TraceRequest], cost: CostModel, config: ReplayConfig, time_scale: float = 1.0) -> ReplayResult:
    """Serve ``requests`` (arrivals x ``time_scale``) through the scheduler,
    pools and prefix cache; every step lasts what ``cost`` says."""
    clock = VirtualClock()
    worker = ReplayWorker(config, trace_page_size(list(requests)), clock)
    return replay_workers(requests, cost, config, [worker], OneWorker(), clock, time_scale)


def replay_workers(requests: Seq[TraceRequest], cost: CostModel, config: ReplayConfig,
                   workers: Seq[ReplayWorker], dispatch: Dispatch, clock: VirtualClock,
                   time_scale: float = 1.0) -> ReplayResult:
    """Serve ``requests`` over ``workers`` on one virtual clock: each request
    goes where ``dispatch`` routes it on arrival; each worker runs a step at
    a time, and what a step computed counts only once it ends."""
    return _TraceReplay(requests, cost, config, workers, dispatch, clock, time_scale).run()


class _TraceReplay:
    def __init__(self, requests: Seq[TraceRequest], cost: CostModel, config: ReplayConfig,
                 workers: Seq[ReplayWorker], dispatch: Dispatch, clock: VirtualClock, time_scale: float) -> None:
        self.cost, self.workers, self.dispatch, self.clock = cost, list(workers), dispatch, clock
        self.time_scale = time_scale
        self.buckets = LengthBuckets(config.bucket_edges)
        self.factory = TokenFactory()
        self.result = ReplayResult()
        # Arrivals in time order; a session's request waits for the previous one's answer.
        self.ready: list[tuple[float, int, TraceRequest]] = []  # (arrival, order, request): a heap
        self.sessions: dict[str, deque[TraceRequest]] = {}
        for req in sorted(requests, key=lambda r: r.arrival):
            if req.session and config.closed_sessions:
                self.sessions.setdefault(req.session, deque()).append(req)
            else:
                heapq.heappush(self.ready, (req.arrival * time_scale, len(self.ready), req))
        self.order = itertools.count(len(self.ready))
        for queue_ in self.sessions.values():
            first = queue_.popleft()
            heapq.heappush(self.ready, (first.arrival * time_scale, next(self.order), first))
        self.live: dict[int, tuple[Sequence, RequestTimes, TraceRequest]] = {}
        self.next_id = 0

    def run(self) -> ReplayResult:
        clock, workers = self.clock, self.workers
        while self.ready or any(w.scheduler.has_unfinished() for w in workers):
            self._arrive()
            if not self._start_steps():
                continue  # a request failed: its session's next one may be due now
            busy = [w.step_end for w in workers if not w.idle]
            if not busy:
                clock.now = self.ready[0][0]
                continue
            clock.now = min(min(busy), self.ready[0][0] if self.ready else math.inf)
            for i, worker in enumerate(workers):
                if not worker.idle and worker.step_end <= clock.now:
                    self._end_step(i, worker)
        result = self.result
        result.workers = [w.final_stats() for w in workers]
        result.steps = sum(s.steps for s in result.workers)
        result.busy_s = sum(s.busy_s for s in result.workers)
        result.preemptions = sum(s.preemptions for s in result.workers)
        result.cached_tokens = sum(s.cached_prompt_tokens for s in result.workers)
        return result

    def _arrive(self) -> None:
        """Route and queue every request that has arrived by now."""
        now = self.clock.now
        while self.ready and self.ready[0][0] <= now:
            arrival, _, req = heapq.heappop(self.ready)
            prompt, _ = self.factory.request(req)
            index = self.dispatch.route(self.next_id, prompt)
            worker = self.workers[index]
            seq = Sequence(self.next_id, prompt, max(req.output_tokens, 1), worker.allocator.new_view())
            seq.arrival = arrival
            times = RequestTimes(arrival, len(prompt), seq.max_tokens, self.buckets.of(len(prompt)), worker=index)
            self.result.times.append(times)
            self.live[self.next_id] = (seq, times, req)
            worker.scheduler.add(seq)
            self.next_id += 1

    def _start_steps(self) -> bool:
        """A step on every idle worker with work; False when a request was
        too large for its worker's pools (it failed, and nothing else started)."""
        for worker in self.workers:
            if not worker.idle or not worker.scheduler.has_unfinished():
                continue
            try:
                worker.start_step(self.cost, self.clock.now)
            except RequestTooLarge as exc:
                worker.scheduler.finish(exc.seq, "abort")
                _, times, req = self.live.pop(exc.seq.request_id)
                times.failed = True
                self.dispatch.prefilled(exc.seq.request_id)
                self._next_in_session(req)
                return False
        return True

    def _end_step(self, index: int, worker: ReplayWorker) -> None:
        """The step's tokens are computed now: sample, answer, finish."""
        chunks, worker.chunks = worker.chunks, None
        assert chunks is not None
        scheduler, now, fresh = worker.scheduler, self.clock.now, self.factory.fresh
        ended = []
        for chunk in chunks:
            seq = chunk.seq
            scheduler.commit(chunk)
            if not chunk.samples:
                continue
            seq.output.append(fresh(1)[0])
            times = self.live[seq.request_id][1]
            if times.first_token is None:
                times.first_token, times.cached_tokens = now, seq.cached_tokens or 0
                self.dispatch.prefilled(seq.request_id)
            if len(seq.output) >= seq.max_tokens:
                ended.append(seq)
        scheduler.after_step(chunks)
        for seq in ended:
            scheduler.finish(seq, "length")
            _, times, req = self.live.pop(seq.request_id)
            times.finished = now
            self._next_in_session(req)
        self.dispatch.stepped(index)

    def _next_in_session(self, done: TraceRequest) -> None:
        """Release the session's next request: at its trace time, or now if its
        predecessor was answered later than that."""
        queue_ = self.sessions.get(done.session) if done.session else None
        if queue_:
            nxt = queue_.popleft()
            heapq.heappush(self.ready, (max(nxt.arrival * self.time_scale, self.clock.now), next(self.order), nxt))


def _percentile(values: Seq[float], q: float) -> float:
    """Nearest-rank percentile."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def summarize(times: Seq[RequestTimes]) -> dict[str, float | int]:
    served = [t for t in times if t.first_token is not None]
    ttft = [t.first_token - t.arrival for t in served]  # type: ignore[operator]
    done = [t for t in served if t.finished is not None]
    span = (max(t.finished for t in done) - min(t.arrival for t in times)) if done else 0.0  # type: ignore[type-var]
    tokens = sum(t.prompt_tokens + t.output_tokens for t in done)
    return {"requests": len(times), "failed": sum(t.failed for t in times),
            "ttft_p50_s": round(_percentile(ttft, 0.5), 4), "ttft_p90_s": round(_percentile(ttft, 0.9), 4),
            "ttft_p99_s": round(_percentile(ttft, 0.99), 4), "ttft_max_s": round(max(ttft, default=0.0), 4),
            "ttft_mean_s": round(sum(ttft) / len(ttft), 4) if ttft else 0.0,
            "throughput_tok_s": round(tokens / span, 1) if span else 0.0}
