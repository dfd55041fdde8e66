"""`swallow serve` as a user runs it: a live uvicorn server on localhost."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from llm_core import LLM, SamplingParams
from tests.api.live import HTTP, LiveServer, live_server


@pytest.fixture(scope="module")
def running(tiny_checkpoint: Path) -> Iterator[LiveServer]:
    with live_server(tiny_checkpoint) as live:
        yield live


@pytest.fixture(scope="module")
def server(running: LiveServer) -> str:
    return running.url


@pytest.fixture(scope="module")
def llm(tiny_checkpoint: Path) -> LLM:
    return LLM(tiny_checkpoint)


def test_health_and_models(server: str, tiny_checkpoint: Path) -> None:
    health = HTTP.get(f"{server}/health").json()
    assert health == {"status": "ok", "role": "serve", "engine_core": {"engine-core": True}}
    models = HTTP.get(f"{server}/v1/models").json()
    assert models["data"][0]["id"] == tiny_checkpoint.name


def test_token_id_prompt_matches_offline_generation(server: str, llm: LLM) -> None:
    prompt = list(range(20, 80))
    r = HTTP.post(f"{server}/v1/completions",
                   json={"prompt": prompt, "max_tokens": 12, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    expected = llm.generate([prompt], SamplingParams(max_tokens=12))[0]
    assert body["choices"][0]["token_ids"] == expected.token_ids
    assert body["choices"][0]["text"] == expected.text
    assert body["usage"] == {"prompt_tokens": 60, "completion_tokens": 12, "total_tokens": 72}


def test_text_prompts_with_the_openai_client(server: str, llm: LLM) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    result = client.completions.create(model="tiny", prompt=["the red circle", "a blue square moves"],
                                       max_tokens=8, temperature=0)
    expected = llm.generate(["the red circle", "a blue square moves"], SamplingParams(max_tokens=8))
    assert [c.text for c in result.choices] == [e.text for e in expected]


def test_streaming_sends_tokens_then_done(server: str, llm: LLM) -> None:
    prompt = [7, 8, 9, 10]
    expected = llm.generate([prompt], SamplingParams(max_tokens=10))[0]
    chunks = []
    with HTTP.stream("POST", f"{server}/v1/completions", timeout=60,
                      json={"prompt": prompt, "max_tokens": 10, "temperature": 0, "stream": True,
                            "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    tokens = [t for c in chunks for choice in c["choices"] for t in choice["token_ids"]]
    assert tokens == expected.token_ids
    assert "".join(ch["text"] for c in chunks for ch in c["choices"]) == expected.text
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 10


def test_one_request_id_names_the_response_its_chunks_and_its_header(server: str) -> None:
    body = {"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0, "n": 2}
    r = HTTP.post(f"{server}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["id"].startswith("cmpl-") and r.headers["x-request-id"] == r.json()["id"]
    with HTTP.stream("POST", f"{server}/v1/completions", timeout=60, json=body | {"stream": True}) as streamed:
        ids = {json.loads(line[6:])["id"] for line in streamed.iter_lines()
               if line.startswith("data: ") and line != "data: [DONE]"}
        assert ids == {streamed.headers["x-request-id"]} and ids != {r.json()["id"]}


def test_stop_strings_cut_the_text(server: str, llm: LLM) -> None:
    free = llm.generate(["the time"], SamplingParams(max_tokens=16, ignore_eos=True))[0].text
    stop = free[len(free) // 2 : len(free) // 2 + 2]
    r = HTTP.post(f"{server}/v1/completions", timeout=60,
                   json={"prompt": "the time", "max_tokens": 16, "temperature": 0, "ignore_eos": True, "stop": stop})
    choice = r.json()["choices"][0]
    assert choice["text"] == free[: free.find(stop)]
    assert choice["finish_reason"] == "stop"


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "JSON object"),
        (json.dumps({"prompt": []}).encode(), "'prompt' must be"),
        (json.dumps({"prompt": [1, 2, 10**6]}).encode(), "outside the vocabulary"),
        (json.dumps({"prompt": [5] * 8190, "max_tokens": 100}).encode(), "context length"),
        (json.dumps({"prompt": "hi", "max_tokens": 0}).encode(), "max_tokens"),
        (json.dumps({"prompt": "hi", "temperature": -2}).encode(), "temperature"),
        (json.dumps({"prompt": "hi", "max_tokens": "ten"}).encode(), "'max_tokens' must be an integer"),
        (json.dumps({"prompt": "hi", "n": 17}).encode(), "'n' must be from 1 to 16"),
        (json.dumps({"prompt": "hi", "n": 2, "best_of": 3}).encode(), "'best_of'"),
        (json.dumps({"prompt": "hi", "logprobs": 21}).encode(), "'logprobs' must be an integer from 0 to 20"),
        (json.dumps({"prompt": [5] * 8190, "max_tokens": 100, "stream": True}).encode(), "context length"),
        (b"[" * 100_000 + b"]" * 100_000, "nests too deeply"),
        (b'{"a":' * 100_000 + b"1" + b"}" * 100_000, "nests too deeply"),
        (b'{"prompt": "caf\xe9"}', "not valid JSON"),  # Latin-1, not UTF-8
        (b'{"prompt": "hi", "temperature": NaN}', "NaN is not a JSON value"),
        (b'{"prompt": "hi", "top_p": -Infinity}', "-Infinity is not a JSON value"),
        (b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}", "an integer of 5001 digits is too long"),
        (json.dumps({"prompt": "hi", "temperature": 10**400}).encode(), "'temperature' is out of range"),
        (json.dumps({"prompt": "x\ud800"}).encode(), "'prompt' is not valid Unicode: a lone surrogate"),
        (json.dumps({"prompt": "hi", "stream": "false"}).encode(), "'stream' must be true or false"),
        (json.dumps({"prompt": "hi", "stream_options": "usage"}).encode(), "'stream_options' must be an object"),
    ],
)
def test_bad_requests_get_400_with_a_reason_and_the_server_keeps_serving(
    server: str, body: bytes, reason: str
) -> None:
    r = HTTP.post(f"{server}/v1/completions", content=body, timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert reason in r.json()["error"]["message"]
    ok = HTTP.post(f"{server}/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200


def test_a_request_larger_than_the_kv_pool_is_a_400(tiny_checkpoint: Path) -> None:
    with live_server(tiny_checkpoint, "--kv-budget-mib", "1") as live:
        r = HTTP.post(f"{live.url}/v1/completions", json={"prompt": [5] * 3000, "max_tokens": 10}, timeout=60)
        assert r.status_code == 400
        assert "more KV memory than the pool holds" in r.json()["error"]["message"]


def test_gather_or_cancel_stops_the_others_when_one_fails() -> None:
    import asyncio

    from api.chat_service import gather_or_cancel

    finished: list[str] = []

    async def slow() -> None:
        await asyncio.sleep(5)
        finished.append("slow")

    async def failing() -> None:
        await asyncio.sleep(0.01)
        raise RuntimeError("one prompt failed")

    async def main() -> None:
        with pytest.raises(RuntimeError, match="one prompt failed"):
            await gather_or_cancel([slow(), failing()])
        assert all(task.done() for task in asyncio.all_tasks() if task is not asyncio.current_task())

    asyncio.run(main())
    assert finished == []


def test_stop_strings_are_bounded() -> None:
    from api.chat import MAX_STOP_CHARS, MAX_STOP_STRINGS, BadRequest, parse_stop

    assert parse_stop(["a"] * MAX_STOP_STRINGS) == ("a",) * MAX_STOP_STRINGS
    with pytest.raises(BadRequest, match="at most"):
        parse_stop(["a"] * (MAX_STOP_STRINGS + 1))
    with pytest.raises(BadRequest, match="at most"):
        parse_stop("x" * (MAX_STOP_CHARS + 1))


def test_a_text_model_is_served_without_torch_in_the_api_process(running: LiveServer, server: str) -> None:
    # torch (its import and ~400 MB) belongs to the engine core: the API process
    # of a text-only model templates, tokenises, detokenises and streams.
    r = HTTP.post(f"{server}/v1/chat/completions",
                  json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}, timeout=60)
    assert r.status_code == 200, r.text
    assert HTTP.get(f"{server}/demo/samples").status_code == 200
    maps = Path(f"/proc/{running.pid}/maps").read_text()
    assert "libtorch" not in maps, "the API process loaded torch"
