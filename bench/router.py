"""Routing over workers on trace replay: the real ``Router`` in front of N
simulated workers on one virtual clock.

Each worker is what ``swallow bench schedule`` replays -- the engine's
``Scheduler``, ``KVAllocator`` pools and window-safe ``RadixCache``, its
steps timed by the same cost model (one 8xH200 node each) -- with a
``KVEventLog`` under its cache. After each of a worker's steps its events
are drained into the router (which rebuilds, per worker, the window-safe
prefixes it can reuse) and its queued prompt tokens are reported; a
request's first token tells the router its prefill is done. Agent sessions
stay closed (a session's next request is sent once the previous one is
answered), so a slow worker slows its sessions down.

Per route policy: the hit rate (cached prompt tokens over prompt tokens, from
the workers' own cache statistics), the spread of computed tokens (prefill
rows run plus decode tokens) over workers, and TTFT on the virtual clock.
The bound, ``one_big_cache``: the same trace through one worker with N x the
memory (and N x the speed: its arrivals N x further apart, so it runs at the
same load).

The load: arrivals are scaled so that the work the trace needs -- each
prompt past what that one big worker's cache serves, prefilled alone, and
each output token at a 32-row decode step's cost (``replay_load.request_work``)
-- is ``load`` of the N workers' time (``time_scale``). A policy that hits
less than the bound needs more work (its ``work_load``).

Per-worker memory (``NodeMemory``): what is left of a node's HBM for KV once
MiMo-V2.5-Pro's FP8 weights are in, at the share an engine keeps for weights
and KV pools (the rest: activations, CUDA graphs, communication buffers).

Pure logic: no model runs in a replay.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import time
from collections.abc import Callable, Sequence as Seq
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench import log
from bench.prefix_cache import TraceRequest, load_trace, trace_page_size, upper_bound
from bench.replay_cost import AnalyticCost, CostModel
from bench.replay_load import arrival_span, load_scale, served_work, utilisation
from bench.schedule_replay import (
    ReplayConfig,
    ReplayResult,
    ReplayWorker,
    VirtualClock,
    WorkerStats,
    replay,
    replay_workers,
    summarize,
)
from llm_core.model.config import ModelConfig
from llm_core.kv.kv_events import KVEventLog
from llm_core.model.presets import get_preset
from llm_core.cluster.router import ROUTE_POLICIES, Router

__all__ = ["NodeMemory", "RouterDispatch", "memory_sweep", "plot_memory_sweep", "replay_routed", "router_bench",
           "time_scale"]


@dataclass(frozen=True)
class NodeMemory:
    """The KV pools one node can hold next to the model's weights."""

    gpus: int = 8
    gpu_bytes: int = 143_771 << 20  # an H200 as nvidia-smi reports it (140.4 GiB; "141 GB" on the datasheet)
    # Weights plus KV pools; the rest is activations, CUDA graphs and
    # all-to-all buffers (SGLang's ``mem_fraction_static`` on large GPUs).
    static_fraction: float = 0.9
    weights: str = "fp8"  # held as the published checkpoints are (llm_core.plan.weight_bytes)
    kv_bytes_per_element: int = 2  # BF16

    def weight_bytes(self, config: ModelConfig) -> int:
        from llm_core.plan import weight_bytes

        return weight_bytes(config, self.weights).total

    def kv_bytes(self, config: ModelConfig) -> int:
        return int(self.gpus * self.gpu_bytes * self.static_fraction - self.weight_bytes(config))

    def bytes_per_token(self, config: ModelConfig) -> tuple[int, int]:
        """KV bytes of one position in the full pool and in the SWA pool (SWA and MTP layers)."""
        full = len(config.full_layer_ids) * config.full_attention.kv_elements_per_token
        swa = (len(config.sliding_layer_ids) + config.num_mtp_layers) * config.sliding_attention.kv_elements_per_token
        return full * self.kv_bytes_per_element, swa * self.kv_bytes_per_element

    def full_tokens(self, config: ModelConfig, swa_fraction: float) -> int:
        """Full-pool tokens when the SWA pool has ``swa_fraction`` of them."""
        full, swa = self.bytes_per_token(config)
        return max(0, int(self.kv_bytes(config) / (full + swa_fraction * swa)))

    def describe(self, config: ModelConfig, swa_fraction: float) -> dict[str, Any]:
        full, swa = self.bytes_per_token(config)
        return {**asdict(self), "weight_bytes": self.weight_bytes(config),
                "kv_bytes": self.kv_bytes(config), "full_kv_bytes_per_token": full, "swa_kv_bytes_per_token": swa,
                "full_tokens": self.full_tokens(config, swa_fraction)}


PRESET = "mimo-v2.5-pro"  # the model the cost model times


# --------------------------------------------------------------------- replay
class RouterDispatch:
    """The real ``Router`` in front of replay workers: each worker's KV events
    are drained into it and its load reported after each of its steps."""

    def __init__(self, router: Router, workers: Seq[ReplayWorker]) -> None:
        self.router = router
        self.workers = list(workers)
        self.ids = [f"worker-{i}" for i in range(len(workers))]
        self._index = {wid: i for i, wid in enumerate(self.ids)}
        for wid, worker in zip(self.ids, self.workers):
            router.add_worker(wid, worker.cache.geometry())
        self.expected_cached_tokens = 0  # what the router expected the chosen workers to reuse
        self.best_cached_tokens = 0  # what the best worker for each request could have reused

    def route(self, request_id: int, prompt: list[int]) -> int:
        decision = self.router.route(request_id, prompt)
        self.expected_cached_tokens += decision.cached_tokens
        self.best_cached_tokens += decision.best_cached_tokens
        return self._index[decision.worker_id]

    def prefilled(self, request_id: int) -> None:
        self.router.prefill_done(request_id)

    def stepped(self, worker: int) -> None:
        wid, w = self.ids[worker], self.workers[worker]
        assert w.events is not None
        if not self.router.apply_events(wid, w.events.drain()):
            self.router.apply_events(wid, w.events.snapshot())  # a gap: never in one process, but it is the protocol
        self.router.report_load(wid, w.scheduler.queued_tokens(), len(w.scheduler.running))


def replay_routed(requests: Seq[TraceRequest], cost: CostModel, config: ReplayConfig, workers: int,
                  router: Router, time_scale: float) -> tuple[ReplayResult, RouterDispatch]:
    """``requests`` over ``workers`` simulated workers, routed by ``router``."""
    clock = VirtualClock()
    page_size = trace_page_size(list(requests))
    nodes = [ReplayWorker(config, page_size, clock, KVEventLog()) for _ in range(workers)]
    dispatch = RouterDispatch(router, nodes)
    return replay_workers(requests, cost, config, nodes, dispatch, clock, time_scale), dispatch


# -------------------------------------------------------------------- figures
def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b else None


def hit_rate(workers: Seq[WorkerStats]) -> float:
    """Cached prompt tokens over prompt tokens, by the workers' own cache statistics."""
    cached = sum(w.cached_prompt_tokens for w in workers)
    total = cached + sum(w.computed_prompt_tokens for w in workers)
    return cached / total if total else 0.0


def policy_summary(result: ReplayResult, dispatch: RouterDispatch) -> dict[str, Any]:
    computed = [w.computed_tokens for w in result.workers]
    mean = sum(computed) / len(computed)
    prompt_tokens = sum(w.cached_prompt_tokens + w.computed_prompt_tokens for w in result.workers)
    reasons: dict[str, int] = {}
    for (_, reason), n in dispatch.router.decisions.items():
        reasons[reason] = reasons.get(reason, 0) + n
    return {
        "hit_rate": round(hit_rate(result.workers), 4),
        "load_max_over_mean": round(max(computed) / mean, 4) if mean else None,
        **summarize(result.times),
        "utilisation": round(utilisation(result), 4),
        "preemptions": result.preemptions,
        # The router's own view: what it expected the chosen workers to reuse,
        # and what the best worker for each request held.
        "routed_expected_hit_rate": _ratio(dispatch.expected_cached_tokens, prompt_tokens),
        "routed_best_hit_rate": _ratio(dispatch.best_cached_tokens, prompt_tokens),
        "decisions": reasons,
        "workers": [{"requests": sum(t.worker == i for t in result.times), "computed_tokens": w.computed_tokens,
                     "prefill_tokens": w.prefill_tokens, "decode_tokens": w.decode_tokens,
                     "hit_rate": round(hit_rate([w]), 4),
                     "busy_s": round(w.busy_s, 2)}
                    for i, w in enumerate(result.workers)],
    }


@dataclass(frozen=True)
class _Job:
    """One replay of the bench: a route policy over the workers, or (no
    policy) the one big worker."""

    requests: Seq[TraceRequest]
    cost: CostModel
    config: ReplayConfig
    workers: int
    time_scale: float
    policy: str | None = None
    router_options: tuple[tuple[str, float], ...] = ()  # Router keywords: load_weight, max_load_ratio

    def run(self) -> tuple[dict[str, Any], float]:
        start = time.perf_counter()
        if self.policy is None:
            # Its arrivals are N x further apart (N x the speed): its hits compare, its latencies do not.
            result = replay(self.requests, self.cost, self.config, self.time_scale)
            summary: dict[str, Any] = {"hit_rate": round(hit_rate(result.workers), 4), "requests": len(result.times),
                                       "failed": sum(t.failed for t in result.times)}
        else:
            router = Router(self.policy, **dict(self.router_options))
            result, dispatch = replay_routed(self.requests, self.cost, self.config, self.workers, router,
                                             self.time_scale)
            summary = policy_summary(result, dispatch)
            if self.policy == "kv-affinity":
                summary["load_weight"], summary["max_load_ratio"] = router.load_weight, router.max_load_ratio
        # The load in time_scale's measure, at the hits this replay really had.
        work = served_work(result.times, self.cost) / (self.workers * self.time_scale * arrival_span(self.requests))
        summary["work_load"] = round(work, 4)
        return summary, time.perf_counter() - start


def _run_job(job: _Job) -> tuple[dict[str, Any], float]:
    return job.run()


def _run_all(jobs: Seq[_Job], processes: int | None) -> list[tuple[dict[str, Any], float]]:
    """The replays, in ``processes`` processes (None: one per core): they
    share nothing, and a Mooncake replay takes minutes."""
    processes = min(len(jobs), processes or os.cpu_count() or 1)
    if processes <= 1:
        return [job.run() for job in jobs]
    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else None)
    with ProcessPoolExecutor(processes, mp_context=context) as pool:
        return list(pool.map(_run_job, jobs))


# ---------------------------------------------------------------------- bench
def time_scale(requests: Seq[TraceRequest], cost: CostModel, big: ReplayConfig, workers: int, load: float,
               log: Callable[[str], None]) -> tuple[float, float]:
    """The arrival-time factor at which the work the trace needs fills
    ``load`` of the workers' time, and the infinite-cache estimate it starts
    from. The work is ``replay_load.request_work``'s (each prompt prefilled
    alone past its cached prefix, each output token at a 32-row decode
    step's cost) with the prefixes one worker holding all the workers'
    memory serves: what the best router could reach, whatever the policy.
    Busy time is no measure here: spread over N workers, decode batches are
    thin and a worker with one request decoding is busy all the time."""
    estimate = load_scale(requests, cost, load) / workers  # with an infinite cache
    probe = replay(requests, cost, big, estimate * workers)
    scale = served_work(probe.times, cost) / (workers * load * arrival_span(requests))
    log(f"time scale {scale:.4f} (infinite-cache estimate {estimate:.4f})")
    return scale, estimate


def router_bench(trace: str, workers: int = 4, load: float = 0.8, limit: int | None = None,
                 stagger_s: float = 60.0, full_tokens: int | None = None, swa_fraction: float = 0.05,
                 policies: Seq[str] = ROUTE_POLICIES, load_weight: float | None = None,
                 max_load_ratio: float | None = None, node: NodeMemory = NodeMemory(), processes: int | None = None,
                 log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Each route policy over ``workers`` workers, and the one-big-cache bound.

    ``full_tokens``: each worker's full-pool tokens (None: what ``node``
    leaves for KV next to MiMo-V2.5-Pro's weights), with an SWA pool of
    ``swa_fraction`` of it. The trace's clock is scaled so that the work it
    needs is ``load`` of the workers' time (``time_scale``).
    ``load_weight``, ``max_load_ratio``: kv-affinity's (None: the router's
    defaults). The replays run in ``processes`` processes (None: one per
    core)."""
    say = log or (lambda _msg: None)
    preset = get_preset(PRESET)
    cost = AnalyticCost.for_preset(preset)
    if full_tokens is None:
        full_tokens = node.full_tokens(preset, swa_fraction)
    config = ReplayConfig(full_tokens=full_tokens, swa_fraction=swa_fraction)
    big = replace(config, full_tokens=workers * full_tokens)
    requests = load_trace(trace, stagger_s=stagger_s)[:limit]
    scale, estimate = time_scale(requests, cost, big, workers, load, say)
    out: dict[str, Any] = {
        "trace": trace, "requests": len(requests), "prompt_tokens": sum(r.input_tokens for r in requests),
        "workers": workers, "load": load, "time_scale": round(scale, 6),
        "load_measure": "work at the one big cache's hits (prefill alone, decode at 32 rows) over the workers' time",
        "time_scale_infinite_cache": round(estimate, 6), "stagger_s": stagger_s,
        "closed_sessions": config.closed_sessions, "schedule_policy": config.policy,
        "cost_model": cost.describe(),
        "memory_per_worker": {"full_tokens": full_tokens, "swa_tokens": int(full_tokens * swa_fraction),
                              "swa_fraction": swa_fraction, "node": node.describe(preset, swa_fraction)},
        "policies": {},
    }
    options = tuple((k, v) for k, v in (("load_weight", load_weight), ("max_load_ratio", max_load_ratio))
                    if v is not None)
    jobs = [_Job(requests, cost, config, workers, scale, policy, options) for policy in policies]
    jobs.append(_Job(requests, cost, big, 1, scale * workers))
    for job, (summary, seconds) in zip(jobs, _run_all(jobs, processes)):
        summary["replay_s"] = round(seconds, 1)
        if job.policy is None:
            out["one_big_cache"] = {"hit_rate": summary.pop("hit_rate"), "full_tokens": job.config.full_tokens,
                                    "time_scale": round(job.time_scale, 6), **summary}
            say(f"one big cache: hit rate {out['one_big_cache']['hit_rate']}, {seconds:.1f} s to replay")
        else:
            out["policies"][job.policy] = summary
            say(f"{job.policy}: hit rate {summary['hit_rate']}, load max/mean {summary['load_max_over_mean']}, "
                f"ttft p90 {summary['ttft_p90_s']} s, {seconds:.1f} s to replay")
    out["upper_bound"] = round(upper_bound(list(requests)), 4)
    ours, bound = out["policies"].get("kv-affinity"), out["one_big_cache"]["hit_rate"]
    if ours is not None:
        out["gap_to_one_big_cache"] = round(bound - ours["hit_rate"], 4)
        if "round-robin" in out["policies"]:
            out["kv_affinity_vs_round_robin"] = _ratio(ours["hit_rate"], out["policies"]["round-robin"]["hit_rate"])
    return out


def memory_sweep(trace: str, sizes: Seq[int], **kwargs: Any) -> list[dict[str, Any]]:
    """``router_bench`` at each per-worker full-pool size in ``sizes``."""
    return [router_bench(trace, full_tokens=size, **kwargs) for size in sizes]


def plot_memory_sweep(results: Seq[dict[str, Any]], out: str, title: str) -> None:
    """Hit rate per policy and the one-big-cache bound against the memory per worker."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["memory_per_worker"]["full_tokens"] / 1e6 for r in results]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for policy in results[0]["policies"]:
        ax.plot(xs, [r["policies"][policy]["hit_rate"] for r in results], marker="o", label=policy)
    ax.plot(xs, [r["one_big_cache"]["hit_rate"] for r in results], marker="s", linestyle="--", color="grey",
            label=f"one worker with {results[0]['workers']}x the memory")
    ax.set_xscale("log")
    ax.set_xlabel(f"full-pool tokens per worker (M; SWA pool {results[0]['memory_per_worker']['swa_fraction']:.0%})")
    ax.set_ylabel("prompt-token hit rate")
    ax.set_ylim(0, None)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", required=True, help="agentic session directory or Mooncake .jsonl")
    parser.add_argument("--workers", type=int, default=4, help="workers the trace is routed over")
    parser.add_argument("--route-load-weight", type=float, help="kv-affinity's load weight (default: the router's)")
    parser.add_argument("--route-max-load-ratio", type=float, help="kv-affinity's load bound (default: the router's)")
    parser.add_argument("--memory-sweep", help="comma-separated full-pool tokens per worker to replay at (prints "
                                               "{\"sweep\": [...]}; --plot draws hit rate against memory)")
    parser.add_argument("--worker-full-tokens", type=int,
                        help="each worker's full-pool tokens (default: what an 8xH200 node leaves for KV next to "
                             "MiMo-V2.5-Pro's weights)")
    parser.add_argument("--load", type=float, default=0.8, help="utilisation the arrivals are scaled to")
    parser.add_argument("--limit", type=int, help="first N requests only")
    parser.add_argument("--stagger-s", type=float, default=60.0,
                        help="agentic sessions start this many trace seconds apart")
    parser.add_argument("--plot", help="with --memory-sweep: hit rate per policy against memory per worker")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """One replay per policy at --worker-full-tokens; with --memory-sweep, one per
    per-worker memory size in it ({"sweep": [...]}), plotted with --plot."""
    options = dict(workers=args.workers, load=args.load, limit=args.limit, stagger_s=args.stagger_s,
                   load_weight=args.route_load_weight, max_load_ratio=args.route_max_load_ratio, log=log)
    if not args.memory_sweep:
        return router_bench(args.trace, full_tokens=args.worker_full_tokens, **options)
    sizes = [int(float(x)) for x in args.memory_sweep.split(",")]
    results = memory_sweep(args.trace, sizes, **options)
    if args.plot:
        plot_memory_sweep(results, args.plot, f"{Path(args.trace).name}: {args.workers} workers")
    return {"sweep": results}
