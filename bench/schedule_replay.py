"""Schedule policies on trace replay: the engine's scheduler, pools and prefix
cache serve a trace with its arrival times, and a cost model says how long
each step takes, so TTFT is measured on a virtual clock. The same replay runs
N such workers on one clock behind a dispatcher (``replay_workers``: the
router bench, ``bench/router.py``).

Two cost models:

* ``mimo-v2.5-pro-h200`` (``AnalyticCost``): a step of MiMo-V2.5-Pro on one
  node of 8 H200s, from the preset's shapes: compute time is the step's
  FLOPs (2 x active parameters per row, plus attention over each row's
  context, SWA layers over at most the window) at a fraction of peak; memory
  time is the bytes it reads (non-expert weights, the experts its rows
  touch, the KV it attends) at a fraction of HBM bandwidth; the step takes
  the larger of the two plus a fixed overhead. The constants are fields of
  the dataclass, stated in ``docs/benchmarks.md``.
* ``calibrated`` (``LinearCost``, measured by ``bench/schedule.py``):
  the engine's own step time on this machine for the demo-size model,
  measured over prefill chunks and decode batches of several sizes and
  contexts and fitted as a linear model of the same step features.

``--load`` scales the trace's clock so the offered work is that fraction of
what the system can do: the work of a request is its prompt tokens past an
infinite cache's hit, prefilled alone, plus its output tokens at the
per-token cost of a 32-row decode step.

Pure logic: no model runs in a replay.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence as Seq
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from bench.prefix_cache import MIMO_WINDOW, TokenFactory, TraceRequest, load_trace, trace_page_size
from llm_core.config import ModelConfig
from llm_core.kv_events import KVEventLog
from llm_core.kv_pool import FullKVPool, KVAllocator, SWAKVPool
from llm_core.prefix_cache import RadixCache
from llm_core.schedule_policy import POLICIES, LengthBuckets
from llm_core.scheduler import RequestTooLarge, ScheduledChunk, Scheduler, SchedulerConfig, Sequence

@dataclass(frozen=True)
class StepShape:
    """What a cost model sees of one step."""

    prefill_tokens: int = 0
    prefill_attended: int = 0  # sum over prefill rows of the positions each attends (full layers)
    prefill_attended_swa: int = 0  # the same, capped at the window (SWA layers)
    prefill_context: int = 0  # sum over prefill chunks of the cached positions before them (KV read)
    decode_rows: int = 0
    decode_context: int = 0  # sum over decode rows of their context
    decode_context_swa: int = 0
    sampled_rows: int = 0

    @property
    def rows(self) -> int:
        return self.prefill_tokens + self.decode_rows


def _attended(start: int, n: int, cap: int | None = None) -> int:
    """Sum of min(p, cap) for p in start + 1 .. start + n (each row sees itself)."""
    lo, hi = start + 1, start + n
    if cap is None or hi <= cap:
        return (lo + hi) * n // 2
    if lo > cap:
        return cap * n
    return (lo + cap) * (cap - lo + 1) // 2 + cap * (hi - cap)


def step_shape(chunks: Iterable[ScheduledChunk], window: int) -> StepShape:
    pt = pa = pas = pc = dr = dc = dcs = sampled = 0
    for chunk in chunks:
        sampled += chunk.samples
        if chunk.length == 1 and chunk.seq.output:
            dr += chunk.rows
            dc += (chunk.start + 1) * chunk.rows
            dcs += min(chunk.start + 1, window) * chunk.rows
            continue
        pt += chunk.rows
        pa += _attended(chunk.start, chunk.rows)
        pas += _attended(chunk.start, chunk.rows, window)
        pc += chunk.start
    return StepShape(pt, pa, pas, pc, dr, dc, dcs, sampled)


class CostModel(Protocol):
    name: str

    def step_seconds(self, shape: StepShape) -> float: ...


@dataclass(frozen=True)
class AnalyticCost:
    """Step time of a MiMo-V2 model on a node of ``gpus`` H200s (EP across them)."""

    name: str
    active_params: float  # per row: attention, dense MLP share, routed experts (k of E)
    lm_head_params: float  # per sampled row
    dense_bytes: float  # weights every step reads whatever its rows (all but routed experts)
    expert_bytes: float  # one expert of one MoE layer
    moe_layers: int
    experts: int
    experts_per_token: int
    full_attn_flops_per_key: float  # per query row, per attended key, summed over full layers
    swa_attn_flops_per_key: float  # the same over SWA (and no MTP) layers
    full_kv_bytes_per_token: float
    swa_kv_bytes_per_token: float
    gpus: int = 8
    peak_flops: float = 989e12  # H200 dense BF16 per GPU
    hbm_bytes_per_s: float = 4.8e12  # H200 HBM3e per GPU
    compute_efficiency: float = 0.5  # achieved fraction of peak on large batches
    bandwidth_efficiency: float = 0.7
    step_overhead_s: float = 0.002  # launch, scheduling, expert-parallel all-to-all latency

    @classmethod
    def for_preset(cls, config: ModelConfig, name: str = "mimo-v2.5-pro-h200", weight_bytes: float = 1.0,
                   kv_bytes: float = 2.0) -> AnalyticCost:
        """FP8 weights (``weight_bytes`` per parameter), BF16 KV."""
        h = config.hidden_size
        full, swa = config.full_attention, config.sliding_attention

        def attn_params(spec: Any) -> float:
            return h * spec.num_heads * spec.head_dim + h * spec.num_kv_heads * (spec.head_dim + spec.v_head_dim) \
                + spec.num_heads * spec.v_head_dim * h

        n_full, n_swa = len(config.full_layer_ids), len(config.sliding_layer_ids)
        attention = n_full * attn_params(full) + n_swa * attn_params(swa)
        moe_layers = sum(t == "sparse" for t in config.mlp_layer_types)
        dense_mlp = (len(config.mlp_layer_types) - moe_layers) * 3 * h * config.intermediate_size
        expert = 3 * h * config.moe_intermediate_size
        routers = moe_layers * h * config.n_routed_experts
        lm_head = h * config.vocab_size
        active = attention + dense_mlp + routers + moe_layers * config.num_experts_per_tok * expert
        return cls(
            name=name, active_params=active, lm_head_params=lm_head,
            dense_bytes=(attention + dense_mlp + routers + lm_head) * weight_bytes, expert_bytes=expert * weight_bytes,
            moe_layers=moe_layers, experts=config.n_routed_experts, experts_per_token=config.num_experts_per_tok,
            full_attn_flops_per_key=n_full * 2 * full.num_heads * (full.head_dim + full.v_head_dim),
            swa_attn_flops_per_key=n_swa * 2 * swa.num_heads * (swa.head_dim + swa.v_head_dim),
            full_kv_bytes_per_token=n_full * full.kv_elements_per_token * kv_bytes,
            swa_kv_bytes_per_token=n_swa * swa.kv_elements_per_token * kv_bytes,
        )

    def step_seconds(self, s: StepShape) -> float:
        rows = s.rows
        if rows == 0:
            return 0.0
        flops = 2 * self.active_params * rows + 2 * self.lm_head_params * s.sampled_rows
        flops += self.full_attn_flops_per_key * (s.prefill_attended + s.decode_context)
        flops += self.swa_attn_flops_per_key * (s.prefill_attended_swa + s.decode_context_swa)
        touched = self.experts * (1 - (1 - self.experts_per_token / self.experts) ** rows)
        read = self.dense_bytes + self.moe_layers * touched * self.expert_bytes
        read += self.full_kv_bytes_per_token * (s.prefill_context + s.decode_context)
        read += self.swa_kv_bytes_per_token * (s.decode_context_swa + min(s.prefill_context, MIMO_WINDOW))
        compute_s = flops / (self.gpus * self.peak_flops * self.compute_efficiency)
        memory_s = read / (self.gpus * self.hbm_bytes_per_s * self.bandwidth_efficiency)
        return max(compute_s, memory_s) + self.step_overhead_s

    def describe(self) -> dict[str, float | int | str]:
        return {"name": self.name, "gpus": self.gpus, "peak_flops_per_gpu": self.peak_flops,
                "hbm_bytes_per_s_per_gpu": self.hbm_bytes_per_s, "compute_efficiency": self.compute_efficiency,
                "bandwidth_efficiency": self.bandwidth_efficiency, "step_overhead_s": self.step_overhead_s,
                "active_params": self.active_params, "weights_read_per_step_bytes": self.dense_bytes,
                "expert_bytes": self.expert_bytes, "weight_bytes_per_param": 1, "kv_bytes_per_element": 2}


FEATURES = ("prefill_tokens", "prefill_attended", "decode_rows", "decode_context")


@dataclass(frozen=True)
class LinearCost:
    """t = intercept + sum(coefficient x feature) over FEATURES, fitted."""

    name: str
    intercept: float
    coefficients: tuple[float, ...]

    def step_seconds(self, s: StepShape) -> float:
        if s.rows == 0:
            return 0.0
        return max(0.0, self.intercept + sum(c * getattr(s, f) for c, f in zip(self.coefficients, FEATURES)))

    @classmethod
    def fit(cls, samples: Seq[tuple[StepShape, float]], name: str = "calibrated") -> LinearCost:
        import numpy as np

        x = np.array([[1.0, *(float(getattr(s, f)) for f in FEATURES)] for s, _ in samples])
        y = np.array([t for _, t in samples])
        # Non-negative least squares by clipping and refitting: a negative cost
        # per token would let a longer step look cheaper.
        keep = list(range(x.shape[1]))
        while True:
            coef = np.linalg.lstsq(x[:, keep], y, rcond=None)[0]
            bad = [k for k, c in zip(keep, coef) if c < 0 and k != 0]
            if not bad:
                break
            keep = [k for k in keep if k not in bad]
        full = [0.0] * x.shape[1]
        for k, c in zip(keep, coef):
            full[k] = float(c)
        return cls(name, full[0], tuple(full[1:]))

    def describe(self) -> dict[str, float | str]:
        return {"name": self.name, "intercept_s": self.intercept,
                **{f"{f}_s": c for f, c in zip(FEATURES, self.coefficients)}}


# --------------------------------------------------------------------- replay
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


# ------------------------------------------------------------------- load
def request_work(requests: Seq[TraceRequest], cost: CostModel, window: int = MIMO_WINDOW) -> float:
    """Seconds of work the trace offers: each request's prompt past an
    infinite cache's hit, prefilled alone in 8K chunks, plus its output at
    the per-token cost of a 32-row decode step at its context."""
    page = trace_page_size(list(requests))
    seen: set[tuple[tuple[str, int], ...]] = set()
    total = 0.0
    for req in requests:
        hit_blocks = 0
        for i in range(1, len(req.blocks) + 1):
            if req.blocks[:i] in seen:
                hit_blocks = i
            else:
                break
        for i in range(hit_blocks + 1, len(req.blocks) + 1):
            seen.add(req.blocks[:i])
        for seconds in _work_seconds(cost, window, req.input_tokens, req.output_tokens, hit_blocks * page):
            total += seconds
    return total


def served_work(times: Iterable[RequestTimes], cost: CostModel, window: int = MIMO_WINDOW) -> float:
    """The same, for requests as a replay served them: each prompt past the
    prefix its worker's cache really served."""
    total = 0.0
    for t in times:
        for seconds in _work_seconds(cost, window, t.prompt_tokens, t.output_tokens, t.cached_tokens):
            total += seconds
    return total


def _work_seconds(cost: CostModel, window: int, input_tokens: int, output_tokens: int,
                  hit_tokens: int) -> Iterator[float]:
    """A request's work, step by step: its prompt past ``hit_tokens`` in
    8K chunks alone, then its output at a 32-row decode step's cost per token."""
    start = min(hit_tokens, max(0, input_tokens - 1))
    while start < input_tokens:
        n = min(8192, input_tokens - start)
        yield cost.step_seconds(StepShape(n, _attended(start, n), _attended(start, n, window), start, sampled_rows=1))
        start += n
    ctx = input_tokens + output_tokens // 2
    decode = cost.step_seconds(StepShape(decode_rows=32, decode_context=32 * ctx,
                                         decode_context_swa=32 * min(ctx, window), sampled_rows=32))
    yield max(output_tokens - 1, 0) * decode / 32


def arrival_span(requests: Seq[TraceRequest]) -> float:
    """Seconds from the first arrival to the last, unscaled."""
    return max(r.arrival for r in requests) - min(r.arrival for r in requests)


def load_scale(requests: Seq[TraceRequest], cost: CostModel, load: float) -> float:
    """The factor on arrival times that makes the offered work ``load`` of the time."""
    span = arrival_span(requests)
    return request_work(requests, cost) / (load * span) if span > 0 else 1.0


def utilisation(result: ReplayResult) -> float:
    """Busy time over the time from the first arrival to the last finish, per worker."""
    span = max((t.finished or 0.0) for t in result.times) - min(t.arrival for t in result.times)
    return result.busy_s / (span * max(1, len(result.workers))) if span > 0 else 0.0


def calibrate_load(requests: Seq[TraceRequest], cost: CostModel, load: float, config: ReplayConfig,
                   log: Callable[[str], None] | None = None, rounds: int = 3) -> float:
    """The arrival-time factor at which an FCFS replay is busy ``load`` of the
    time: the work estimate's factor, corrected by replaying (batching and
    cache misses make real steps cost other than the estimate)."""
    scale = load_scale(requests, cost, load)
    fcfs = replace(config, policy="fcfs")
    for _ in range(rounds):
        measured = utilisation(replay(requests, cost, fcfs, scale))
        if log is not None:
            log(f"time scale {scale:.4f}: utilisation {measured:.3f}")
        if measured <= 0:
            break
        scale *= measured / load
    return scale


# ------------------------------------------------------------------ bench
def schedule_bench(trace: str, cost: AnalyticCost | LinearCost, load: float = 0.8,
                   policies: Seq[str] = POLICIES, config: ReplayConfig = ReplayConfig(),
                   limit: int | None = None, stagger_s: float = 60.0,
                   log: Callable[[str], None] | None = None) -> dict[str, Any]:
    say = log or (lambda _msg: None)
    requests = load_trace(trace, stagger_s=stagger_s)[:limit]
    scale = calibrate_load(requests, cost, load, config, say)
    buckets = LengthBuckets(config.bucket_edges)
    out: dict[str, Any] = {"trace": trace, "requests": len(requests), "cost_model": cost.describe(),  # type: ignore[attr-defined]
                           "load": load, "time_scale": round(scale, 6), "bucket_edges": list(config.bucket_edges),
                           "stagger_s": stagger_s, "closed_sessions": config.closed_sessions, "policies": {}}
    cdfs: dict[str, list[float]] = {}
    for policy in policies:
        start = time.perf_counter()
        result = replay(requests, cost, replace(config, policy=policy), scale)
        summary: dict[str, Any] = summarize(result.times)
        summary["utilisation"] = round(utilisation(result), 4)
        summary["preemptions"] = result.preemptions
        summary["cached_prompt_tokens"] = result.cached_tokens
        summary["steps"] = result.steps
        summary["buckets"] = {label: summarize([t for t in result.times if t.bucket == b])
                              for b, label in enumerate(buckets.labels) if any(t.bucket == b for t in result.times)}
        out["policies"][policy] = summary
        cdfs[policy] = sorted(t.first_token - t.arrival for t in result.times if t.first_token is not None)
        say(f"{policy}: p90 {summary['ttft_p90_s']} s, {time.perf_counter() - start:.1f} s to replay")
    if "fcfs" in out["policies"] and "compute-aware" in out["policies"]:
        fcfs, ours = out["policies"]["fcfs"], out["policies"]["compute-aware"]
        out["compute_aware_vs_fcfs"] = {
            "ttft_p90": round(ours["ttft_p90_s"] / fcfs["ttft_p90_s"], 4) if fcfs["ttft_p90_s"] else None,
            "ttft_max": round(ours["ttft_max_s"] / fcfs["ttft_max_s"], 4) if fcfs["ttft_max_s"] else None,
            "throughput": round(ours["throughput_tok_s"] / fcfs["throughput_tok_s"], 4)
            if fcfs["throughput_tok_s"] else None}
    out["_cdfs"] = cdfs
    return out


def plot_cdf(cdfs: dict[str, list[float]], out: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for policy, values in cdfs.items():
        if values:
            ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", label=policy)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s, virtual clock)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


__all__ = ["AnalyticCost", "Dispatch", "LinearCost", "ReplayConfig", "ReplayResult", "ReplayWorker", "StepShape",
           "VirtualClock", "WorkerStats", "arrival_span", "calibrate_load", "load_scale", "replay",
           "replay_workers", "schedule_bench", "served_work", "step_shape", "summarize", "utilisation"]
