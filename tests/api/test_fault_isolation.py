"""One user's bad number must not cost anyone else their answer: bad sampling
values sent while good streams run are refused with a 400 before any 200, and
the good streams finish with exactly the tokens they get without them."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.api.live import HTTP, LiveServer, live_server

GOOD_STREAMS = 10
GOOD_TOKENS = 48

# Raw JSON fragments: NaN and Infinity are literals Python's json accepts, as do many clients.
BAD_SAMPLING = {
    "temperature NaN": '"temperature": NaN',
    "temperature Infinity": '"temperature": Infinity',
    "temperature -Infinity": '"temperature": -Infinity',
    "temperature 1e400": '"temperature": 1e400',
    "temperature 1e-300": '"temperature": 1e-300',
    "temperature 1e-38": '"temperature": 1e-38',
    "temperature -1": '"temperature": -1',
    "top_p NaN": '"top_p": NaN',
    "top_k 1e12": '"top_k": 1000000000000',
    "top_k past the vocabulary": '"top_k": 1000000',
    "stop_token_ids outside the vocabulary": '"stop_token_ids": [5, 1000000]',
    "stop_token_ids negative": '"stop_token_ids": [-1]',
    "seed 2**70": f'"seed": {2**70}',
    "max_tokens 10**100": f'"max_tokens": {10**100}',
}


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Path) -> Iterator[LiveServer]:
    with live_server(tiny_checkpoint, "--no-prefix-caching") as live:
        yield live


def _good_body(i: int) -> dict:
    return {"prompt": list(range(10 + i, 30 + 3 * i)), "max_tokens": GOOD_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}


async def _stream_tokens(client: httpx.AsyncClient, body: dict, started: asyncio.Event | None = None) -> list[int]:
    tokens: list[int] = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                tokens += choice["token_ids"]
            if started is not None and tokens:
                started.set()
    return tokens


def _bad_body(endpoint: str, fragment: str, stream: bool) -> bytes:
    if endpoint == "/v1/completions":
        head = '"prompt": [5, 6, 7], "max_tokens": 8'
    else:
        head = '"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8'
    # A later key wins in JSON objects: the fragment may override max_tokens.
    return f'{{{head}, "stream": {json.dumps(stream)}, {fragment}}}'.encode()


async def _run_with_bad_requests(url: str) -> tuple[list[list[int]], list[tuple[str, int, dict]]]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        started = [asyncio.Event() for _ in range(GOOD_STREAMS)]
        good = [asyncio.ensure_future(_stream_tokens(client, _good_body(i), started[i])) for i in range(GOOD_STREAMS)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
        answers = []
        for name, fragment in BAD_SAMPLING.items():
            for endpoint in ("/v1/completions", "/v1/chat/completions"):
                for stream in (False, True):
                    response = await client.post(endpoint, content=_bad_body(endpoint, fragment, stream),
                                                 headers={"content-type": "application/json"})
                    answers.append((f"{name} {endpoint} stream={stream}", response.status_code, response.json()))
        running = sum(not task.done() for task in good)
        assert running > 0, "the good streams ended before the bad requests were sent: make them longer"
        return list(await asyncio.gather(*good)), answers


async def _run_alone(url: str) -> list[list[int]]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        return list(await asyncio.gather(*(_stream_tokens(client, _good_body(i)) for i in range(GOOD_STREAMS))))


def test_bad_sampling_values_get_400_and_cost_the_other_streams_nothing(server: LiveServer) -> None:
    alone = asyncio.run(_run_alone(server.url))
    with_bad, answers = asyncio.run(_run_with_bad_requests(server.url))
    wrong = [(name, status, body) for name, status, body in answers
             if status != 400 or not body.get("error", {}).get("message")]
    assert not wrong, wrong
    assert with_bad == alone
    assert all(len(tokens) == GOOD_TOKENS for tokens in alone)
    assert _pools_at_capacity(server.url)


def _pools_at_capacity(url: str, timeout: float = 10.0) -> bool:
    """Whether the pools are back at capacity once the engine is idle (its stats
    are a snapshot published after steps, so poll)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = HTTP.get(f"{url}/stats", timeout=10).json()
        idle = stats["running_requests"] == 0 and stats["waiting_requests"] == 0
        if idle and all(stats[p]["free_tokens"] == stats[p]["capacity_tokens"] for p in ("full_pool", "swa_pool")):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
