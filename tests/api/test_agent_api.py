"""The OpenAI API an agent expects, through the official ``openai`` client
against a live server on the demo model: tools, reasoning, structured
outputs, logprobs, n choices, penalties."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from llm_core import LLM
from llm_core.model.chat import ChatTemplate
from llm_core.kv.kv_cache import ContiguousAttention, RequestKVCache, Segment
from tests.api.live import DEMO, HTTP, LiveServer

VIDEO_INFO = {
    "type": "function",
    "function": {
        "name": "get_video_info",
        "description": "Facts about the user's video file.",
        "parameters": {
            "type": "object",
            "properties": {"property": {"type": "string", "enum": ["frame_rate", "width", "height", "duration"]}},
            "required": ["property"],
            "additionalProperties": False,
        },
    },
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                       "required": ["city"], "additionalProperties": False},
    },
}
# Every field bounded, so a sampled answer always ends within max_tokens.
SHAPE_SCHEMA = {
    "type": "object",
    "properties": {
        "shape": {"type": "string", "enum": ["circle", "square", "triangle"]},
        "color": {"type": "string", "enum": ["red", "green", "blue", "yellow"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 20},
        "moving": {"type": "boolean"},
        "note": {"type": "string", "maxLength": 8},
    },
    "required": ["shape", "color", "count", "moving", "note"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(demo_server: LiveServer) -> LiveServer:
    return demo_server


@pytest.fixture(scope="module")
def client(server: LiveServer):  # -> openai.OpenAI
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _ask(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


# ----------------------------------------------------------------------------- tools


def test_required_tool_call_is_parsed_into_tool_calls(client) -> None:  # noqa: ANN001
    reply = client.chat.completions.create(model="demo", messages=_ask("What is the frame rate of this video?"),
                                           tools=[VIDEO_INFO, WEATHER], tool_choice="required", max_tokens=120,
                                           temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls  # parallel calls are allowed, but one ends the turn here
    assert call.type == "function" and call.id.startswith("call_")
    tool = {"get_video_info": VIDEO_INFO, "get_weather": WEATHER}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_named_tool_call_streams_as_openai_deltas(client) -> None:  # noqa: ANN001
    kwargs = dict(model="demo", messages=_ask("Tell me about the weather in Paris."), tools=[VIDEO_INFO, WEATHER],
                  tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=120,
                  temperature=0, parallel_tool_calls=False)
    whole = client.chat.completions.create(**kwargs).choices[0]
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in chunks:
        if not chunk.choices:
            continue  # the usage chunk
        for delta in chunk.choices[0].delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
            if delta.id:
                assert not call["id"], "only a call's first delta carries its id"
                call["id"] = delta.id
                assert delta.type == "function" and delta.function.name
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and list(calls) == [0]
    assert calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == json.loads(whole.message.tool_calls[0].function.arguments)
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER["function"]["parameters"])


def test_a_tool_result_round_trip_is_accepted(client) -> None:  # noqa: ANN001
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_video_info", "arguments": json.dumps({"property": "frame_rate"})}}
    messages = [*_ask("What is the frame rate of this video?"),
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"frame_rate": 25})}]
    reply = client.chat.completions.create(model="demo", messages=messages, tools=[VIDEO_INFO], max_tokens=40,
                                           temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert reply.usage.prompt_tokens > 40  # the call and its result are in the prompt


def test_tool_choice_none_and_bad_tools_are_handled(client, server: LiveServer) -> None:  # noqa: ANN001
    reply = client.chat.completions.create(model="demo", messages=_ask("What is the frame rate of this video?"),
                                           tools=[VIDEO_INFO], tool_choice="none", max_tokens=16, temperature=0)
    assert not reply.choices[0].message.tool_calls
    bad = [
        {"tools": [VIDEO_INFO], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
        {"tool_choice": "required"},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
        {"response_format": {"type": "json_object"}, "tools": [VIDEO_INFO], "tool_choice": "required"},
        {"messages": [{"role": "tool", "content": "42"}]},
        {"thinking": {"type": "maybe"}},
        {"logprobs": True, "top_logprobs": 21},
        {"n": 0},
    ]
    for fields in bad:
        body = {"model": "demo", "messages": _ask("hi"), "max_tokens": 4} | fields
        response = HTTP.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 400, (fields, response.text)
        assert response.json()["error"]["message"]


def _video_question(tmp_path: Path, seed: int) -> tuple[list[dict[str, Any]], Any]:
    """A held-out world clip asked one of the file questions, sent inline as file_data."""
    import base64

    import numpy as np

    from demo.render import write_media
    from demo.tasks import make_sample

    sample = make_sample(np.random.default_rng(seed), "video_info")
    (path,) = write_media(sample, tmp_path, "clip")
    data = "data:video/mp4;base64," + base64.b64encode(path.read_bytes()).decode()
    content = [{"type": "file", "file": {"file_data": data, "filename": path.name}},
               {"type": "text", "text": sample.question}]
    return [{"role": "user", "content": content}], sample


@pytest.mark.parametrize("seed", [7, 8])
def test_the_demo_model_calls_its_tool_and_answers_from_the_result(client, tmp_path: Path, seed: int) -> None:  # noqa: ANN001
    """The demo's own tool, chosen by the model (tool_choice auto), then its result
    read back into a sentence: the feature end to end, as the README shows it."""
    from demo.tool_spec import VIDEO_INFO_TOOL, question_property, tool_exchange

    messages, sample = _video_question(tmp_path, seed)
    prop = question_property(sample.question)
    reply = client.chat.completions.create(model="demo", messages=messages, tools=[VIDEO_INFO_TOOL], max_tokens=40,
                                           temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_video_info" and json.loads(call.function.arguments) == {"property": prop}
    exchange = tool_exchange(sample.scene, prop)
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": exchange.result}]
    answer = client.chat.completions.create(model="demo", messages=messages, tools=[VIDEO_INFO_TOOL], max_tokens=40,
                                            temperature=0).choices[0]
    # The reply is the trained sentence for the property asked (its number copied
    # from the result most of the time: `swallow eval-demo` scores how often).
    template = re.escape(exchange.reply).replace(re.escape(exchange.result.split(": ")[1].rstrip("}")), r"[\d.]+")
    assert answer.finish_reason == "stop" and re.fullmatch(template, answer.message.content), answer.message.content
    # Not given the tool, the model says it cannot tell instead of calling one.
    plain = client.chat.completions.create(model="demo", messages=messages[:1], max_tokens=40, temperature=0)
    assert not plain.choices[0].message.tool_calls


def test_the_demo_model_reasons_before_its_tool_call(client, tmp_path: Path) -> None:  # noqa: ANN001
    from demo.tool_spec import VIDEO_INFO_TOOL, question_property

    messages, sample = _video_question(tmp_path, 9)
    reply = client.chat.completions.create(model="demo", messages=messages, tools=[VIDEO_INFO_TOOL], max_tokens=80,
                                           temperature=0, extra_body={"thinking": {"type": "enabled"}})
    message = reply.choices[0].message
    assert "get_video_info" in message.reasoning_content
    assert reply.choices[0].finish_reason == "tool_calls"
    (call,) = message.tool_calls
    assert json.loads(call.function.arguments) == {"property": question_property(sample.question)}


# ----------------------------------------------------------------------------- structured outputs


def test_sampled_json_schema_answers_always_validate(server: LiveServer) -> None:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    response_format = {"type": "json_schema", "json_schema": {"name": "scene", "schema": SHAPE_SCHEMA, "strict": True}}

    async def one(seed: int) -> str:
        reply = await client.chat.completions.create(
            model="demo", messages=_ask("Describe the shape as JSON."), response_format=response_format,
            temperature=1.0, seed=seed, max_tokens=160)
        assert reply.choices[0].finish_reason == "stop"
        return reply.choices[0].message.content

    async def all_of_them() -> list[str]:
        try:
            return await asyncio.gather(*(one(seed) for seed in range(50)))
        finally:
            await client.close()

    answers = asyncio.run(all_of_them())
    for answer in answers:
        jsonschema.validate(json.loads(answer), SHAPE_SCHEMA)
    assert len(set(answers)) > 10  # sampled at temperature 1, not one forced answer


def test_json_object_answers_parse(client) -> None:  # noqa: ANN001
    from llm_core.sample.grammar import GrammarCompiler, GrammarSpec
    from llm_core.model.tokenizer import Tokenizer

    # A JSON object's strings are unbounded, and the demo model never learnt JSON:
    # an answer cut at max_tokens is a prefix the grammar still accepts, a
    # finished one parses.
    tokenizer = Tokenizer(DEMO / "tokenizer.json")
    eos = tokenizer.token_to_id("<|im_end|>")
    compiler = GrammarCompiler.from_file(DEMO / "tokenizer.json", tokenizer.vocab_size, (eos,))
    for seed in range(4):
        choice = client.chat.completions.create(
            model="demo", messages=_ask("What color is the shape?"), response_format={"type": "json_object"},
            max_tokens=60, temperature=1.0, seed=seed).choices[0]
        text = choice.message.content
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(text), dict)
        else:
            assert choice.finish_reason == "length" and text.startswith("{")
            matcher = compiler.matcher(GrammarSpec("json_object"))
            assert all(matcher.consume(t) for t in tokenizer.encode(text)), (text, matcher.error)


# ----------------------------------------------------------------------------- reasoning


def test_thinking_splits_reasoning_from_content(client) -> None:  # noqa: ANN001
    kwargs = dict(model="demo", messages=_ask("What color is the shape?"), max_tokens=60, temperature=0,
                  extra_body={"thinking": {"type": "enabled"}})
    reply = client.chat.completions.create(**kwargs).choices[0].message
    assert reply.reasoning_content  # the prompt opened <think>: what came before </think> is reasoning
    assert "<think>" not in (reply.content or "") and "</think>" not in (reply.content or "")
    streamed = list(client.chat.completions.create(**kwargs, stream=True))
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in streamed if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert reasoning == reply.reasoning_content and content == (reply.content or "")
    off = client.chat.completions.create(**{**kwargs, "extra_body": {"thinking": {"type": "disabled"}}})
    assert off.choices[0].message.reasoning_content is None


def test_thinking_with_a_schema_constrains_only_the_answer(client) -> None:  # noqa: ANN001
    reply = client.chat.completions.create(
        model="demo", messages=_ask("What color is the shape?"), max_tokens=200, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": SHAPE_SCHEMA}},
        extra_body={"thinking": {"type": "enabled"}})
    message = reply.choices[0].message
    if reply.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(message.content), SHAPE_SCHEMA)
    assert message.reasoning_content is not None


# ----------------------------------------------------------------------------- logprobs, n, penalties


def _forward_logprobs(llm: LLM, ids: list[int], start: int) -> torch.Tensor:
    """log-softmax of the model's logits at positions start - 1 ... len(ids) - 2."""
    with torch.inference_mode():
        backend = ContiguousAttention([Segment(RequestKVCache(), 0, len(ids))], "cpu")
        hidden = llm.model(torch.tensor(ids), torch.arange(len(ids)), backend)
        return llm.model.compute_logits(hidden[start - 1 : -1]).float().log_softmax(-1)


def test_logprobs_are_the_models_log_softmax(client, server: LiveServer) -> None:  # noqa: ANN001
    llm = LLM(DEMO, speculative_tokens=0, enable_prefix_caching=False)
    assert llm.tokenizer is not None
    messages = _ask("Which way does the shape move?")
    prompt = llm.tokenizer.encode(ChatTemplate.from_model_dir(DEMO).render(messages))
    chat = client.chat.completions.create(model="demo", messages=messages, max_tokens=8, temperature=0,
                                          logprobs=True, top_logprobs=3).choices[0]
    completion = HTTP.post(f"{server.url}/v1/completions", timeout=60, json={
        "model": "demo", "prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 3}).json()["choices"][0]
    tokens = completion["token_ids"]
    expected = _forward_logprobs(llm, prompt + tokens, len(prompt))
    entries = chat.logprobs.content
    assert len(entries) == len(tokens) == len(completion["logprobs"]["token_logprobs"])
    for i, token in enumerate(tokens):
        assert entries[i].logprob == pytest.approx(float(expected[i, token]), abs=1e-4)
        assert completion["logprobs"]["token_logprobs"][i] == pytest.approx(float(expected[i, token]), abs=1e-4)
        top = expected[i].topk(3)
        assert [e.logprob for e in entries[i].top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert [e.token for e in entries[i].top_logprobs] == [
            llm.tokenizer.decode([t], skip_special_tokens=False) for t in top.indices.tolist()]
        assert bytes(entries[i].bytes) == entries[i].token.encode()
    streamed = client.chat.completions.create(model="demo", messages=messages, max_tokens=8, temperature=0,
                                              logprobs=True, stream=True)
    values = [e.logprob for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert values == pytest.approx([e.logprob for e in entries], abs=1e-6)


def test_n_choices_share_one_prefill(client, server: LiveServer) -> None:  # noqa: ANN001
    HTTP.post(f"{server.url}/flush_cache", timeout=60)
    before = HTTP.get(f"{server.url}/stats", timeout=60).json()["prefix_cache"]
    question = "Describe everything you see and hear in this long question about a shape, please. " * 3
    reply = client.chat.completions.create(model="demo", messages=_ask(question), n=4, max_tokens=12,
                                           temperature=1.0, seed=7)
    after = HTTP.get(f"{server.url}/stats", timeout=60).json()["prefix_cache"]
    prompt = reply.usage.prompt_tokens
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert 4 <= reply.usage.completion_tokens <= 4 * 12
    computed = after["computed_prompt_tokens"] - before["computed_prompt_tokens"]
    cached = after["cached_prompt_tokens"] - before["cached_prompt_tokens"]
    assert computed < prompt + 3 * 16  # one prefill; each further choice recomputes at most its last page
    assert cached >= 3 * (prompt - 16)
    texts = [c.message.content for c in reply.choices]
    assert len(set(texts)) > 1  # seed + i: the choices differ
    again = client.chat.completions.create(model="demo", messages=_ask(question), n=4, max_tokens=12,
                                           temperature=1.0, seed=7)
    assert [c.message.content for c in again.choices] == texts  # and repeat
    assert again.usage.prompt_tokens_details.cached_tokens >= prompt - 16


def test_penalties_change_a_greedy_answer(client) -> None:  # noqa: ANN001
    kwargs = dict(model="demo", messages=_ask("Describe the shape."), max_tokens=40, temperature=0,
                  extra_body={"ignore_eos": True})
    plain = client.chat.completions.create(**kwargs).choices[0].message.content
    penalised = client.chat.completions.create(**kwargs, frequency_penalty=2.0,
                                               presence_penalty=2.0).choices[0].message.content
    assert penalised != plain
    repeated = client.chat.completions.create(**{**kwargs, "extra_body": {"ignore_eos": True,
                                                                        "repetition_penalty": 3.0}})
    assert repeated.choices[0].message.content != plain
