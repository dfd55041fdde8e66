"""`swallow bench load`: the load mix of bench/load_mix.py against a real
`swallow serve` subprocess (or, with ``stack_workers``, a `swallow stack` of
that many LLM workers: its /stats and /flush_cache answer with the workers'
stats summed, so the same checks apply), at rising concurrency.

Each level starts from a flushed prefix cache and sends the same seeded mix
(greedy streams, 30% cancelled by the client, ~5% bad requests) of the same
size, so levels differ only in how many requests are in flight -- with mixes
sized per level, the larger ones would also repeat prompts more and so hit
the prefix cache more. Figures are compared with the lowest level
(concurrency 1 by default) of the same run, because the machine is shared. Correctness is measured too: every stream's tokens must agree with
the first complete answer seen for the same request (which, at concurrency 1,
is the request served alone), and after each level every KV pool must be back
at capacity once the cache is flushed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from api.launch import RunningServer, RunningStack, launch_server, launch_stack
from api.models import ensure_default_model
from bench.load_mix import (
    GenerationSpec,
    LoadRequest,
    ModelShape,
    RequestResult,
    StreamRequest,
    build_mix,
    flush_cache,
    output_mismatches,
    pool_leaks,
    run_mix,
    summarize,
    wait_idle,
)

__all__ = ["DEFAULT_LEVELS", "load_bench", "plot_load", "requests_per_level"]

DEFAULT_LEVELS = (1, 16, 64, 200)


def requests_per_level(levels: Sequence[int]) -> int:
    """Enough requests that even the highest level keeps its concurrency for a while."""
    return max(32, 2 * max(levels))


def load_bench(
    model_dir: str | Path,
    levels: Sequence[int] = DEFAULT_LEVELS,
    *,
    seed: int = 0,
    num_requests: int | None = None,
    repeats: int = 2,
    time_limit_s: float = 600.0,
    server_args: Sequence[str] = (),
    stack_workers: int | None = None,
) -> dict[str, Any]:
    """One JSON-ready dict: per level the load figures, then ratios against the lowest level.
    Each level runs ``repeats`` times; timings are the fastest run's (noise on a shared
    machine only slows a run down), correctness counts are summed over all runs.
    ``stack_workers``: against `swallow stack --workers N` instead of `swallow serve`."""
    if not levels or min(levels) < 1:
        raise ValueError(f"concurrency levels must be positive, got {list(levels)}")
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    levels = sorted(set(levels))
    shape = ModelShape.of_checkpoint(model_dir)
    # Every level's requests must be admitted: a 429 would measure the limit, not the server.
    server_args = ["--max-pending-requests", str(max(256, max(levels))), *server_args]
    mix = build_mix(num_requests or requests_per_level(levels), shape, seed)
    known_outputs: dict[GenerationSpec, list[int]] = {}
    per_level: dict[str, dict[str, Any]] = {}
    with _launch(model_dir, server_args, stack_workers) as server:
        _warm_up(server.url, stack_workers or 1)
        for level in levels:
            runs = [_run_level(server, mix, level, known_outputs, time_limit_s) for _ in range(repeats)]
            per_level[str(level)] = _fastest_with_all_failures(runs)
        server_tracebacks = _logged_exceptions(server.log())
    _add_ratios(per_level, str(levels[0]))
    return {
        "model": str(model_dir),
        "seed": seed,
        "levels": per_level,
        "baseline_concurrency": levels[0],
        "repeats": repeats,
        "server": "stack" if stack_workers else "serve",
        "stack_workers": stack_workers,
        "server_args": server_args,
        "server_log_tracebacks": server_tracebacks,
    }


@contextmanager
def _launch(model_dir: str | Path, server_args: Sequence[str], stack_workers: int | None) -> Iterator[RunningServer]:
    if stack_workers is None:
        with launch_server(model_dir, *server_args) as server:
            yield server
    else:
        if stack_workers < 1:
            raise ValueError(f"a stack needs at least one worker, got {stack_workers}")
        with launch_stack(model_dir, *server_args, workers=stack_workers) as stack:
            yield stack


def _logged_exceptions(log: str) -> int:
    """Exceptions the server logged: uvicorn prefixes its records with ERROR, the
    server's own loggers print bare messages, but both print a traceback per
    exception (plus one per exception it was chained from)."""
    chained = log.count("The above exception was the direct cause") + log.count("During handling of the above")
    return log.count("Traceback (most recent call last)") - chained


def _warm_up(url: str, workers: int = 1) -> None:
    """A request first (one per worker of a stack, with different prompts: each goes
    to the least loaded), so the lowest level's first TTFT is not a worker's first forward."""
    for i in range(workers):
        body = {"prompt": [5 + i, 6, 7, 8], "max_tokens": 4, "temperature": 0}
        httpx.post(f"{url}/v1/completions", json=body, timeout=120).raise_for_status()


def _run_level(
    server: RunningServer,
    requests: list[LoadRequest],
    concurrency: int,
    known_outputs: dict[GenerationSpec, list[int]],
    time_limit_s: float,
) -> dict[str, Any]:
    before = flush_cache(server.url)  # a cold prefix cache for every run
    pids = _server_pids(server)
    server_cpu, client_cpu = sum(map(_process_cpu_s, pids)), time.process_time()
    started = time.perf_counter()
    results = asyncio.run(run_mix(server.url, requests, concurrency, time_limit_s=time_limit_s))
    wall_s = time.perf_counter() - started
    server_cpu, client_cpu = sum(map(_process_cpu_s, pids)) - server_cpu, time.process_time() - client_cpu
    idle = wait_idle(server.url)
    after_flush = flush_cache(server.url)
    _remember_outputs(requests, results, known_outputs)
    return summarize(results, wall_s) | {
        "concurrency": concurrency,
        "prefix_cache_hit_rate": _hit_rate_between(before, idle),
        "token_mismatches": len(output_mismatches(requests, results, known_outputs)),
        "kv_held_after_flush": pool_leaks(after_flush),
        # Where the 2 cores went: the load generator runs on the same machine as the server.
        "server_cpu_s": round(server_cpu, 2),
        "client_cpu_s": round(client_cpu, 2),
    }


def _server_pids(server: RunningServer) -> list[int]:
    """The server's process, and a stack's role processes (as they are now: a role
    the supervisor restarted has another pid)."""
    pids = [server.pid]
    if isinstance(server, RunningStack):
        pids += [role.current_pid() or role.pid for role in server.roles.values()]
    return pids


def _process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc; 0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    # utime and stime are fields 14 and 15 of stat(5); the split drops the first two.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


_SUMMED_OVER_RUNS = ("errors_5xx", "failed", "token_mismatches")


def _fastest_with_all_failures(runs: list[dict[str, Any]]) -> dict[str, Any]:
    fastest = dict(max(runs, key=lambda run: run["output_tok_s"]))
    for key in _SUMMED_OVER_RUNS:
        fastest[key] = sum(run[key] for run in runs)
    leaks = [run["kv_held_after_flush"] for run in runs if run["kv_held_after_flush"]]
    fastest["kv_held_after_flush"] = leaks[0] if leaks else {}
    return fastest


def _remember_outputs(
    requests: Sequence[LoadRequest], results: Sequence[RequestResult], known: dict[GenerationSpec, list[int]]
) -> None:
    for request, result in zip(requests, results, strict=True):
        if isinstance(request, StreamRequest) and result.outcome == "completed":
            known.setdefault(request.spec, result.token_ids)


def _hit_rate_between(before: Mapping[str, Any], after: Mapping[str, Any]) -> float | None:
    """Prompt-token hit rate of the requests between two stats snapshots (the engine's is cumulative)."""
    if before.get("prefix_cache") is None or after.get("prefix_cache") is None:
        return None
    cached = after["prefix_cache"]["cached_prompt_tokens"] - before["prefix_cache"]["cached_prompt_tokens"]
    computed = after["prefix_cache"]["computed_prompt_tokens"] - before["prefix_cache"]["computed_prompt_tokens"]
    return round(cached / (cached + computed), 4) if cached + computed else None


def _ratio(value: float | None, base: float | None) -> float | None:
    return round(value / base, 3) if value is not None and base else None


def _add_ratios(per_level: dict[str, dict[str, Any]], baseline: str) -> None:
    base = per_level[baseline]
    for figures in per_level.values():
        figures["throughput_vs_c1"] = _ratio(figures["output_tok_s"], base["output_tok_s"])
        figures["ttft_p50_vs_c1"] = _ratio(figures["ttft_p50_s"], base["ttft_p50_s"])
        figures["ttft_p90_vs_c1"] = _ratio(figures["ttft_p90_s"], base["ttft_p90_s"])


def plot_load(result: Mapping[str, Any], out: str | Path) -> None:
    """TTFT p50/p90 and output tokens/s against concurrency, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = sorted(result["levels"].values(), key=lambda f: f["concurrency"])
    xs = [f["concurrency"] for f in levels]
    fig, (latency, throughput) = plt.subplots(1, 2, figsize=(10, 4.2))
    latency.plot(xs, [f["ttft_p50_s"] for f in levels], marker="o", label="TTFT p50")
    latency.plot(xs, [f["ttft_p90_s"] for f in levels], marker="o", label="TTFT p90")
    latency.set_ylabel("time to first token (s)")
    latency.set_yscale("log")  # from milliseconds alone to seconds in a queue
    latency.legend(fontsize=8, loc="best")
    throughput.plot(xs, [f["output_tok_s"] for f in levels], marker="o", color="tab:green")
    throughput.set_ylabel("output tokens/s (all streams)")
    for ax in (latency, throughput):
        ax.set_xscale("log")
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.minorticks_off()
        ax.set_xlabel("concurrent streams")
        ax.grid(alpha=0.3)
    fig.suptitle(f"swallow bench load: {Path(result['model']).name}")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="checkpoint to serve (default: the demo model)")
    parser.add_argument("--levels", help="concurrency levels, comma-separated (default: 1,16,64,200)")
    parser.add_argument("--load-requests", type=int,
                        help="requests at every level (default: max(32, 2 x the highest level))")
    parser.add_argument("--repeats", type=int, default=2, help="runs per level")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument("--stack", type=int, metavar="WORKERS",
                        help="against `swallow stack --workers WORKERS` instead of `swallow serve`")
    parser.add_argument("--plot", help="save TTFT and throughput against concurrency as a PNG here")


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = Path(args.model) if args.model else ensure_default_model()
    levels = [int(level) for level in args.levels.split(",")] if args.levels else DEFAULT_LEVELS
    result = load_bench(model, levels, seed=args.seed, num_requests=args.load_requests, repeats=args.repeats,
                        stack_workers=args.stack)
    if args.plot:
        plot_load(result, args.plot)
        result["plot"] = args.plot
    return result
