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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from starlette.routing import Route

from api.openapi import openapi_document
from api.runtime import ServingModel
from api.server import create_app
from llm_core.checkpoint import write_random_checkpoint
from llm_core.presets import tiny
from tests.api.live import LiveServer, live_server

# Generated max_tokens are bounded by the context in the schema: a short one keeps them
# cheap to serve on CPU. The documented chat examples need about 100 tokens.
MAX_MODEL_LEN = 256
VOCAB_SIZE = tiny().vocab_size
MODEL_NAME = "fuzz-model"  # the checkpoint directory's name, which the server reports
# Random examples per operation and generation mode (fuzzing phase), on top of the
# coverage phase's boundary cases and the documented examples.
MAX_EXAMPLES = 50

DOCUMENT = openapi_document(MODEL_NAME, VOCAB_SIZE, MAX_MODEL_LEN, ())


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
    config = dataclasses.replace(tiny(), max_position_embeddings=MAX_MODEL_LEN)
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
    published = httpx.get(f"{server.url}/openapi.json")
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
    case = positive[path][method].Case(path_parameters={"file_id": "file-0"} if "{file_id}" in path else None)
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


def test_document_lists_every_route(short_checkpoint: Path) -> None:
    assert _app_routes(short_checkpoint) == {(path, method) for method, path, _ in _documented()}


def _app_routes(model_dir: Path) -> set[tuple[str, str]]:
    """(path, method) of every route create_app serves; HEAD comes with GET for free, and a
    route of another kind (a Mount...) shows up with method "*" so that it cannot go unnoticed."""

    async def build() -> set[tuple[str, str]]:
        model = ServingModel(model_dir)
        try:
            app = create_app(model)
            return {
                (route.path, method)
                for route in app.routes
                for method in (route.methods or () if isinstance(route, Route) else ("*",))
                if method != "HEAD"
            }
        finally:
            await model.aclose()

    return asyncio.run(build())
