"""`swallow bench stack`: a multi-turn, multi-user chat workload against a live
`swallow stack`, once per route policy (kv-affinity, then round-robin), each
on a fresh stack started with the same arguments but the policy.

The workload is ``bench/stack_workload.py``'s (seeded: users holding
conversations that resend their history and media), the client that plays it
``bench/stack_client.py``'s, and the figures per policy -- the prefix cache's
hit rate and the embedding-cache reuse from the workers' own stats, the
client's latency and TTFT, answers compared across the policies --
``bench/stack_figures.py``'s. This module starts the stacks, runs the
policies in turn and assembles the report.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from api.launch import launch_stack
from api.models import ensure_default_model
from bench import log
from bench.load_mix import engine_stats, flush_cache, pool_leaks, wait_idle
from bench.stack_client import TurnResult, run_workload
from bench.stack_figures import compare_answers, hit_rate, policy_figures
from bench.stack_workload import (
    Workload,
    WorkloadConfig,
    build_workload,
    estimate_prompt_tokens,
    shared_prefix_tokens,
    write_clips,
)

__all__ = ["DEFAULT_POLICIES", "run_policy", "stack_bench"]

DEFAULT_POLICIES = ("kv-affinity", "round-robin")


def _warm_up(url: str, files: Sequence[Path], rounds: int) -> None:
    """Each worker's first forwards and the encoder's first batch of every kind, before
    anything is measured (clips not in the workload, no system prompt)."""
    for i in range(rounds):
        for n, path in enumerate(files):
            body = {"messages": [{"role": "user", "content": [{"type": "file", "file": {"file_id": "w"}},
                                                              {"type": "text", "text": f"Warm up {i} {n}."}]}],
                    "max_tokens": 4, "temperature": 0}
            response = httpx.post(f"{url}/v1/chat/completions", timeout=180,
                                  files=[("request", (None, json.dumps(body), "application/json")),
                                         ("w", (path.name, path.read_bytes()))])
            response.raise_for_status()


def _warm_up_files(seed: int, directory: Path) -> list[Path]:
    from demo.render import write_media
    from demo.tasks import make_sample

    paths = []
    for i, task in enumerate(("video_audio_beeps", "image_shape", "audio_beeps")):
        sample = make_sample(np.random.default_rng([seed, 10_000 + i]), task)
        paths += write_media(sample, directory, f"warm-{i}")
    return paths


def run_policy(model_dir: str | Path, policy: str, workload: Workload, files: Mapping[str, Path],
               warm_files: Sequence[Path], *, workers: int, stack_args: Sequence[str] = (),
               shared_prefix: int = 0, log: Callable[[str], None] | None = None) -> tuple[dict[str, Any], list[TurnResult]]:
    started = time.perf_counter()
    with launch_stack(model_dir, "--route-policy", policy, *stack_args, workers=workers) as stack:
        startup_s = time.perf_counter() - started
        if log:
            log(f"{policy}: stack up in {startup_s:.1f} s; warming up")
        _warm_up(stack.url, warm_files, rounds=workers)
        flush_cache(stack.url)  # the warm-up's prefixes are not the workload's
        before = wait_idle(stack.url)
        if log:
            log(f"{policy}: {workload.num_requests} requests from {len(workload.conversations)} users")
        t0 = time.perf_counter()
        results = asyncio.run(run_workload(stack.url, workload, files))
        wall_s = time.perf_counter() - t0
        after = wait_idle(stack.url)
        leaks = pool_leaks(flush_cache(stack.url))
        logged = _logged_exceptions(stack.log())
        policy_reported = engine_stats(stack.url).get("routing", {}).get("policy")
    figures = policy_figures(results, before, after, wall_s, shared_prefix)
    figures |= {"policy_reported": policy_reported, "stack_startup_s": round(startup_s, 1),
                "kv_held_after_flush": leaks, "stack_log_tracebacks": logged,
                "runtime_s": round(time.perf_counter() - started, 1)}
    if log:
        log(f"{policy}: prefix hit rate {figures['prefix_hit_rate']}, {figures['completed']}/{figures['requests']} "
            f"completed in {wall_s:.1f} s")
    return figures, results


def _logged_exceptions(log: str) -> int:
    chained = log.count("The above exception was the direct cause") + log.count("During handling of the above")
    return log.count("Traceback (most recent call last)") - chained


_PER_RUN = ("prefix_hit_rate", "cached_prompt_tokens", "computed_prompt_tokens", "router_expected_cached_tokens",
            "load_max_over_mean", "ttft_p50_s", "ttft_p90_s", "latency_p50_s", "latency_p90_s", "output_tok_s",
            "completed")


def _over_runs(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The first run's figures in full, each run's headline figures, and the hit rate
    pooled over the runs (their cached and computed tokens summed)."""
    out = dict(runs[0])
    cached = sum(r["cached_prompt_tokens"] for r in runs)
    computed = sum(r["computed_prompt_tokens"] for r in runs)
    out["runs"] = {key: [r[key] for r in runs] for key in _PER_RUN} | {
        "cross_worker_reuse_items": [r["embeddings"]["cross_worker_reuse_items"] for r in runs],
        "turns_on_previous_turns_worker": [r["reuse_model"]["turns_on_previous_turns_worker"] for r in runs],
        "kv_held_after_flush": [r.get("kv_held_after_flush") for r in runs],
    }
    out["prefix_hit_rate_pooled"] = hit_rate(cached, computed)
    out["computed_prompt_tokens_pooled"] = computed
    return out


def stack_bench(
    model_dir: str | Path,
    workers: int = 2,
    users: int = 16,
    turns: int = 5,
    seed: int = 0,
    *,
    repeats: int = 1,
    policies: Sequence[str] = DEFAULT_POLICIES,
    config: WorkloadConfig | None = None,
    stack_args: Sequence[str] = (),
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """The workload ``repeats`` times per policy (policies alternating), each run on a
    fresh `swallow stack --workers WORKERS`; one JSON-ready dict. Per policy: the
    first run's figures in full, every run's headline figures under ``runs``, and
    the hit rate pooled over the runs (round-robin's depends on how arrivals
    interleave, so it varies from run to run)."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    started = time.perf_counter()
    config = config or WorkloadConfig(users=users, turns=turns)
    workload = build_workload(seed, config)
    bound = max(estimate_prompt_tokens(workload, model_dir))
    shared = shared_prefix_tokens(workload, model_dir)
    figures: dict[str, list[dict[str, Any]]] = {policy: [] for policy in policies}
    runs: dict[str, list[TurnResult]] = {}
    with tempfile.TemporaryDirectory(prefix="swallow-bench-stack-") as tmp:
        files = write_clips(workload, Path(tmp))
        warm = _warm_up_files(seed, Path(tmp))
        for i in range(repeats):
            for policy in policies:
                run, runs[f"{policy} #{i + 1}"] = run_policy(model_dir, policy, workload, files, warm,
                                                             workers=workers, stack_args=stack_args,
                                                             shared_prefix=shared, log=log)
                figures[policy].append(run)
    per_policy = {policy: _over_runs(runs_of) for policy, runs_of in figures.items()}
    out: dict[str, Any] = {
        "model": str(model_dir),
        "workers": workers,
        "repeats": repeats,
        "workload": workload.describe() | {"prompt_tokens_bound": bound, "shared_prefix_tokens": shared,
                                       "conversations": [
            {"user": c.user, "first_media": c.kind, "clip": c.clip.name if c.clip else None,
             "clip_task": c.clip.task if c.clip else None, "shares_clip_of": c.shares_clip_of,
             "start_s": c.start_s, "questions": list(c.questions)} for c in workload.conversations]},
        "policies": per_policy,
    }
    if "kv-affinity" in per_policy and "round-robin" in per_policy:
        kv, rr = per_policy["kv-affinity"], per_policy["round-robin"]
        out["kv_affinity_vs_round_robin_hit_rate"] = _ratio(kv["prefix_hit_rate_pooled"],
                                                            rr["prefix_hit_rate_pooled"])
        out["kv_affinity_vs_round_robin_hit_rate_per_run"] = [
            _ratio(a, b) for a, b in zip(kv["runs"]["prefix_hit_rate"], rr["runs"]["prefix_hit_rate"], strict=True)]
        out["kv_affinity_vs_round_robin_computed_tokens"] = _ratio(kv["computed_prompt_tokens_pooled"],
                                                                   rr["computed_prompt_tokens_pooled"])
    out |= compare_answers(runs)
    out["runtime_s"] = round(time.perf_counter() - started, 1)
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="checkpoint to serve (default: the demo model)")
    parser.add_argument("--workers", type=int, default=2, help="LLM workers of each stack")
    parser.add_argument("--users", type=int, default=16, help="users, each holding one conversation")
    parser.add_argument("--turns", type=int, default=5, help="turns per conversation")
    parser.add_argument("--repeats", type=int, default=2, help="runs per policy")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = Path(args.model) if args.model else ensure_default_model()
    return stack_bench(model, workers=args.workers, users=args.users, turns=args.turns, seed=args.seed,
                       repeats=args.repeats, log=log)
