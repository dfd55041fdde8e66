"""Property-based fuzzing of a live server from the OpenAPI document it publishes.

Schemathesis generates requests from the document, valid ones (positive mode)
and ones that break it (negative mode): the boundary values of every field
(coverage phase), the documented examples, then random ones (fuzzing phase).
Every answer is checked: never a 5xx, not even inside a 200 stream, and status
code, content type and body exactly as documented. A route the document does
not list fails here too.

The schema is built at import time from ``openapi_document`` (pytest collects
one test per operation from it, before any server runs); the first test
checks that the live server publishes exactly that document. Schemathesis'
own lazy loader (``schemathesis.pytest.from_fixture``) would take it from the
server instead, but 4.32 breaks on pytest 9.2 (it sets ``Item._nodeid``); on
9.2 the per-operation items also share one node id, though each runs and a
failure names its operation.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import schemathesis
from schemathesis.checks import not_a_server_error
from schemathesis.generation.meta import TestPhase
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from starlette.routing import Route

from api.chat import BadRequest, parse_chat_request
from api.openapi import openapi_document
from api.runtime import ServingModel
from api.server import create_app
from demo.routes import DemoRoutes, demo_openapi
from llm_core.loading.checkpoint import write_random_checkpoint
from llm_core.model.presets import tiny
from tests.api.live import HTTP, LiveServer, live_server

# Generated max_tokens are bounded by the context in the schema: a short one keeps them
# cheap to serve on CPU. The documented chat examples need about 100 tokens.
MAX_MODEL_LEN = 256
VOCAB_SIZE = tiny().vocab_size
MODEL_NAME = "fuzz-model"  # the checkpoint directory's name, which the server reports
# Random examples per operation and generation mode (fuzzing phase), on top of the
# coverage phase's boundary cases and the documented examples.
MAX_EXAMPLES = 25

# What `swallow serve` publishes: the API's paths and the demo's, mounted beside it.
DOCUMENT = openapi_document(MODEL_NAME, VOCAB_SIZE, MAX_MODEL_LEN, (), [demo_openapi()])


def _documented() -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(METHOD, path, operation object) of every documented operation."""
    for path, item in DOCUMENT["paths"].items():
        for method, operation in item.items():
            yield method.upper(), path, operation


def _schema(mode: str) -> schemathesis.BaseSchema:
    config = schemathesis.Config.from_dict({
        "seed": 0,
        "generation": {
            "mode": mode,
            "max-examples": MAX_EXAMPLES,
            "deterministic": True,
            "database": "none",
            # Shrinking a failure against a live server takes minutes; it is reported as generated.
            "no-shrink": True,
        },
        "phases": {"stateful": {"enabled": False}},  # no links to follow
        # A failure's curl line must show max_tokens & co., which look like secrets to schemathesis.
        "output": {"sanitization": {"enabled": False}},
    })
    return schemathesis.openapi.from_dict(DOCUMENT, config=config)


positive = _schema("positive")


@positive.hook
def filter_case(ctx: schemathesis.HookContext, case: schemathesis.Case) -> bool:
    """A multipart chat request's `request` part is read exactly as a JSON body is: the coverage phase's
    boundary case of every field, sent both ways, would double the time spent to find nothing new.
    Multipart requests are still fuzzed (fuzzing phase) and sent as documented (examples)."""
    return not (case.meta is not None and case.meta.phase.name == TestPhase.COVERAGE
                and case.media_type == "multipart/form-data" and case.path == "/v1/chat/completions")


@positive.hook
def map_case(ctx: schemathesis.HookContext, case: schemathesis.Case) -> schemathesis.Case:
    """Valid bodies fixed up where drawing each field on its own goes astray."""
    body = case.body
    if case.path == "/v1/chat/completions" and case.media_type == "multipart/form-data" and isinstance(body, dict):
        if isinstance(body.get("request"), dict):
            case.body = body | {"request": _within_decode_budget(body["request"])}
    elif case.path in ("/v1/completions", "/v1/chat/completions") and isinstance(body, dict):
        case.body = _within_decode_budget(body)
        if case.path == "/v1/completions":
            case.body = _best_of_matching_n(case.body)
    return case


def _within_decode_budget(body: dict[str, Any]) -> dict[str, Any]:
    """n choices share the max_tokens drawn: n choices of up to a whole context each would cost seconds of
    CPU decoding per request, and test nothing that n short ones do not."""
    n = body.get("n")
    if not isinstance(n, (int, float)) or n <= 1:
        return body
    return body | {k: max(1, int(body[k] // n)) for k in ("max_tokens", "max_completion_tokens")
                   if isinstance(body.get(k), (int, float))}


def _best_of_matching_n(body: dict[str, Any]) -> dict[str, Any]:
    """best_of must equal n, which JSON Schema cannot say (the document's description does): drawn apart,
    they nearly always differ, and the request never gets past that 400."""
    if body.get("best_of") is None:
        return body
    return body | {"best_of": body["n"] if body.get("n") is not None else 1}


# Only a body can be invalid: any string is a file id, and the other operations take no input.
negative = _schema("negative").include(lambda ctx: "requestBody" in ctx.operation.definition.raw)


def no_server_error_in_stream(ctx: Any, response: schemathesis.Response, case: schemathesis.Case) -> None:
    """A failure after the 200 went out travels as an SSE error event: a server error all the same."""
    if not response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
        return
    for line in response.content.decode().splitlines():
        if line.startswith("data: {"):
            error = json.loads(line.removeprefix("data: ")).get("error") or {}
            assert error.get("code", 0) < 500, f"server error inside the event stream: {error}"


CHECKS = [not_a_server_error, no_server_error_in_stream, status_code_conformance, content_type_conformance,
          response_schema_conformance]


@pytest.fixture(scope="module")
def short_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two layers (one full, one sliding) and no MTP layer: the fuzzing is of the
    API, and its thousands of requests decode three times faster than on ``tiny``'s six."""
    config = dataclasses.replace(tiny(), max_position_embeddings=MAX_MODEL_LEN, num_hidden_layers=2,
                                 layer_types=("full", "sliding"), mlp_layer_types=("dense", "sparse"),
                                 num_mtp_layers=0)
    return write_random_checkpoint(tmp_path_factory.mktemp("fuzz") / MODEL_NAME, config, seed=0)


@pytest.fixture(scope="module")
def server(short_checkpoint: Path) -> Iterator[LiveServer]:
    with live_server(short_checkpoint) as live:
        yield live


@pytest.fixture(scope="module")
def keyed_server(short_checkpoint: Path) -> Iterator[LiveServer]:
    with live_server(short_checkpoint, "--api-key", "sk-fuzz") as live:
        yield live


def _call(case: schemathesis.Case, server: LiveServer) -> schemathesis.Response:
    try:
        return case.call_and_validate(base_url=server.url, checks=CHECKS, timeout=60)
    except BaseException as exc:  # schemathesis' FailureGroup is no Exception
        # A 5xx's traceback is in the server's log; the failure alone only says that it happened.
        exc.add_note(f"server log (tail):\n{server.log()[-4000:]}")
        raise


def test_server_publishes_this_document(server: LiveServer) -> None:
    published = HTTP.get(f"{server.url}/openapi.json")
    assert published.status_code == 200
    assert published.json() == DOCUMENT
    schemathesis.openapi.from_url(f"{server.url}/openapi.json").validate()  # valid OpenAPI 3.1


@positive.parametrize()
def test_valid_requests_are_answered_as_documented(case: schemathesis.Case, server: LiveServer) -> None:
    _call(case, server)


@negative.parametrize()
def test_invalid_requests_are_answered_as_documented(case: schemathesis.Case, server: LiveServer) -> None:
    _call(case, server)


def _examples() -> list[Any]:
    return [
        pytest.param(method, path, media_type, example["value"], id=f"{method} {path} {media_type} {name}")
        for method, path, operation in _documented()
        for media_type, content in operation.get("requestBody", {}).get("content", {}).items()
        for name, example in content.get("examples", {}).items()
    ]


@pytest.mark.parametrize(("method", "path", "media_type", "body"), _examples())
def test_documented_examples_succeed(server: LiveServer, method: str, path: str, media_type: str, body: Any) -> None:
    """Generated requests rarely get a 200 (most break some limit); the examples must, streams included."""
    response = _call(positive[path][method].Case(body=body, media_type=media_type), server)
    assert response.status_code == 200, response.content


def _secured() -> list[Any]:
    return [pytest.param(method, path, id=f"{method} {path}")
            for method, path, operation in _documented() if "security" in operation]


@pytest.mark.parametrize(("method", "path"), _secured())
def test_secured_operations_refuse_a_missing_key_as_documented(
    keyed_server: LiveServer, method: str, path: str
) -> None:
    # The key is checked before anything else, so no body or real file id is needed.
    parameters = {name: "file-0" for name in re.findall(r"{(\w+)}", path)}
    case = positive[path][method].Case(path_parameters=parameters or None)
    assert _call(case, keyed_server).status_code == 401


@pytest.mark.parametrize("media_kinds", [(), ("image", "video"), ("audio",), ("audio", "image", "video")])
def test_document_is_valid_for_any_media(media_kinds: tuple[str, ...]) -> None:
    document = openapi_document(MODEL_NAME, VOCAB_SIZE, MAX_MODEL_LEN, media_kinds)
    schemathesis.openapi.from_dict(document).validate()
    parts = document["components"]["schemas"]["UserMessage"]["properties"]["content"]["anyOf"][1]["items"]["anyOf"]
    assert len(parts) == 1 + len(media_kinds) + bool(media_kinds)  # text, each kind's part, file


def test_document_carries_the_model_limits() -> None:
    properties = DOCUMENT["components"]["schemas"]["CompletionRequest"]["properties"]
    assert properties["max_tokens"]["anyOf"][0]["maximum"] == MAX_MODEL_LEN
    assert properties["top_k"]["anyOf"][1]["maximum"] == VOCAB_SIZE
    assert properties["stop_token_ids"]["anyOf"][0]["items"]["maximum"] == VOCAB_SIZE - 1


_USER = {"role": "user", "content": "Hi."}
_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
_CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}


def _chat(*messages: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"messages": list(messages or [_USER]), **fields}


# Chat bodies on either side of each rule the document states, the ones between fields included.
_CHAT_BODIES = {
    "developer role": _chat({"role": "developer", "content": "Be brief."}, _USER),
    "unknown role": _chat({"role": "robot", "content": "Beep."}),
    "tool calls, null content": _chat(_USER, {"role": "assistant", "content": None, "tool_calls": [_CALL]}),
    "tool calls, no content": _chat(_USER, {"role": "assistant", "tool_calls": [_CALL]}),
    "assistant, null content": _chat(_USER, {"role": "assistant", "content": None}),
    "tool result": _chat(_USER, {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "4"}]}),
    "tool result, no call id": _chat(_USER, {"role": "tool", "content": "4"}),
    "tool result, empty call id": _chat(_USER, {"role": "tool", "tool_call_id": "", "content": "4"}),
    "tools, auto": _chat(tools=[_TOOL], tool_choice="auto", parallel_tool_calls=False),
    "tool name too long": _chat(tools=[{"type": "function", "function": {"name": "x" * 65}}]),
    "tool name with a dot": _chat(tools=[{"type": "function", "function": {"name": "a.b"}}]),
    "tool without type": _chat(tools=[{"function": {"name": "f"}}]),
    "required": _chat(tools=[_TOOL], tool_choice="required"),
    "required, no tools": _chat(tool_choice="required"),
    "required, empty tools": _chat(tools=[], tool_choice="required"),
    "named": _chat(tools=[_TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}}),
    "named, no tools": _chat(tool_choice={"type": "function", "function": {"name": "get_weather"}}),
    "unknown tool_choice": _chat(tools=[_TOOL], tool_choice="any"),
    "required, text format": _chat(tools=[_TOOL], tool_choice="required", response_format={"type": "text"}),
    "required, json format": _chat(tools=[_TOOL], tool_choice="required", response_format={"type": "json_object"}),
    "auto, json format": _chat(tools=[_TOOL], tool_choice="auto", response_format={"type": "json_object"}),
    "json schema": _chat(response_format={"type": "json_schema", "json_schema": {
        "name": "answer", "schema": {"type": "object"}, "strict": True}}),
    "json schema, no name": _chat(response_format={"type": "json_schema", "json_schema": {"schema": {}}}),
    "json schema, missing": _chat(response_format={"type": "json_schema"}),
    "unknown format": _chat(response_format={"type": "xml"}),
    "logprobs": _chat(logprobs=True, top_logprobs=20),
    "top_logprobs, no logprobs": _chat(top_logprobs=2),
    "top_logprobs, logprobs false": _chat(logprobs=False, top_logprobs=0),
    "top_logprobs 21": _chat(logprobs=True, top_logprobs=21),
    "n 16": _chat(n=16),
    "n 17": _chat(n=17),
    "n 0": _chat(n=0),
    "penalties at their bounds": _chat(presence_penalty=-2, frequency_penalty=2, repetition_penalty=10),
    "presence_penalty past 2": _chat(presence_penalty=2.5),
    "repetition_penalty 0": _chat(repetition_penalty=0),
    "thinking": _chat(thinking={"type": "enabled"}),
    "thinking, unknown type": _chat(thinking={"type": "on"}),
    "enable_thinking": _chat(chat_template_kwargs={"enable_thinking": True, "other": 1}),
    "enable_thinking not a bool": _chat(chat_template_kwargs={"enable_thinking": "yes"}),
}


@pytest.mark.parametrize("body", _CHAT_BODIES.values(), ids=_CHAT_BODIES.keys())
def test_chat_request_schema_agrees_with_the_server(body: dict[str, Any]) -> None:
    """The document's request schema accepts exactly the bodies parse_chat_request does (those here)."""
    validator = jsonschema.Draft202012Validator({**DOCUMENT, "$ref": "#/components/schemas/ChatCompletionRequest"})
    try:
        parse_chat_request(body, lambda _: None)
        accepted = True
    except BadRequest:
        accepted = False
    assert validator.is_valid(body) == accepted, f"the server {'accepts' if accepted else 'refuses'} it"


def test_document_lists_every_route(short_checkpoint: Path) -> None:
    assert _app_routes(short_checkpoint) == {(path, method) for method, path, _ in _documented()}


def _app_routes(model_dir: Path) -> set[tuple[str, str]]:
    """(path, method) of every route create_app serves; HEAD comes with GET for free, and a
    route of another kind (a Mount...) shows up with method "*" so that it cannot go unnoticed."""

    async def build() -> set[tuple[str, str]]:
        model = ServingModel(model_dir)
        try:
            app = create_app(model, route_sets=(DemoRoutes,))
            return {
                (route.path, method)
                for route in app.routes
                for method in (route.methods or () if isinstance(route, Route) else ("*",))
                if method != "HEAD"
            }
        finally:
            await model.aclose()

    return asyncio.run(build())
