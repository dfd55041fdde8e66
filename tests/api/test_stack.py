"""`swallow stack` with real processes on localhost: an API, an encoder and two
workers, routed round-robin here so that every request pair is served by both.

Greedy answers through the stack equal the embedded server's and those of
transformers fed the same embeddings, for text, video, image and audio; a
worker killed mid-stream fails only its own streams, with an error event
within 2 s, and comes back; an encoder killed mid-request fails only that
request; Ctrl-C leaves no process and no shared-memory segment behind.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import threading
import time
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from demo.evaluate import _answer, _request
from api.launch import RunningStack, launch_stack
from api.metrics import ServerMetrics
from api.runtime import ServingModel
from api.chat_service import ChatService
from tests.api.live import HTTP, alive

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "models" / "demo"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack() -> Iterator[RunningStack]:
    with launch_stack(DEMO, "--route-policy", "round-robin", workers=2, encoders=1) as running:
        yield running


def _chat(url: str, question: str, files: list[Path], max_tokens: int = 24) -> dict[str, Any]:
    return chat_response(url, question, files, max_tokens).json()


def chat_response(url: str, question: str, files: list[Path], max_tokens: int = 24) -> httpx.Response:
    """A greedy multipart chat completion (200 asserted)."""
    parts = [{"type": "file", "file": {"file_id": f"f{i}"}} for i in range(len(files))]
    body = {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": question}]}],
            "max_tokens": max_tokens, "temperature": 0}
    uploads = [("request", (None, json.dumps(body), "application/json"))]
    uploads += [(f"f{i}", (f.name, f.read_bytes())) for i, f in enumerate(files)]
    response = HTTP.post(f"{url}/v1/chat/completions", files=uploads, timeout=120)
    assert response.status_code == 200, response.text
    return response


def _transformers_tokens(hf_model: Any, prompt_ids: list[int], spans: list, n: int) -> list[int]:
    """transformers' greedy tokens given the same prompt embeddings (span rows in place)."""
    with torch.no_grad():
        embeds = hf_model.get_input_embeddings()(torch.tensor([prompt_ids]))
        for span in spans:
            embeds[0, span.offset : span.end] = span.embeddings.to(embeds.dtype)
        out = hf_model.generate(inputs_embeds=embeds, attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                                max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0].tolist()  # generated from embeddings alone: only the new tokens


def references_checked_against_transformers(media_dir: dict) -> list[tuple[str, str, list, Any]]:
    """(kind, question, files, the embedded server's greedy answer) for text,
    video, image and audio, each answer's tokens checked against transformers'."""
    from transformers import MiMoV2FlashForCausalLM

    hf_model = MiMoV2FlashForCausalLM.from_pretrained(DEMO, dtype=torch.float32).eval()
    cases = [("text", "Which way does the red circle move?", [])]
    cases += [(kind, question, files) for kind, (question, files) in media_dir.items() if kind != "text"]
    assert {kind for kind, _, _ in cases} >= {"text", "video", "image", "audio"}, sorted(media_dir)

    async def embedded() -> list:
        model = ServingModel(DEMO)
        try:
            chat = ChatService(model, ServerMetrics())
            return [await _answer(chat, _request(question, files, 24)) for _, question, files in cases]
        finally:
            await model.aclose()

    references = asyncio.run(embedded())
    for (kind, _, _), ref in zip(cases, references):
        hf_tokens = _transformers_tokens(hf_model, ref.prompt_ids, ref.spans, len(ref.tokens))
        assert hf_tokens == ref.tokens, f"{kind}: the embedded server differs from transformers"
    return [(kind, question, files, ref) for (kind, question, files), ref in zip(cases, references)]


def test_greedy_answers_match_the_embedded_server_and_transformers(stack: RunningStack, media_dir: dict) -> None:
    for kind, question, files, ref in references_checked_against_transformers(media_dir):
        for _ in range(2):  # round-robin: one answer from each worker
            answer = _chat(stack.url, question, files)
            assert answer["choices"][0]["message"]["content"].strip() == ref.answer, kind
            assert answer["usage"]["completion_tokens"] == len(ref.tokens), kind
            assert answer["usage"]["prompt_tokens"] == len(ref.prompt_ids), kind
    decisions = HTTP.get(f"{stack.url}/stats", timeout=10).json()["routing"]["decisions"]
    assert set(decisions) == {"worker-0", "worker-1"}, decisions


def test_agent_fields_travel_through_the_stack(stack: RunningStack) -> None:
    """Grammars, logprobs and n choices cross the process boundary intact."""
    tool = {"type": "function", "function": {"name": "get_video_info", "parameters": {
        "type": "object", "properties": {"property": {"type": "string", "enum": ["width", "height"]}},
        "required": ["property"], "additionalProperties": False}}}
    body = {"messages": [{"role": "user", "content": "How wide is the video?"}], "max_tokens": 80,
            "temperature": 0, "tools": [tool], "tool_choice": "required", "logprobs": True, "top_logprobs": 2,
            "n": 2, "presence_penalty": 0.5, "parallel_tool_calls": False}
    response = HTTP.post(f"{stack.url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    for choice in answer["choices"]:
        assert choice["finish_reason"] == "tool_calls", choice
        (call,) = choice["message"]["tool_calls"]
        assert json.loads(call["function"]["arguments"])["property"] in ("width", "height")
        entries = choice["logprobs"]["content"]
        assert entries and all(e["logprob"] <= 0 and len(e["top_logprobs"]) == 2 for e in entries)
    assert "cached_tokens" in answer["usage"]["prompt_tokens_details"]


def _long_stream(url: str, events: list[tuple[float, dict[str, Any] | str]], started: threading.Event) -> None:
    """A greedy stream that runs for seconds (EOS ignored), recording (time, event)."""
    body = {"messages": [{"role": "user", "content": "Describe the video."}], "max_tokens": 900,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with HTTP.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[len("data: "):]
            events.append((time.monotonic(), payload if payload == "[DONE]" else json.loads(payload)))
            if len(events) > 3:
                started.set()


def _wait_until(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_a_worker_killed_mid_stream_fails_only_its_streams_and_comes_back(stack: RunningStack) -> None:
    streams = [([], threading.Event()) for _ in range(2)]
    threads = [threading.Thread(target=_long_stream, args=(stack.url, events, started)) for events, started in streams]
    for thread in threads:
        thread.start()
        time.sleep(0.05)  # in order: round-robin puts one on each worker
    for events, started in streams:
        assert started.wait(60), f"the streams did not start; one got {events[:4]}"
    victim = stack.roles["worker-0"]
    pid = victim.current_pid(HTTP)
    assert pid is not None
    before_kill = HTTP.get(f"{stack.url}/stats", timeout=10).json()["routing"]["workers"]["worker-0"]
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    for thread in threads:
        thread.join(120)
    errors = [(t, e) for events, _ in streams for t, e in events if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1, "exactly the killed worker's stream fails"
    error_at, error = errors[0]
    assert error_at - killed_at < 2.0, f"the error came {error_at - killed_at:.2f} s after the kill"
    assert error["error"]["code"] == 503 and "worker-0" in error["error"]["message"], error
    survivor = next(events for events, _ in streams if not any(isinstance(e, dict) and "error" in e
                                                               for _, e in events))
    finishes = [e["choices"][0]["finish_reason"] for _, e in survivor if isinstance(e, dict) and e.get("choices")]
    assert finishes[-1] == "length", "the other worker's stream ran to its end"
    # New requests go to the live worker at once...
    quick = {"messages": [{"role": "user", "content": "How many beeps do you hear?"}], "max_tokens": 4,
             "temperature": 0}
    for _ in range(3):
        assert HTTP.post(f"{stack.url}/v1/chat/completions", json=quick, timeout=60).status_code == 200
    # ...and the supervisor starts the dead one again; it registers from an empty index.
    _wait_until(lambda: HTTP.get(f"{stack.url}/health", timeout=5).json()["workers"].get("worker-0"), 120,
                "worker-0 to come back")
    assert victim.current_pid(HTTP) not in (None, pid)
    for _ in range(2):
        assert HTTP.post(f"{stack.url}/v1/chat/completions", json=quick, timeout=60).status_code == 200
    routing = HTTP.get(f"{stack.url}/stats", timeout=10).json()["routing"]["workers"]["worker-0"]
    assert 1 <= routing["routed"] <= 4, "routed to again, counted from its restart"
    # Its index is the new process's cache, not what the killed one held.
    own_stats = victim.health_url.replace("/health", "/stats")
    _wait_until(lambda: HTTP.get(f"{stack.url}/stats", timeout=10).json()["routing"]["workers"]["worker-0"]
                ["indexed_pages"] == HTTP.get(own_stats, timeout=10).json()["prefix_cache"]["nodes"], 10,
                "the API's index of worker-0 to match its cache")
    assert before_kill["indexed_pages"] > 0, "the killed worker had pages the API had to forget"


def _wav(seconds: int) -> bytes:
    rng = np.random.default_rng(0)
    pcm = (rng.standard_normal(16000 * seconds) * 3000).astype(np.int16)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(pcm.tobytes())
    return buf.getvalue()


def test_an_encoder_killed_mid_request_fails_only_that_request(stack: RunningStack, tmp_path: Path) -> None:
    long_audio = tmp_path / "long.wav"
    long_audio.write_bytes(_wav(1500))  # seconds of encoding on this machine
    result: dict[str, Any] = {}

    def send() -> None:
        result["response"] = _post_file(stack.url, long_audio, "How many beeps do you hear?")

    thread = threading.Thread(target=send)
    thread.start()
    encoder = stack.roles["encoder-0"]
    pid = encoder.current_pid(HTTP)
    assert pid is not None
    time.sleep(1.0)  # uploaded, and being decoded or encoded
    os.kill(pid, signal.SIGKILL)
    # Text does not need the encoder: served meanwhile.
    text = {"messages": [{"role": "user", "content": "Describe the video."}], "max_tokens": 4, "temperature": 0}
    assert HTTP.post(f"{stack.url}/v1/chat/completions", json=text, timeout=60).status_code == 200
    thread.join(60)
    response = result["response"]
    assert response.status_code == 503, response.text
    assert "encoder" in response.json()["error"]["message"]
    _wait_until(lambda: encoder.current_pid(HTTP) not in (None, pid), 120, "the encoder to come back")
    _wait_until(lambda: all(HTTP.get(f"{stack.url}/health", timeout=5).json()["encoders"].values()), 30,
                "the API to see the encoder again")
    short = tmp_path / "short.wav"
    short.write_bytes(_wav(2))
    assert _post_file(stack.url, short, "How many beeps do you hear?").status_code == 200


def _post_file(url: str, path: Path, question: str) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": [{"type": "file", "file": {"file_id": "m"}},
                                                      {"type": "text", "text": question}]}],
            "max_tokens": 4, "temperature": 0}
    return HTTP.post(f"{url}/v1/chat/completions", timeout=120,
                      files=[("request", (None, json.dumps(body), "application/json")),
                             ("m", (path.name, path.read_bytes()))])


def test_ctrl_c_stops_every_process_and_frees_shared_memory(stack: RunningStack) -> None:
    """The module's last test: it stops the stack the others used."""
    pids = [role.current_pid(HTTP) or role.pid for role in stack.roles.values()]
    store = stack.store_name
    assert store and Path(f"/dev/shm/{store}").exists()
    os.kill(stack.pid, signal.SIGINT)
    _wait_until(lambda: not alive(stack.pid), 60, "the supervisor to exit")
    for pid in pids:
        assert not alive(pid), f"process {pid} is still running"
    assert not list(Path("/dev/shm").glob(f"{store}*")), "the shared-memory store was left behind"
