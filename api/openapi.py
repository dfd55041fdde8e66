"""The OpenAPI 3.1 document the server publishes at ``GET /openapi.json``.

It is built per server because the limits a request must respect are the
served model's own: the vocabulary bounds token ids, ``top_k`` and stop ids;
the context length bounds ``max_tokens``; only the media kinds the model has
encoders for may appear in a chat message. Property-based tests
(tests/api/test_openapi_fuzz.py) fuzz a live server from this document, so it
must say exactly what the server accepts and answers, no more and no less.
Rules between fields are said by the schema where JSON Schema can say them
(``top_logprobs`` needs ``logprobs``; a forced ``tool_choice`` needs ``tools``
and no JSON ``response_format``), by descriptions where it cannot (a named
tool is one of the ``tools``, tool names are distinct, ``best_of`` equals
``n``); breaking one is a 400.

Request objects allow additional properties: like vLLM, the server ignores
OpenAI fields it does not implement (``logit_bias``, ``user``, ``metadata``, ...)
instead of refusing clients that send them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from api.openapi_blocks import (
    Schema, _ERRORS, _content, _error_response, _errors, _event_stream, _json, _ok, _operation, _ref, _text,
)
from api.openapi_schemas import component_schemas

__all__ = ["CHAT_EXAMPLES", "COMPLETION_EXAMPLES", "OPENAPI_VERSION", "openapi_document"]

OPENAPI_VERSION = "3.1.0"



# Requests any served model answers with 200 (tests send each of them).
CHAT_EXAMPLES = {
    "text": {
        "messages": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Say hello."}],
        "max_tokens": 8,
        "temperature": 0,
    },
    "stream": {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Count to three."}]}],
        "max_completion_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 5,
        "seed": 7,
        "stop": ["\n\n"],
    },
    # A closed object of one enum: even a random model finishes the call within max_tokens.
    "forced tool call": {
        "messages": [{"role": "user", "content": "Weather in Rome?"}],
        "tools": [{"type": "function", "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                           "required": ["city"], "additionalProperties": False},
        }}],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_tokens": 64,
        "temperature": 0,
    },
    "tool result, two choices with logprobs": {
        "messages": [
            {"role": "developer", "content": "Use the tools."},
            {"role": "user", "content": "Weather in Rome?"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
            }]},
            {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 C."},
        ],
        "tools": [{"type": "function", "function": {"name": "get_weather"}}],
        "tool_choice": "auto",
        "n": 2,
        "logprobs": True,
        "top_logprobs": 2,
        "max_tokens": 8,
        "seed": 3,
        "stream": True,
    },
    "json schema after thinking, penalties": {
        "messages": [{"role": "user", "content": "Name a colour."}],
        "response_format": {"type": "json_schema", "json_schema": {
            "name": "colour", "schema": {"type": "object", "properties": {"colour": {"type": "string"}}},
        }},
        "thinking": {"type": "enabled"},
        "max_tokens": 16,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.5,
        "repetition_penalty": 1.2,
    },
}
COMPLETION_EXAMPLES = {
    "text": {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0},
    "token ids, streamed": {
        "prompt": [[3, 4, 5], [6, 7]],
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "stop_token_ids": [2],
    },
    "two choices with logprobs": {
        "prompt": "Once upon a time",
        "max_tokens": 8,
        "n": 2,
        "best_of": 2,
        "logprobs": 3,
        "temperature": 0.8,
        "seed": 1,
        "presence_penalty": 0.5,
        "repetition_penalty": 1.1,
    },
}


@dataclass(frozen=True)
class OpenAPIPart:
    """What a set of routes mounted beside the API adds to its document."""

    paths: dict[str, Any]
    schemas: dict[str, Schema] = field(default_factory=dict)


def openapi_document(model_name: str, vocab_size: int, max_model_len: int, media_kinds: Iterable[str],
                     parts: Iterable[OpenAPIPart] = ()) -> dict:
    """The OpenAPI document of a server answering with ``model_name``, with the
    paths and schemas of the route sets mounted beside the API (``parts``)."""
    kinds = sorted(media_kinds)
    parts = list(parts)
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "Swallow",
            "version": "1",
            "description": (
                f"OpenAI-compatible serving of {model_name!r}: vocabulary of {vocab_size} tokens, context of "
                f"{max_model_len} tokens, media input: {', '.join(kinds) or 'none'}."
            ),
        },
        "paths": _paths(kinds) | {path: item for part in parts for path, item in part.paths.items()},
        "components": {
            "schemas": component_schemas(vocab_size, max_model_len, kinds) | {
                name: schema for part in parts for name, schema in part.schemas.items()},
            "responses": {name: _error_response(text) for name, text in _ERRORS.values()},
            "securitySchemes": {
                "bearerAuth": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "Required on /v1/* only when the server was started with an API key.",
                }
            },
        },
    }


# ---------------------------------------------------------------------------------------
# Paths
# ---------------------------------------------------------------------------------------


def _paths(media_kinds: list[str]) -> dict[str, Any]:
    accepted = ", ".join(media_kinds) or "none: this model takes no media, so every upload is refused"
    file_id = [{"name": "file_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    v1 = (401,)
    return {
        "/v1/chat/completions": {
            "post": _operation(
                "Chat completion",
                {
                    **_ok("The completion, or with stream=true its chunks as server-sent events.", {
                        **_json(_ref("ChatCompletion")),
                        **_event_stream({"anyOf": [_ref("ChatCompletionChunk"), _ref("Error")]}),
                    }),
                    **_errors(400, *v1, 413, 415, 429, 503),
                },
                body={
                    **_json(_ref("ChatCompletionRequest"), CHAT_EXAMPLES),
                    **_content("multipart/form-data", _ref("ChatCompletionMultipart"),
                               {"text": {"request": CHAT_EXAMPLES["text"]}},
                               encoding={"request": {"contentType": "application/json"}}),
                },
                secured=True,
            )
        },
        "/v1/completions": {
            "post": _operation(
                "Text completion",
                {
                    **_ok("The completions, or with stream=true their chunks as server-sent events.", {
                        **_json(_ref("TextCompletion")),
                        **_event_stream({"anyOf": [_ref("TextCompletion"), _ref("Error")]}),
                    }),
                    **_errors(400, *v1, 413, 429, 503),
                },
                body=_json(_ref("CompletionRequest"), COMPLETION_EXAMPLES),
                secured=True,
            )
        },
        "/v1/files": {
            "post": _operation(
                "Upload a media file for later chat requests",
                {**_ok("The stored file.", _json(_ref("File"))), **_errors(400, *v1, 413, 415)},
                body={"multipart/form-data": {"schema": _ref("FileUpload")}},
                secured=True,
                description=f"Media this model takes: {accepted}.",
            ),
            "get": _operation("List uploaded files", {**_ok("The files.", _json(_ref("FileList"))), **_errors(*v1)},
                              secured=True),
        },
        "/v1/files/{file_id}": {
            "get": _operation("An uploaded file", {**_ok("The file.", _json(_ref("File"))), **_errors(*v1, 404)},
                              parameters=file_id, secured=True),
            "delete": _operation("Delete an uploaded file",
                                 {**_ok("Deleted.", _json(_ref("FileDeleted"))), **_errors(*v1, 404)},
                                 parameters=file_id, secured=True),
        },
        "/v1/models": {
            "get": _operation("The served model", {**_ok("One model card.", _json(_ref("ModelList"))),
                                                   **_errors(*v1)}, secured=True),
        },
        "/flush_cache": {
            "post": _operation("Empty the prefix cache", {**_ok("Flushed.", _json(_ref("FlushResult"))),
                                                          **_errors(*v1)}, secured=True),
        },
        "/health": {"get": _operation("Readiness", {
            **_ok("Serving.", _json(_ref("Health"))),
            "503": {"description": "Not able to serve now (the stack: no worker answers).",
                    "content": _json(_ref("Health"))}})},
        "/livez": {"get": _operation("Liveness: the process answers", _ok("Alive.", _json(_ref("Alive"))))},
        "/stats": {"get": _operation("Engine statistics", _ok("A snapshot.", _json(_ref("EngineStats"))))},
        "/metrics": {"get": _operation("Prometheus metrics", _ok("Text exposition format.", _text("plain")))},
        "/metrics/summary": {"get": _operation(
            "What SWA saves and what the caches reuse, from the same values as /metrics",
            _ok("A snapshot.", _json(_ref("MetricsSummary"))))},
        "/openapi.json": {"get": _operation("This document", _ok("OpenAPI 3.1.", _json({"type": "object"})))},
    }
