"""The load a trace offers a replay, and the time scale on its arrivals
that sets it: ``--load`` scales the trace's clock so the offered work is
that fraction of what the system can do. The work of a request is its
prompt tokens past an infinite cache's hit, prefilled alone, plus its
output tokens at the per-token cost of a 32-row decode step
(``request_work``); ``calibrate_load`` corrects that estimate by replaying.

Pure logic: no model runs in a replay.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence as Seq
from dataclasses import replace

from bench.prefix_cache import MIMO_WINDOW, TraceRequest, trace_page_size
from bench.replay_cost import CostModel, StepShape, attended_positions
from bench.schedule_replay import ReplayConfig, ReplayResult, RequestTimes, replay

__all__ = ["arrival_span", "calibrate_load", "load_scale", "request_work", "served_work", "utilisation"]


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
        yield cost.step_seconds(StepShape(n, attended_positions(start, n), attended_positions(start, n, window), start, sampled_rows=1))
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
