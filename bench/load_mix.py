"""A seeded load mix against a live server, shared by the load test and
`swallow bench load`.

The mix is what one bad or impatient client must not be able to hurt: greedy
streaming /v1/completions requests with token-id prompts (so every streamed
token can be compared exactly with a reference), a few shared prompt prefixes
(so the prefix cache is exercised), prompts repeated from a small pool (so a
reference per unique prompt stays cheap), 30% of the streams closed by the
client after a random number of tokens, and ~5% malformed requests of several
kinds that must each get a 4xx.

Requests go to 127.0.0.1 only, are bounded in number, and each run is bounded
in time: a request still unanswered when the run's time is up counts as
``timeout``.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import json
import random
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np

__all__ = [
    "InvalidKind",
    "InvalidRequest",
    "GenerationSpec",
    "StreamRequest",
    "LoadRequest",
    "MixConfig",
    "ModelShape",
    "RequestResult",
    "build_mix",
    "engine_stats",
    "flush_cache",
    "output_mismatches",
    "pool_leaks",
    "run_mix",
    "summarize",
    "unique_specs",
    "wait_idle",
]

_LOCAL_HOST = "127.0.0.1"
_FIRST_PROMPT_TOKEN = 3  # below this sit pad / bos / eos in the presets


@dataclass(frozen=True)
class ModelShape:
    """What the mix needs to know of the served model to build valid and invalid requests."""

    vocab_size: int
    max_model_len: int

    @classmethod
    def of_checkpoint(cls, model_dir: str | Path) -> ModelShape:
        from llm_core.model.config import ModelConfig

        config = ModelConfig.from_json_file(Path(model_dir) / "config.json")
        return cls(config.vocab_size, config.max_position_embeddings)


@dataclass(frozen=True)
class MixConfig:
    unique_prompts: int = 40
    shared_prefixes: int = 4
    shared_fraction: float = 0.75  # of unique prompts that start with a shared prefix
    prefix_tokens: tuple[int, int] = (32, 160)
    suffix_tokens: tuple[int, int] = (4, 48)
    solo_prompt_tokens: tuple[int, int] = (8, 200)
    output_tokens: tuple[int, int] = (4, 32)
    cancel_fraction: float = 0.3  # of the well-formed requests
    bad_fraction: float = 0.05


@dataclass(frozen=True)
class GenerationSpec:
    """One unique well-formed request: greedy, so its tokens are a function of these two."""

    prompt: tuple[int, ...]
    max_tokens: int

    def body(self) -> dict[str, Any]:
        # ignore_eos: every stream runs to max_tokens unless cancelled, so load is as planned.
        return {"prompt": list(self.prompt), "max_tokens": self.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}


class InvalidKind(enum.Enum):
    NAN_TEMPERATURE = "nan_temperature"
    MALFORMED_JSON = "malformed_json"
    UNKNOWN_CONTENT_PART = "unknown_content_part"
    OUT_OF_VOCAB_STOP = "out_of_vocab_stop"
    OVERLONG_PROMPT = "overlong_prompt"


@dataclass(frozen=True)
class StreamRequest:
    index: int
    spec: GenerationSpec
    # Close the stream once this many tokens have arrived (0: right after the headers);
    # None: read it to its end.
    cancel_after_tokens: int | None

    @property
    def kind(self) -> str:
        return "stream"


@dataclass(frozen=True)
class InvalidRequest:
    index: int
    bad: InvalidKind
    path: str
    body: bytes

    @property
    def kind(self) -> str:
        return self.bad.value


LoadRequest = StreamRequest | InvalidRequest


@dataclass
class RequestResult:
    index: int
    kind: str  # "stream" or an InvalidKind value
    # completed | cancelled (by the client, as planned) | rejected (4xx) | server_error (5xx)
    # | broken (the stream ended without [DONE], or carried an error) | timeout | connection_error
    outcome: str
    status: int | None = None  # None: no HTTP answer at all
    token_ids: list[int] = field(default_factory=list)
    ttft_s: float | None = None  # request sent -> first chunk carrying a token
    itl_s: list[float] = field(default_factory=list)  # gaps between chunks carrying tokens
    error: str | None = None


# ---------------------------------------------------------------------------------------
# Building the mix
# ---------------------------------------------------------------------------------------


def build_mix(
    num_requests: int, shape: ModelShape, seed: int = 0, config: MixConfig = MixConfig()
) -> list[LoadRequest]:
    """``num_requests`` requests in a seeded order. The unique prompts depend only on
    ``seed`` and ``config``, so mixes of different sizes share them."""
    specs = _make_specs(random.Random(f"{seed}:specs"), shape, config)
    rng = random.Random(f"{seed}:mix:{num_requests}")
    num_bad = max(1, round(num_requests * config.bad_fraction)) if config.bad_fraction > 0 else 0
    num_bad = min(num_bad, num_requests)
    bad_slots = set(rng.sample(range(num_requests), num_bad))
    stream_slots = [i for i in range(num_requests) if i not in bad_slots]
    cancelled = set(rng.sample(stream_slots, round(len(stream_slots) * config.cancel_fraction)))
    # Cycling through the kinds puts every kind in the mix once it has enough bad requests.
    bad_kinds = itertools.cycle(InvalidKind)
    requests: list[LoadRequest] = []
    for i in range(num_requests):
        if i in bad_slots:
            requests.append(_invalid_request(i, next(bad_kinds), shape, rng))
        else:
            spec = rng.choice(specs)
            cancel_at = rng.randrange(spec.max_tokens) if i in cancelled else None
            requests.append(StreamRequest(i, spec, cancel_at))
    return requests


def unique_specs(requests: Iterable[LoadRequest]) -> list[GenerationSpec]:
    return list(dict.fromkeys(r.spec for r in requests if isinstance(r, StreamRequest)))


def _tokens(rng: random.Random, shape: ModelShape, bounds: tuple[int, int]) -> tuple[int, ...]:
    return tuple(rng.randrange(_FIRST_PROMPT_TOKEN, shape.vocab_size) for _ in range(rng.randint(*bounds)))


def _make_specs(rng: random.Random, shape: ModelShape, config: MixConfig) -> list[GenerationSpec]:
    prefixes = [_tokens(rng, shape, config.prefix_tokens) for _ in range(config.shared_prefixes)]
    specs = []
    for _ in range(config.unique_prompts):
        if prefixes and rng.random() < config.shared_fraction:
            prompt = rng.choice(prefixes) + _tokens(rng, shape, config.suffix_tokens)
        else:
            prompt = _tokens(rng, shape, config.solo_prompt_tokens)
        specs.append(GenerationSpec(prompt, rng.randint(*config.output_tokens)))
    return specs


def _invalid_request(index: int, bad: InvalidKind, shape: ModelShape, rng: random.Random) -> InvalidRequest:
    prompt = list(_tokens(rng, shape, (4, 16)))
    completion = {"prompt": prompt, "max_tokens": 8, "stream": True}
    if bad is InvalidKind.NAN_TEMPERATURE:
        body = json.dumps(completion | {"temperature": float("nan")}).encode()  # json writes a bare NaN
    elif bad is InvalidKind.MALFORMED_JSON:
        body = json.dumps(completion).encode()[:-7]  # cut mid-document
    elif bad is InvalidKind.UNKNOWN_CONTENT_PART:
        chat = {"messages": [{"role": "user", "content": [{"type": "hologram", "hologram": {"id": 1}}]}],
                "max_tokens": 8, "stream": True}
        return InvalidRequest(index, bad, "/v1/chat/completions", json.dumps(chat).encode())
    elif bad is InvalidKind.OUT_OF_VOCAB_STOP:
        body = json.dumps(completion | {"temperature": 0, "stop_token_ids": [shape.vocab_size + 17]}).encode()
    else:
        overlong = [rng.randrange(_FIRST_PROMPT_TOKEN, shape.vocab_size) for _ in range(shape.max_model_len)]
        body = json.dumps(completion | {"prompt": overlong}).encode()
    return InvalidRequest(index, bad, "/v1/completions", body)


# ---------------------------------------------------------------------------------------
# Running it
# ---------------------------------------------------------------------------------------


async def run_mix(
    base_url: str,
    requests: Sequence[LoadRequest],
    concurrency: int,
    *,
    time_limit_s: float = 600.0,
    request_timeout_s: float = 120.0,
) -> list[RequestResult]:
    """Send ``requests`` in order with at most ``concurrency`` in flight; one result
    per request, in the same order."""
    _check_local(base_url)
    pending = deque(requests)
    results: dict[int, RequestResult] = {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    # One connection per worker, so none waits for the pool: no pool timeout.
    timeout = httpx.Timeout(request_timeout_s, connect=30.0, pool=None)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=timeout) as client:

        async def worker() -> None:
            while pending:
                request = pending.popleft()
                results[request.index] = await _send(client, request)

        workers = [asyncio.create_task(worker()) for _ in range(min(concurrency, len(requests)))]
        done, late = await asyncio.wait(workers, timeout=time_limit_s)
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)
        for task in done:
            task.result()  # a bug in the client side must not pass for a server failure
    return [results.get(r.index) or RequestResult(r.index, r.kind, "timeout", error="run time limit")
            for r in requests]


def _check_local(base_url: str) -> None:
    host = urlsplit(base_url).hostname
    if host != _LOCAL_HOST:
        raise ValueError(f"the load mix only targets a server on {_LOCAL_HOST}, not {host!r}")


async def _send(client: httpx.AsyncClient, request: LoadRequest) -> RequestResult:
    try:
        if isinstance(request, StreamRequest):
            return await _stream(client, request)
        return await _send_invalid(client, request)
    except httpx.TimeoutException as exc:
        return RequestResult(request.index, request.kind, "timeout", error=repr(exc))
    except httpx.ConnectError as exc:
        return RequestResult(request.index, request.kind, "connection_error", error=repr(exc))
    except httpx.TransportError as exc:  # the server dropped the connection mid-answer
        return RequestResult(request.index, request.kind, "broken", error=repr(exc))


async def _send_invalid(client: httpx.AsyncClient, request: InvalidRequest) -> RequestResult:
    response = await client.post(request.path, content=request.body, headers={"content-type": "application/json"})
    return RequestResult(request.index, request.kind, _outcome_of_status(response.status_code),
                         status=response.status_code, error=response.text[:300])


def _outcome_of_status(status: int) -> str:
    if status >= 500:
        return "server_error"
    return "rejected" if status >= 400 else "completed"


async def _stream(client: httpx.AsyncClient, request: StreamRequest) -> RequestResult:
    result = RequestResult(request.index, request.kind, "broken")
    started = time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=request.spec.body()) as response:
        result.status = response.status_code
        if response.status_code != 200:
            result.outcome = _outcome_of_status(response.status_code)
            result.error = (await response.aread()).decode(errors="replace")[:300]
            return result
        last = started
        if request.cancel_after_tokens == 0:
            result.outcome = "cancelled"
            return result  # leaving the `async with` closes the connection mid-stream
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                result.outcome = "completed"
                return result
            new_tokens, error = _chunk_tokens(data)
            if error is not None:
                result.error = error
                return result
            if not new_tokens:
                continue
            now = time.perf_counter()
            if result.ttft_s is None:
                result.ttft_s = now - started
            else:
                result.itl_s.append(now - last)
            last = now
            result.token_ids.extend(new_tokens)
            if request.cancel_after_tokens is not None and len(result.token_ids) >= request.cancel_after_tokens:
                result.outcome = "cancelled"
                return result
    result.error = "the stream ended without [DONE]"
    return result


def _chunk_tokens(data: str) -> tuple[list[int], str | None]:
    """The token ids of one SSE chunk, or the error it reports."""
    try:
        payload = json.loads(data)
    except json.JSONDecodeError:
        return [], f"not JSON: {data[:200]}"
    if "error" in payload:
        return [], json.dumps(payload["error"])[:300]
    return [t for choice in payload.get("choices", []) for t in choice.get("token_ids", [])], None


# ---------------------------------------------------------------------------------------
# Reading the results
# ---------------------------------------------------------------------------------------


def _percentile(values: Sequence[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 5) if values else None


def summarize(results: Sequence[RequestResult], wall_s: float) -> dict[str, Any]:
    streams = [r for r in results if r.kind == "stream"]
    invalid = [r for r in results if r.kind != "stream"]
    ttfts = [r.ttft_s for r in streams if r.ttft_s is not None]
    itls = [gap for r in streams for gap in r.itl_s]
    output_tokens = sum(len(r.token_ids) for r in streams)
    return {
        "requests": len(results),
        "completed": sum(r.outcome == "completed" for r in streams),
        "cancelled": sum(r.outcome == "cancelled" for r in streams),
        "failed": sum(r.outcome not in ("completed", "cancelled") for r in streams),
        "bad_requests": len(invalid),
        "bad_requests_4xx": sum(r.status is not None and 400 <= r.status < 500 for r in invalid),
        "errors_5xx": sum(r.status is not None and r.status >= 500 for r in results),
        "ttft_p50_s": _percentile(ttfts, 50),
        "ttft_p90_s": _percentile(ttfts, 90),
        "itl_p50_s": _percentile(itls, 50),
        "itl_p90_s": _percentile(itls, 90),
        "output_tokens": output_tokens,
        "output_tok_s": round(output_tokens / wall_s, 2),
        "wall_s": round(wall_s, 3),
    }


def output_mismatches(
    requests: Sequence[LoadRequest], results: Sequence[RequestResult], expected: Mapping[GenerationSpec, list[int]]
) -> list[str]:
    """Streams whose tokens differ from ``expected``: a completed stream must match it
    exactly, a cancelled one must be a prefix of it. Requests ``expected`` has no
    answer for are not checked."""
    found = []
    for request, result in zip(requests, results, strict=True):
        if not isinstance(request, StreamRequest) or result.outcome not in ("completed", "cancelled"):
            continue
        want = expected.get(request.spec)
        if want is None:
            continue
        got = result.token_ids
        ok = got == want if result.outcome == "completed" else got == want[: len(got)]
        if not ok:
            found.append(f"request {request.index} ({result.outcome}): got {got}, expected {want}")
    return found


# ---------------------------------------------------------------------------------------
# Engine stats over HTTP
# ---------------------------------------------------------------------------------------


def engine_stats(base_url: str) -> dict[str, Any]:
    _check_local(base_url)
    response = httpx.get(f"{base_url}/stats", timeout=30)
    response.raise_for_status()
    return response.json()


def wait_idle(base_url: str, timeout_s: float = 60.0, quiet_s: float = 1.5) -> dict[str, Any]:
    """Stats once nothing has run or waited for ``quiet_s``: a stream the client closed
    may still be running until the server notices, and a snapshot is up to 0.5 s old."""
    deadline = time.monotonic() + timeout_s
    idle_since: float | None = None
    while True:
        stats = engine_stats(base_url)
        now = time.monotonic()
        # pending_requests (admitted by the HTTP side, not yet finished) when the server reports it.
        busy = stats["running_requests"] + stats["waiting_requests"] + stats.get("pending_requests", 0)
        if busy == 0:
            idle_since = idle_since if idle_since is not None else now
            if now - idle_since >= quiet_s:
                return stats
        else:
            idle_since = None
        if now > deadline:
            raise TimeoutError(f"the engine did not go idle in {timeout_s} s: {stats}")
        time.sleep(0.25)


def flush_cache(base_url: str) -> dict[str, Any]:
    """Drop every unreferenced cached prefix; the engine stats just after."""
    _check_local(base_url)
    response = httpx.post(f"{base_url}/flush_cache", timeout=30)
    response.raise_for_status()
    answer = response.json()
    if answer.get("flushed") is not True:
        raise RuntimeError(f"/flush_cache did not flush: {answer}")
    return answer["stats"]


def pool_leaks(stats: Mapping[str, Any]) -> dict[str, int]:
    """Tokens each KV pool is short of its capacity (empty when nothing is held)."""
    leaks = {}
    for pool in ("full_pool", "swa_pool"):
        held = stats[pool]["capacity_tokens"] - stats[pool]["free_tokens"]
        if held:
            leaks[pool] = held
    return leaks
