"""``swallow bench schedule``: schedule policies on trace replay.

The replay (``bench/schedule_replay.py``) runs the engine's scheduler,
pools and prefix cache on a virtual clock; this module replays the trace
once per policy at the load asked for and reports each one's TTFT
(``schedule_bench``), and supplies the ``calibrated`` cost model, measured
on this machine: the real engine's step time on the demo model's shape
(random weights, float32, CPU) over prefill chunks at several contexts and
decode batches of several sizes, fitted as a linear model of the step's
features.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench import log
from demo.model import demo_llm_config
from llm_core import LLM, SamplingParams
from bench.prefix_cache import TokenFactory, TraceRequest, load_trace, trace_page_size
from bench.replay_cost import AnalyticCost, LinearCost, StepShape, step_shape
from bench.replay_load import calibrate_load, utilisation
from bench.schedule_replay import ReplayConfig, RequestTimes, replay, summarize
from llm_core.loading.checkpoint import write_random_checkpoint
from llm_core.model.presets import mimo_v2_5_pro
from llm_core.sched.schedule_policy import POLICIES, LengthBuckets
from llm_core.sched.scheduler import ScheduledChunk

__all__ = ["calibrated_cost", "cost_model", "engine_comparison", "engine_replay", "plot_cdf", "run_schedule_bench",
           "scaled_trace", "schedule_bench"]

VOCAB = 431
PREFILL_CHUNKS = (16, 64, 256, 1024)
PREFILL_CONTEXT = 3072
DECODE_BATCHES = (1, 4, 16, 32)
DECODE_CONTEXTS = (64, 512, 2048)


class _StepTimer:
    """Times ``engine.step()`` calls and records each step's shape: the
    samples the ``calibrated`` cost model is fitted on."""

    def __init__(self, llm: LLM) -> None:
        self.engine = llm.engine
        self.samples: list[tuple[StepShape, float]] = []
        self._chunks: list[ScheduledChunk] = []
        self._schedule = self.engine.scheduler.schedule

    def _capture(self) -> list[ScheduledChunk]:
        self._chunks = self._schedule()
        return self._chunks

    def step(self) -> list[Any]:
        self._chunks = []
        self.engine.scheduler.schedule = self._capture  # type: ignore[method-assign]
        try:
            start = time.perf_counter()
            events = self.engine.step()
            seconds = time.perf_counter() - start
        finally:
            self.engine.scheduler.schedule = self._schedule  # type: ignore[method-assign]
        if self._chunks:
            self.samples.append((step_shape(self._chunks, self.engine.window), seconds))
        return events


def _timed_steps(llm: LLM, steps: int) -> list[tuple[StepShape, float]]:
    """Run up to ``steps`` engine steps; each one's shape and wall time."""
    timer = _StepTimer(llm)
    for _ in range(steps):
        if not llm.engine.scheduler.has_unfinished():
            break
        timer.step()
    return timer.samples


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def calibrated_cost(log: Callable[[str], None] | None = None, chunks: tuple[int, ...] = PREFILL_CHUNKS,
                    context: int = PREFILL_CONTEXT, batches: tuple[int, ...] = DECODE_BATCHES,
                    contexts: tuple[int, ...] = DECODE_CONTEXTS) -> LinearCost:
    """The engine's step time on this machine, fitted (see the module doc):
    prefill ``chunks`` through a ``context``-token prompt, decode ``batches``
    at ``contexts``."""
    say = log or (lambda _msg: None)
    rng = random.Random(0)
    samples: list[tuple[StepShape, float]] = []
    with tempfile.TemporaryDirectory(prefix="swallow-bench-schedule-") as tmp:
        config = dataclasses.replace(demo_llm_config(VOCAB, 1), max_position_embeddings=8192)
        model = write_random_checkpoint(Path(tmp) / "model", config, seed=0)
        for chunk in chunks:
            say(f"calibrating: prefill chunks of {chunk}")
            llm = LLM(model, enable_prefix_caching=False, chunked_prefill_size=chunk, max_num_batched_tokens=chunk,
                      speculative_tokens=0)
            llm.generate([_prompt(rng, 64)], SamplingParams(max_tokens=1, ignore_eos=True))  # warm-up
            llm.engine.add_request(_prompt(rng, context + chunk), SamplingParams(max_tokens=1, ignore_eos=True))
            samples += _timed_steps(llm, context // chunk + 2)
        for ctx in contexts:
            for batch in batches:
                say(f"calibrating: decode of {batch} rows at {ctx}")
                llm = LLM(model, enable_prefix_caching=False, max_running_requests=max(batches),
                          chunked_prefill_size=4096, max_num_batched_tokens=4096, speculative_tokens=0)
                for _ in range(batch):
                    llm.engine.add_request(_prompt(rng, ctx), SamplingParams(max_tokens=12, ignore_eos=True))
                while any(not s.in_decode for s in llm.engine.scheduler.running) or llm.engine.scheduler.waiting:
                    llm.engine.step()  # the prefills, untimed
                samples += [s for s in _timed_steps(llm, 10) if s[0].prefill_tokens == 0][2:]
    return LinearCost.fit(samples)


def cost_model(name: str, log: Callable[[str], None] | None = None) -> AnalyticCost | LinearCost:
    if name == "mimo-v2.5-pro-h200":
        return AnalyticCost.for_preset(mimo_v2_5_pro())
    if name == "calibrated":
        return calibrated_cost(log)
    raise ValueError(f"unknown cost model {name!r}; choose mimo-v2.5-pro-h200 or calibrated")


def schedule_bench(trace: str, cost: AnalyticCost | LinearCost, load: float = 0.8,
                   policies: Sequence[str] = POLICIES, config: ReplayConfig = ReplayConfig(),
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
        result = replay(requests, cost, dataclasses.replace(config, policy=policy), scale)
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


def run_schedule_bench(trace: str, cost: str, load: float, limit: int | None, plot: str | None,
                       log: Callable[[str], None] | None = None, stagger_s: float = 60.0,
                       closed_sessions: bool = True) -> dict[str, Any]:
    result = schedule_bench(trace, cost_model(cost, log), load, limit=limit, stagger_s=stagger_s,
                            config=ReplayConfig(closed_sessions=closed_sessions), log=log)
    cdfs = result.pop("_cdfs")
    if plot:
        plot_cdf(cdfs, plot, f"TTFT on {Path(trace).name} at {load:.0%} load ({cost})")
        result["plot"] = plot
    return result


# ------------------------------------------------------------ real engine
ENGINE_SESSIONS = 8
ENGINE_TURNS = 8
TOKEN_DIVISOR = 8


def scaled_trace(requests: list[TraceRequest], sessions: int = ENGINE_SESSIONS, turns: int = ENGINE_TURNS,
                 divisor: int = TOKEN_DIVISOR) -> list[TraceRequest]:
    """The first ``turns`` requests of the first ``sessions`` sessions, with
    token counts (blocks, prompts, outputs) divided by ``divisor``: the same
    sharing pattern at a size the demo model serves on a CPU in minutes."""
    names = sorted({r.session for r in requests})[:sessions]
    out = []
    for name in names:
        mine = [r for r in requests if r.session == name][:turns]
        for r in mine:
            out.append(dataclasses.replace(r, block_size=max(1, r.block_size // divisor),
                                           input_tokens=max(1, r.input_tokens // divisor),
                                           output_tokens=max(1, r.output_tokens // divisor)))
    return sorted(out, key=lambda r: r.arrival)


def _engine_tokens(prompt: list[int], vocab: int) -> list[int]:
    """Trace token ids (any integers) as ids of the model's vocabulary, pseudo-randomly."""
    return [(t * 2654435761 + 12345) % (vocab - 3) + 3 for t in prompt]


def engine_replay(llm: LLM, requests: list[TraceRequest], time_scale: float,
                  steps: list[tuple[StepShape, float]] | None = None) -> list[RequestTimes]:
    """Serve the trace on the real engine, on the wall clock: a request is
    added once its (scaled) arrival has passed and its session's previous
    request is answered; TTFT from that arrival to its first token event.
    Each step's shape and wall time go to ``steps`` if given."""
    engine = llm.engine
    timer = _StepTimer(llm)
    vocab = engine.model.config.vocab_size
    factory = TokenFactory()
    by_session: dict[str, list[TraceRequest]] = {}
    for r in requests:
        by_session.setdefault(r.session, []).append(r)
    heads = {name: 0 for name in by_session}
    released: dict[str, float] = {name: reqs[0].arrival * time_scale for name, reqs in by_session.items()}
    live: dict[int, tuple[str, RequestTimes]] = {}
    times: list[RequestTimes] = []
    buckets = engine.scheduler.buckets
    start = time.perf_counter()
    while len(times) < len(requests) or live:
        now = time.perf_counter() - start
        for name, reqs in by_session.items():
            busy = any(session == name for session, _ in live.values())
            if busy or heads[name] >= len(reqs) or released[name] > now:
                continue
            req = reqs[heads[name]]
            heads[name] += 1
            prompt, _ = factory.request(req)
            rid = engine.add_request(_engine_tokens(prompt, vocab),
                                     SamplingParams(max_tokens=max(1, req.output_tokens), ignore_eos=True))
            record = RequestTimes(released[name], len(prompt), req.output_tokens, buckets.of(len(prompt)))
            times.append(record)
            live[rid] = (name, record)
        if not live:
            upcoming = [released[n] for n, reqs in by_session.items() if heads[n] < len(reqs)]
            time.sleep(max(0.0, min(upcoming) - now))
            continue
        for event in timer.step():
            name, record = live[event.request_id]
            at = time.perf_counter() - start
            if record.first_token is None:
                record.first_token = at
            if event.finish_reason is not None:
                record.finished = at
                del live[event.request_id]
                reqs = by_session[name]
                if heads[name] < len(reqs):
                    released[name] = max(reqs[heads[name]].arrival * time_scale, at)
    if steps is not None:
        steps += timer.samples
    return times


def engine_comparison(trace: str, load: float = 0.8, log: Callable[[str], None] | None = None,
                      sessions: int = ENGINE_SESSIONS, turns: int = ENGINE_TURNS) -> dict[str, Any]:
    """compute-aware against FCFS on a scaled-down agentic trace, on the real
    engine (wall clock) and in the replay, at the same time scale: the P90
    improvement of each. The time scale comes from the ``calibrated`` cost
    model fitted before the engine runs; the replay's cost model is fitted on
    the steps the engine ran in them (both policies'), so the replay models
    the machine as it was during the runs, not minutes before."""
    say = log or (lambda _msg: None)
    requests = scaled_trace(load_trace(trace), sessions, turns)
    cost = calibrated_cost(say)
    page = trace_page_size(requests)
    longest = max(r.input_tokens + r.output_tokens for r in requests)
    with tempfile.TemporaryDirectory(prefix="swallow-bench-schedule-") as tmp:
        config = dataclasses.replace(demo_llm_config(VOCAB, 1), max_position_embeddings=longest + 256)
        model = write_random_checkpoint(Path(tmp) / "model", config, seed=0)

        def llm_for(policy: str) -> LLM:
            return LLM(model, page_size=page, kv_budget_bytes=256 << 20, chunked_prefill_size=2048,
                       max_num_batched_tokens=2048, max_running_requests=64, speculative_tokens=0,
                       schedule_policy=policy)

        probe = llm_for("fcfs")
        engine = probe.engine
        replay_config = ReplayConfig(full_tokens=engine.allocator.full.capacity,
                                     swa_fraction=engine.allocator.swa.capacity / engine.allocator.full.capacity,
                                     window=engine.window, checkpoint_interval=engine.cache.checkpoint_interval,  # type: ignore[union-attr]
                                     max_num_batched_tokens=2048, chunked_prefill_size=2048, max_running_requests=64,
                                     bucket_edges=engine.scheduler.buckets.edges)
        probe.generate([_engine_tokens(list(range(300)), VOCAB)], SamplingParams(max_tokens=2))  # warm-up
        scale = calibrate_load(requests, cost, load, replay_config, say)
        result: dict[str, Any] = {"trace": trace, "requests": len(requests), "sessions": sessions,
                                  "token_divisor": TOKEN_DIVISOR, "load": load, "time_scale": round(scale, 6),
                                  "load_cost_model": cost.describe(), "engine": {}, "sim": {}}
        steps: list[tuple[StepShape, float]] = []
        for policy in ("fcfs", "compute-aware"):
            say(f"engine replay: {policy}")
            llm = probe if policy == "fcfs" else llm_for(policy)
            result["engine"][policy] = summarize(engine_replay(llm, requests, scale, steps))
            llm.close()
    fitted = LinearCost.fit(steps, name="calibrated on the engine replay's steps")
    result["cost_model"] = fitted.describe()
    result["engine_steps"] = len(steps)
    for policy in ("fcfs", "compute-aware"):
        result["sim"][policy] = summarize(replay(requests, fitted, dataclasses.replace(replay_config, policy=policy),
                                                 scale).times)
    for side in ("engine", "sim"):
        fcfs, ours = result[side]["fcfs"]["ttft_p90_s"], result[side]["compute-aware"]["ttft_p90_s"]
        result[f"p90_improvement_{side}"] = round(1 - ours / fcfs, 4) if fcfs else 0.0
    result["improvement_gap_points"] = round(100 * abs(result["p90_improvement_engine"] - result["p90_improvement_sim"]), 1)
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", required=True, help="agentic session directory or Mooncake .jsonl")
    parser.add_argument("--cost-model", default="mimo-v2.5-pro-h200", choices=["mimo-v2.5-pro-h200", "calibrated"],
                        help="step times from MiMo-V2.5-Pro on 8 H200s (analytic), or the engine's own steps "
                             "measured on this machine (demo-size model) and fitted")
    parser.add_argument("--load", type=float, default=0.8, help="utilisation the arrivals are scaled to")
    parser.add_argument("--stagger-s", type=float, default=60.0,
                        help="agentic sessions start this many trace seconds apart")
    parser.add_argument("--open-sessions", action="store_true",
                        help="send every agentic request at its (scaled) trace time, not only once its session's "
                             "previous request is answered")
    parser.add_argument("--engine-replay", action="store_true",
                        help="fcfs against compute-aware on a scaled-down agentic trace through the real engine "
                             "(demo-size model, wall clock) and through the replay (calibrated cost model)")
    parser.add_argument("--limit", type=int, help="first N requests only")
    parser.add_argument("--plot", help="the TTFT CDF per policy to this PNG")


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.engine_replay:
        return engine_comparison(args.trace, args.load, log=log)
    return run_schedule_bench(args.trace, args.cost_model, args.load, args.limit, args.plot, log=log,
                              stagger_s=args.stagger_s, closed_sessions=not args.open_sessions)
