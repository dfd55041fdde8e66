"""`swallow stack --prefill-workers 1 --decode-workers 1`: every request is
prefilled by one worker process and decoded by another, its KV sent between
them through shared memory.

Greedy answers equal the embedded server's (one engine doing both) and
transformers', for text, video, image and audio, with prefix-cache hits on the
prefill side; aborted requests leave every pool of both workers at capacity
and no transfer buffer behind; a prefill worker that stops answering and is
killed with a request in flight gives that request the fallback (prefilled
on the decode worker), not a hang.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.launch import RunningStack, launch_stack
from api.stack.supervisor import GRACE_S
from tests.api.live import HTTP, alive
from tests.api.test_stack import _wait_until, references_checked_against_transformers
from tests.api.test_stack import chat_response as _chat

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "models" / "demo"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack() -> Iterator[RunningStack]:
    with launch_stack(DEMO, "--prefill-workers", "1", "--decode-workers", "1", "--transfer-timeout", "20",
                      encoders=1) as running:
        yield running


def _worker_stats(stack: RunningStack, name: str) -> dict[str, Any]:
    return HTTP.get(stack.roles[name].health_url.replace("/health", "/stats"), timeout=10).json()


def test_disaggregated_answers_match_one_worker_and_transformers(stack: RunningStack, media_dir: dict) -> None:
    cases = references_checked_against_transformers(media_dir)
    received_before = _worker_stats(stack, "worker-1")["disaggregation"]["received"]
    for kind, question, files, ref in cases:
        cached = []
        for _ in range(2):  # the second one reuses the first one's prefix on the prefill worker
            response = _chat(stack.url, question, files)
            assert response.headers["x-swallow-worker"] == "worker-0", kind
            assert response.headers["x-swallow-decode-worker"] == "worker-1", kind
            answer = response.json()
            assert answer["choices"][0]["message"]["content"].strip() == ref.answer, kind
            assert answer["usage"]["completion_tokens"] == len(ref.tokens), kind
            cached.append(answer["usage"]["prompt_tokens_details"]["cached_tokens"])
        if kind != "text":  # media prompts are pages long; the text question fits in one page
            assert cached[0] < cached[1], f"{kind}: no prefix-cache hit on the prefill worker ({cached})"
    decode = _worker_stats(stack, "worker-1")["disaggregation"]
    assert decode["received"] - received_before == 2 * len(cases), decode
    assert decode["fallbacks"] == 0, decode
    assert 0 < decode["bytes_received"] < decode["full_attention_bytes_received"], decode
    prefill = _worker_stats(stack, "worker-0")
    assert prefill["disaggregation"]["prefilled_for_others"] >= 2 * len(cases)
    assert prefill["prefix_cache"]["cached_prompt_tokens"] > 0


def _abandoned_stream(url: str, prompt: str, wait_s: float) -> None:
    """A stream whose client leaves after ``wait_s`` (during the prefill, the
    transfer or the decode: the API notices within half a second)."""
    body = {"prompt": prompt, "max_tokens": 50, "temperature": 0, "ignore_eos": True, "stream": True}
    deadline = time.monotonic() + wait_s
    try:
        with HTTP.stream("POST", f"{url}/v1/completions", json=body, timeout=wait_s) as response:
            for _ in response.iter_raw(1):
                if time.monotonic() > deadline:
                    return
    except httpx.HTTPError:
        pass


def _segments_of(pid: int) -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith(f"swallow-kv-{pid}-")}


def test_aborts_during_transfer_leave_every_pool_at_capacity(stack: RunningStack) -> None:
    prompts = [" ".join(["the red circle moves left and the blue square"] * (8 + 3 * i)) for i in range(6)]
    threads = [threading.Thread(target=_abandoned_stream, args=(stack.url, p, 0.05 + 0.1 * i)) for i, p in
               enumerate(prompts)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)

    def settled() -> bool:
        return all(_worker_stats(stack, name)["running_requests"] == 0 for name in ("worker-0", "worker-1"))

    def aborted_in_transfer() -> int:
        return _worker_stats(stack, "worker-1")["disaggregation"]["aborted_in_transfer"]

    # The clients above are gone, but on a loaded machine their aborts may still
    # be on the way: count from when both workers are idle and the count holds.
    _wait_until(settled, 30, "the abandoned requests to end on both workers")

    def holds() -> bool:
        before = aborted_in_transfer()
        time.sleep(0.5)
        return aborted_in_transfer() == before

    _wait_until(holds, 30, "the count of aborts in transfer to hold")
    # One abort for certain mid-transfer: the prefill worker holds the request
    # (stopped) while the decode worker waits with its slots reserved; when
    # it goes on, the buffer it was to fill is gone.
    aborted = aborted_in_transfer()
    prefill_pid = stack.roles["worker-0"].current_pid(HTTP)
    assert prefill_pid is not None
    os.kill(prefill_pid, signal.SIGSTOP)
    try:
        _abandoned_stream(stack.url, prompts[-1], 0.3)
        time.sleep(1.0)  # the API sees the client gone and aborts; the decode worker was still waiting
    finally:
        os.kill(prefill_pid, signal.SIGCONT)
    assert aborted_in_transfer() == aborted + 1
    _wait_until(settled, 30, "the aborted requests to end on both workers")
    # Frozen past the heartbeat timeout, the prefill worker left the API's routing; the API
    # flushes the workers it routes to, so it must be back first.
    _wait_until(lambda: HTTP.get(f"{stack.url}/health", timeout=5).json()["workers"].get("worker-0"), 30,
                "worker-0 to be routed to again")
    assert HTTP.post(f"{stack.url}/flush_cache", timeout=60).status_code == 200
    for name in ("worker-0", "worker-1"):
        own = _worker_stats(stack, name)
        for pool in ("full_pool", "swa_pool"):
            assert own[pool]["free_tokens"] == own[pool]["capacity_tokens"], (name, pool, own[pool])
    # What is left of the transfer buffers is the decode worker's idle ones, kept for reuse.
    buffers = _worker_stats(stack, "worker-1")["transfer_buffers"]["shm"]
    decode_pid = stack.roles["worker-1"].current_pid(HTTP)
    assert decode_pid is not None
    assert buffers["in_use"] == 0, buffers
    assert len(_segments_of(decode_pid)) == buffers["idle"], "a transfer buffer outlived its request"


def test_a_prefill_worker_stopped_and_killed_mid_transfer_gives_the_fallback(stack: RunningStack) -> None:
    question = "How many beeps do you hear?"
    reference = _chat(stack.url, question, []).json()["choices"][0]["message"]["content"]
    fallbacks = _worker_stats(stack, "worker-1")["disaggregation"]["fallbacks"]
    victim = stack.roles["worker-0"]
    pid = victim.current_pid(HTTP)
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)  # it takes the request and never answers
    try:
        started = time.monotonic()
        result: dict[str, Any] = {}
        asking = threading.Thread(target=lambda: result.update(_chat(stack.url, question, []).json()))
        asking.start()
        time.sleep(1.0)  # the decode worker has asked, and waits
        os.kill(pid, signal.SIGKILL)
        asking.join(60)
        assert result, "the request hung"
        assert result["choices"][0]["message"]["content"] == reference
        assert time.monotonic() - started < 15
    finally:
        os.kill(pid, signal.SIGCONT) if alive(pid) else None
    assert _worker_stats(stack, "worker-1")["disaggregation"]["fallbacks"] == fallbacks + 1
    # The supervisor starts it again, and requests are disaggregated again.
    _wait_until(lambda: HTTP.get(f"{stack.url}/health", timeout=5).json()["workers"].get("worker-0"), 120,
                "worker-0 to come back")
    received = _worker_stats(stack, "worker-1")["disaggregation"]["received"]
    response = _chat(stack.url, question, [])
    assert response.json()["choices"][0]["message"]["content"] == reference
    assert response.headers["x-swallow-decode-worker"] == "worker-1"
    assert _worker_stats(stack, "worker-1")["disaggregation"]["received"] == received + 1


def test_ctrl_c_stops_every_role_without_the_grace_period(stack: RunningStack) -> None:
    """The module's last test. A decode worker holds sockets to prefill workers:
    its stop must close them, not wait on them until the supervisor kills it."""
    assert _chat(stack.url, "How many beeps do you hear?", []).headers["x-swallow-decode-worker"] == "worker-1"
    pids = [role.current_pid(HTTP) or role.pid for role in stack.roles.values()]
    started = time.monotonic()
    os.kill(stack.pid, signal.SIGINT)
    _wait_until(lambda: not alive(stack.pid), 60, "the supervisor to exit")
    assert time.monotonic() - started < GRACE_S - 2, "a role ignored SIGTERM and was killed after the grace period"
    assert not [pid for pid in pids if alive(pid)]
