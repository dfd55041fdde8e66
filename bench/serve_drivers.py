"""The sides `swallow bench serve` compares, as drivers: each puts a
``Workload`` through at a concurrency level -- exactly that many requests in
flight while any are left -- and returns a ``Run``, one ``Stream`` (token ids
and when each arrived) per request. The offline driver steps an
``llm_core.LLM`` in this process; the served one streams /v1/completions
from any OpenAI-style server (``Target``) with one asyncio aiohttp client.
``interleaved_levels`` runs every driver over the ``Plan``'s levels in turns.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import numpy as np

from bench import log as log_to_stderr
from bench.load_mix import _chunk_tokens

__all__ = ["REQUEST_TIMEOUT_S", "Driver", "Log", "Plan", "Run", "Stream", "Target", "Workload", "fastest",
           "interleaved_levels", "offline_engine", "offline_run", "served_model_name", "served_run"]

# Compiling servers (and vLLM) take minutes on 2 cores; a request can wait on a compile.
REQUEST_TIMEOUT_S = 600.0

Log = Callable[[str], None]


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
        is spread evenly over its ids, so ITL is per token (bench/serve.py's docstring)."""
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
    log: Log = log_to_stderr


def fastest(runs: Sequence[Run]) -> Run:
    return max(runs, key=lambda run: run.tok_s)


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


async def _stream(session: aiohttp.ClientSession, url: str, body: Mapping[str, Any]) -> Stream:
    stream = Stream(time.perf_counter())
    async with session.post(f"{url}/v1/completions", json=body) as response:
        if response.status != 200:
            detail = (await response.read()).decode(errors="replace")[:300]
            raise RuntimeError(f"/v1/completions answered {response.status}: {detail}")
        async for line in response.content:  # one SSE line at a time
            if not line.startswith(b"data: "):
                continue
            data = line.removeprefix(b"data: ").rstrip()
            if data == b"[DONE]":
                return stream
            ids, error = _chunk_tokens(data.decode())
            if error is not None:
                raise RuntimeError(f"the stream carried an error: {error}")
            stream.receive(ids, time.perf_counter())
    raise RuntimeError("the stream ended without [DONE]")


async def _served_run(target: Target, workload: Workload, concurrency: int) -> Run:
    # aiohttp (C-parsed HTTP), as vLLM's and SGLang's serving benchmarks use: httpx cost this
    # process 150-200 us of CPU per streamed token, on the cores the server under test runs on
    # (docs/benchmarks.md).
    gate = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30.0, sock_read=REQUEST_TIMEOUT_S)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one(i: int) -> Stream:
            async with gate:
                return await _stream(session, target.url, target.body(workload.prompts[i], workload.out_lens[i]))

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
        plan.log(" | ".join(f"{name} c={level}: {fastest(runs[name][level]).tok_s:.1f} tok/s" for name in drivers))
    return runs
