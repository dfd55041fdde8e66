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

from api.chat import MAX_CHOICES, MAX_STOP_CHARS, MAX_STOP_STRINGS
from api.structured import _NAME as _TOOL_NAME
from api.structured import MAX_TOOLS
from llm_core.sampling import (
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MIN_REPETITION_PENALTY,
    MAX_SEED,
    MAX_TEMPERATURE,
    MAX_TOP_LOGPROBS,
    MIN_SEED,
    MIN_TEMPERATURE,
)

__all__ = ["CHAT_EXAMPLES", "COMPLETION_EXAMPLES", "OPENAPI_VERSION", "openapi_document"]

OPENAPI_VERSION = "3.1.0"

Schema = dict[str, Any]

# Error statuses the server answers with, and why, as components/responses.
_ERRORS = {
    400: ("BadRequest", "The request is malformed or breaks a limit; the message says which."),
    401: ("Unauthorized", "The server has an API key and the request did not carry it."),
    404: ("NotFound", "No such resource."),
    413: ("PayloadTooLarge", "The body or an uploaded file is larger than the server accepts."),
    415: ("UnsupportedMediaType", "A file is not an image, video or audio format the server decodes."),
    429: ("TooManyRequests", "The engine queue is full; retry later."),
    503: ("ServiceUnavailable", "The media encoders are overloaded, or the engine is being rebuilt or shutting "
                                "down; retry shortly."),
}
# The engine's "error" finish never reaches a client: it becomes a 500 or an error event.
_FINISH_REASONS = ["stop", "length"]
# Chat's stop after tool calls is OpenAI's "tool_calls".
_CHAT_FINISH_REASONS = [*_FINISH_REASONS, "tool_calls"]
# Tool and response-format names, as api.structured checks them (JSON Schema patterns are unanchored).
_TOOL_NAME_PATTERN = f"^{_TOOL_NAME.pattern}$"

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
# Content part "type" per media kind the model may take.
_MEDIA_PARTS = {"image": "image_url", "video": "video_url", "audio": "input_audio"}


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
            "schemas": _schemas(vocab_size, max_model_len, kinds) | {
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
# Building blocks
# ---------------------------------------------------------------------------------------


def _ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: Schema, examples: dict[str, Any] | None = None) -> dict[str, Any]:
    return _content("application/json", schema, examples)


def _text(subtype: str) -> dict[str, Any]:
    return _content(f"text/{subtype}", {"type": "string"})


def _content(
    media_type: str, schema: Schema, examples: dict[str, Any] | None = None, **extra: Any
) -> dict[str, Any]:
    entry: dict[str, Any] = {"schema": schema, **extra}
    if examples:
        entry["examples"] = {name: {"value": value} for name, value in examples.items()}
    return {media_type: entry}


def _ok(description: str, content: dict[str, Any]) -> dict[str, Any]:
    return {"200": {"description": description, "content": content}}


def _errors(*statuses: int) -> dict[str, Any]:
    return {str(s): {"$ref": f"#/components/responses/{_ERRORS[s][0]}"} for s in statuses}


def _error_response(description: str) -> dict[str, Any]:
    return {"description": description, "content": _json(_ref("Error"))}


def _event_stream(chunk: Schema) -> dict[str, Any]:
    """Server-sent events, each ``data:`` a JSON chunk, the last one ``[DONE]``."""
    data = {
        "type": "string",
        "if": {"const": "[DONE]"},
        "else": {"contentMediaType": "application/json", "contentSchema": chunk},
    }
    return {
        "text/event-stream": {
            "schema": {"type": "object", "required": ["data"], "properties": {"data": data}},
        }
    }


def _operation(
    summary: str,
    responses: dict[str, Any],
    *,
    body: dict[str, Any] | None = None,
    parameters: list[dict[str, Any]] | None = None,
    secured: bool = False,
    description: str | None = None,
) -> dict[str, Any]:
    operation: dict[str, Any] = {"summary": summary, "responses": responses}
    if description is not None:
        operation["description"] = description
    if body is not None:
        operation["requestBody"] = {"required": True, "content": body}
    if parameters:
        operation["parameters"] = parameters
    if secured:
        # `{}`: no credentials is fine too, when the server has no API key.
        operation["security"] = [{"bearerAuth": []}, {}]
    return operation


def _object(properties: dict[str, Schema], required: Iterable[str] = (), **extra: Any) -> Schema:
    schema: Schema = {"type": "object", "properties": properties, **extra}
    if required:
        schema["required"] = list(required)
    return schema


def _closed_object(properties: dict[str, Schema], required: Iterable[str] = (), **extra: Any) -> Schema:
    """A response object: nothing but these properties, all of them always present unless ``required`` says
    which are."""
    return _object(properties, required or properties, additionalProperties=False, **extra)


def _const(value: Any) -> Schema:
    return {"const": value}


def _int_range(low: int, high: int) -> Schema:
    return {"type": "integer", "minimum": low, "maximum": high}


def _nullable(schema: Schema) -> Schema:
    return {"anyOf": [schema, {"type": "null"}]}


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


# ---------------------------------------------------------------------------------------
# Schemas
# ---------------------------------------------------------------------------------------


def _schemas(vocab_size: int, max_model_len: int, media_kinds: list[str]) -> dict[str, Schema]:
    return {
        **_request_schemas(vocab_size, max_model_len, media_kinds),
        **_message_schemas(media_kinds),
        **_tool_request_schemas(),
        **_response_schemas(media_kinds),
    }


def _request_schemas(vocab_size: int, max_model_len: int, media_kinds: list[str]) -> dict[str, Schema]:
    token_id = _int_range(0, vocab_size - 1)
    sampling = _sampling_properties(vocab_size, max_model_len, token_id)
    model = {"type": "string", "description": "Ignored: the server serves one model."}
    return {
        "ChatCompletionRequest": _object(_chat_properties(model, sampling), ["messages"],
                                         anyOf=_chat_field_dependencies()),
        "ChatCompletionMultipart": _object(
            {"request": _ref("ChatCompletionRequest")},
            ["request"],
            description=(
                "The JSON body in the `request` part; every other part is a file that image_url/video_url/file "
                "parts name by its form field name."
            ),
            **_other_form_fields({"type": "string", "contentMediaType": "application/octet-stream"}),
        ),
        "CompletionRequest": _object(
            {
                "model": model,
                "prompt": {
                    "anyOf": [
                        {"type": "string", "minLength": 1},
                        {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
                        {"type": "array", "minItems": 1, "items": token_id},
                        {"type": "array", "minItems": 1,
                         "items": {"type": "array", "minItems": 1, "items": token_id}},
                    ],
                    "description": "Text, token ids, or a list of either: n completions each.",
                },
                **sampling,
                "max_tokens": {**sampling["max_tokens"], "default": 16},
                "n": _choice_count(),
                "best_of": {
                    **_nullable(_int_range(1, MAX_CHOICES)),
                    "description": "Only equal to n (or null): every choice is returned, none is held back.",
                },
                # The legacy form: a count of alternatives, where chat has a flag and top_logprobs.
                "logprobs": {
                    **_nullable(_int_range(0, MAX_TOP_LOGPROBS)),
                    "description": "Each token's log-probability and its k most likely alternatives; null: none.",
                },
            },
            ["prompt"],
        ),
        "FileUpload": _object(
            {
                "file": {"type": "string", "minLength": 1, "contentMediaType": "application/octet-stream",
                         "description": "An image, video or audio file (sniffed from its bytes)."},
                "purpose": {"type": "string"},
            },
            ["file"],
            **_other_form_fields({"type": "string", "description": "Ignored."}),
        ),
    }


def _chat_properties(model: Schema, sampling: dict[str, Schema]) -> dict[str, Schema]:
    """The chat request's fields: the shared sampling ones, then chat's own."""
    nullable_bool = _nullable({"type": "boolean"})
    return {
        "model": model,
        "messages": {"type": "array", "minItems": 1, "items": _ref("Message")},
        "max_completion_tokens": {**sampling["max_tokens"], "description": "Takes precedence over max_tokens."},
        **sampling,
        "n": _choice_count(),
        "logprobs": {**nullable_bool, "default": False,
                     "description": "Each generated token's log-probability, in choices[].logprobs."},
        "top_logprobs": {
            **_nullable(_int_range(0, MAX_TOP_LOGPROBS)),
            "description": "How many of the most likely alternatives each token lists (default 0); only with "
                           "logprobs: true.",
        },
        "tools": {
            **_nullable({"type": "array", "maxItems": MAX_TOOLS, "items": _ref("Tool")}),
            "description": "Functions the model may call; their names must be distinct.",
        },
        "tool_choice": {
            "anyOf": [{"enum": ["none", "auto", "required"]}, _ref("NamedToolChoice"), {"type": "null"}],
            "description": (
                "Default: auto with tools, none without. required (at least one call) and a named function (a "
                "call to it) force tool calls: they need tools, the name must be one of them, and response_format "
                "cannot then ask for JSON."
            ),
        },
        "parallel_tool_calls": {**nullable_bool, "default": True,
                                "description": "With a forced tool call: false allows exactly one call."},
        "response_format": {
            "anyOf": [_ref("TextFormat"), _ref("JsonObjectFormat"), _ref("JsonSchemaFormat"), {"type": "null"}],
            "description": "JSON output, held to the schema if one is given; not with a tool_choice that forces "
                           "tool calls.",
        },
        "thinking": {
            **_nullable(_object({"type": {"enum": ["enabled", "disabled"]}}, ["type"])),
            "description": "Reasoning on or off (default off); when given, chat_template_kwargs is not read.",
        },
        "chat_template_kwargs": _nullable(_object({
            "enable_thinking": {**nullable_bool, "default": False},
        }, description="Only enable_thinking is read.")),
    }


def _chat_field_dependencies() -> list[Schema]:
    """The rules between chat fields that JSON Schema can say (a named tool being one of the tools it
    cannot), as the ways to keep all of them: said here, the fuzzer also builds requests that keep them,
    which get past validation. Spelled as one anyOf of plain objects, not if/then or an allOf: the fuzzer
    builds boundary cases from those only by filtering, and so builds few."""
    # top_logprobs needs logprobs: true.
    logprobs = [
        ({"top_logprobs": {"type": "null"}}, []),
        ({"logprobs": _const(True)}, ["logprobs"]),
    ]
    # A forced tool call needs tools, and leaves no room for JSON output.
    tools = [
        ({"tool_choice": {"enum": ["none", "auto", None]}}, []),
        ({"tools": {"type": "array", "minItems": 1},
          "response_format": {"anyOf": [{"type": "null"}, _ref("TextFormat")]}}, ["tools"]),
    ]
    return [_object({**p1, **p2}, [*r1, *r2]) for p1, r1 in logprobs for p2, r2 in tools]


def _choice_count() -> Schema:
    return {**_nullable(_int_range(1, MAX_CHOICES)), "default": 1,
            "description": "Choices to generate: the prompt is computed once, then each decodes on its own."}


def _sampling_properties(vocab_size: int, max_model_len: int, token_id: Schema) -> dict[str, Schema]:
    """Fields both completion endpoints read, with the ranges SamplingParams enforces."""
    return {
        # Chat's default of 256 is only described: schemathesis builds boundary cases on a `default`,
        # and one that overflows a small context would turn every one of them into the same 400.
        "max_tokens": {
            **_nullable(_int_range(1, max_model_len)),
            "description": f"Prompt plus max_tokens must fit the context of {max_model_len} tokens. "
                           "Default: 256 for chat, 16 for text completions.",
        },
        "temperature": {
            "type": "number",
            "anyOf": [_const(0), {"minimum": MIN_TEMPERATURE, "maximum": MAX_TEMPERATURE}],
            "default": 1.0,
            "description": "0 is greedy.",
        },
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1, "default": 1.0},
        "top_k": {"type": "integer", "anyOf": [_const(-1), _int_range(1, vocab_size)], "default": -1,
                  "description": "-1 is off."},
        "seed": _nullable(_int_range(MIN_SEED, MAX_SEED)),
        "stop": {
            "anyOf": [
                {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS},
                {"type": "array", "maxItems": MAX_STOP_STRINGS,
                 "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}},
                {"type": "null"},
            ],
        },
        "stop_token_ids": _nullable({"type": "array", "items": token_id}),
        # null means the default; 0, "false" & co. are refused rather than read as truth values.
        "ignore_eos": {**_nullable({"type": "boolean"}), "default": False},
        "stream": {**_nullable({"type": "boolean"}), "default": False},
        "stream_options": _nullable(_object({"include_usage": {
            **_nullable({"type": "boolean"}), "description": "Default: true for chat, false for text completions.",
        }})),
        "presence_penalty": _penalty({"minimum": -MAX_PENALTY, "maximum": MAX_PENALTY}, 0,
                                     "Subtracted once from the logit of every token already generated."),
        "frequency_penalty": _penalty({"minimum": -MAX_PENALTY, "maximum": MAX_PENALTY}, 0,
                                      "Subtracted from a generated token's logit once per time it was generated."),
        "repetition_penalty": _penalty({"minimum": MIN_REPETITION_PENALTY, "maximum": MAX_REPETITION_PENALTY}, 1,
                                       "Divides the logits of tokens in the prompt or the output (multiplies "
                                       "negative ones); 1 is off."),
    }


def _penalty(bounds: Schema, default: float, description: str) -> Schema:
    return {**_nullable({"type": "number", **bounds}), "default": default, "description": description}


def _other_form_fields(schema: Schema) -> Schema:
    """More form fields: named, and each name once (a repeated or unnamed part is refused)."""
    return {"additionalProperties": schema, "propertyNames": {"minLength": 1}}


# --- messages ----------------------------------------------------------------------------


def _message_schemas(media_kinds: list[str]) -> dict[str, Schema]:
    text_only = [_ref("TextPart")]
    return {
        "Message": {"anyOf": [_ref(name) for name in
                              ("UserMessage", "SystemMessage", "AssistantMessage", "ToolCallMessage", "ToolMessage")]},
        # Only user messages carry media parts: in any other role one is a 400.
        "UserMessage": _message(["user"], _message_content(_user_parts(media_kinds))),
        "SystemMessage": _message(["system", "developer"], _message_content(text_only),
                                  description="developer is OpenAI's newer name for system."),
        "AssistantMessage": _message(["assistant"], _message_content(text_only),
                                     more={"tool_calls": _nullable(_tool_calls())}),
        # Content may be null or left out of an assistant message only when it carries tool calls.
        "ToolCallMessage": _message(["assistant"], _nullable(_message_content(text_only)), content_required=False,
                                    more={"tool_calls": _tool_calls()}, more_required=["tool_calls"]),
        "ToolMessage": _message(["tool"], _message_content(text_only), more_required=["tool_call_id"], more={
            "tool_call_id": {"type": "string", "minLength": 1,
                             "description": "The id of the tool call this message answers."},
        }),
        "ToolCall": _object(
            {
                "id": {"type": "string"},
                "type": _const("function"),
                "function": _object({
                    "name": {"type": "string"},
                    "arguments": {
                        "anyOf": [
                            {"type": "string", "contentMediaType": "application/json",
                             "contentSchema": {"type": "object"}},
                            {"type": "object"},
                        ],
                        "default": "{}",
                        "description": "A JSON object's text (as OpenAI answers it; empty means {}), or the object.",
                    },
                }, ["name"]),
            },
            ["function"],
            description="A call the assistant made earlier in the conversation, as OpenAI answered it.",
        ),
        "TextPart": _part("text", {"type": "string"}),
        **_media_part_schemas(media_kinds),
    }


def _message_content(parts: list[Schema]) -> Schema:
    return {"anyOf": [{"type": "string"}, {"type": "array", "items": {"anyOf": parts}}]}


def _tool_calls() -> Schema:
    return {"type": "array", "items": _ref("ToolCall")}


def _message(
    roles: list[str],
    content: Schema,
    *,
    content_required: bool = True,
    more: dict[str, Schema] | None = None,
    more_required: Iterable[str] = (),
    description: str | None = None,
) -> Schema:
    """A message of these roles: ``content`` as given, and ``more`` fields (those in ``more_required`` required)."""
    required = ["role", *(["content"] if content_required else []), *more_required]
    extra = {} if description is None else {"description": description}
    return _object({"role": {"enum": roles}, "content": content, **(more or {})}, required, **extra)


def _part(kind: str, value: Schema) -> Schema:
    return _object({"type": _const(kind), kind: value}, ["type", kind])


def _user_parts(media_kinds: list[str]) -> list[Schema]:
    return [_ref("TextPart"), *(_ref(name) for name in _media_part_schemas(media_kinds))]


def _part_schema_name(part_type: str) -> str:
    return "".join(word.title() for word in part_type.split("_")) + "Part"


def _media_part_schemas(media_kinds: list[str]) -> dict[str, Schema]:
    """Only the parts of media this model takes: anything else is refused with 400."""
    reference = {
        "type": "string",
        "minLength": 1,
        "description": (
            "A data: URL (base64), the id of a file uploaded with POST /v1/files, or in a multipart request "
            "the form field name of one of its file parts. Remote http(s) URLs are refused."
        ),
    }
    url = {"anyOf": [_object({"url": reference}, ["url"]), reference]}
    base64 = {"type": "string", "contentEncoding": "base64"}
    values = {
        "image_url": url,
        "video_url": url,
        "input_audio": _object({"data": base64, "format": {"type": "string"}}, ["data"]),
    }
    schemas = {_part_schema_name(t): _part(t, values[t]) for t in (_MEDIA_PARTS[k] for k in media_kinds)}
    if schemas:  # a file part may hold any of them
        schemas["FilePart"] = _part("file", {
            "anyOf": [
                _object({"file_id": {"type": "string"}}, ["file_id"]),
                _object({"file_data": {**base64, "description": "base64 or a data: URL"}}, ["file_data"]),
            ]
        })
    return schemas


# --- tools and response formats ----------------------------------------------------------


def _tool_request_schemas() -> dict[str, Schema]:
    name = {"type": "string", "pattern": _TOOL_NAME_PATTERN}
    json_schema = {"type": "object", "description": "A JSON Schema, enforced while the model writes."}
    return {
        "Tool": _object({
            "type": _const("function"),
            "function": _object({
                "name": name,
                "description": _nullable({"type": "string"}),
                "parameters": {**_nullable(json_schema), "description": "The arguments' JSON Schema; default: "
                                                                        "any object."},
                "strict": _nullable({"type": "boolean"}),
            }, ["name"]),
        }, ["type", "function"]),
        "NamedToolChoice": _object({
            "type": _const("function"),
            "function": _object({"name": {**name, "description": "One of the request's tools."}}, ["name"]),
        }, ["type", "function"]),
        "TextFormat": _object({"type": _const("text")}, ["type"]),
        "JsonObjectFormat": _object({"type": _const("json_object")}, ["type"]),
        "JsonSchemaFormat": _object({
            "type": _const("json_schema"),
            "json_schema": _object({
                "name": name,
                "description": _nullable({"type": "string"}),
                "schema": {**_nullable(json_schema), "description": "Default: any JSON object."},
                "strict": _nullable({"type": "boolean"}),
            }, ["name"]),
        }, ["type", "json_schema"]),
    }


# --- responses ---------------------------------------------------------------------------


def _response_schemas(media_kinds: list[str]) -> dict[str, Schema]:
    return {
        "Error": _closed_object({
            "error": _closed_object({"message": {"type": "string"}, "type": {"type": "string"},
                                     "code": {"type": "integer"}}),
        }),
        **_usage_schemas(),
        **_chat_response_schemas(),
        **_logprob_schemas(),
        "TextCompletion": _envelope("text_completion", "Usage", {"type": "array", "items": _closed_object({
            "index": {"type": "integer", "minimum": 0, "description": "Prompt i's choice j is at i * n + j."},
            "text": {"type": "string"},
            "token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0}},
            "logprobs": _nullable(_ref("CompletionLogprobs")),
            "finish_reason": {"enum": [*_FINISH_REASONS, None], "description": "null on a stream's inner chunks"},
        })}, usage_required=False),
        "File": _closed_object({
            "id": {"type": "string"},
            "object": _const("file"),
            "bytes": {"type": "integer", "minimum": 1},
            "created_at": {"type": "integer"},
            "filename": {"type": "string"},
            "purpose": {"type": "string"},
        }),
        "FileList": _closed_object({"object": _const("list"), "data": {"type": "array", "items": _ref("File")}}),
        "FileDeleted": _closed_object({"id": {"type": "string"}, "object": _const("file"), "deleted": _const(True)}),
        "ModelList": _closed_object({"object": _const("list"), "data": {
            "type": "array", "minItems": 1, "maxItems": 1, "items": _closed_object({
                "id": {"type": "string"},
                "object": _const("model"),
                "created": {"type": "integer"},
                "owned_by": {"type": "string"},
                "max_model_len": {"type": "integer", "minimum": 1},
                "input_modalities": {"type": "array", "items": {"enum": ["text", *media_kinds]}},
            }),
        }}),
        # The stack's API adds which workers and encoders answer.
        "Health": _object({"status": {"enum": ["ok", "unavailable"]}}, ["status"]),
        "Alive": _closed_object({"status": _const("alive")}),
        "EngineStats": _object(
            {
                "running_requests": {"type": "integer", "minimum": 0},
                "waiting_requests": {"type": "integer", "minimum": 0},
                "pending_requests": {"type": "integer", "minimum": 0},
                "full_pool": _ref("PoolStats"),
                "swa_pool": _ref("PoolStats"),
            },
            description="The engine's counters as of its last step; more fields may appear.",
        ),
        "PoolStats": _object({"capacity_tokens": {"type": "integer", "minimum": 0},
                              "free_tokens": {"type": "integer", "minimum": 0}}),
        "FlushResult": _object({"flushed": _const(True), "stats": _ref("EngineStats")}, ["flushed"]),
        **_demo_schemas(),
    }


def _demo_schemas() -> dict[str, Schema]:
    count = {"type": "integer", "minimum": 0}
    encoder = _closed_object({"batches": count, "items": count, "mean_batch_size": {"type": "number", "minimum": 0}})
    return {
        "MetricsSummary": _closed_object({
            "kv_capacity_tokens": {**count, "description": "Tokens of context the KV pools hold at most."},
            "kv_capacity_tokens_full_attention": {**count, "description": "What the same memory would hold for a "
                                                  "full-attention model of the same shape."},
            "kv_capacity_gain": _nullable({"type": "number", "minimum": 0}),
            "kv_bytes_in_use": count,
            "kv_bytes_full_attention": {**count, "description": "What a full-attention model of the same shape "
                                        "would hold for the tokens held now."},
            "kv_saving_ratio": _nullable({"type": "number", "minimum": 0}),
            "full_pool_tokens_used": count, "full_pool_capacity_tokens": count,
            "swa_slots_used": count, "swa_slots_capacity": count,
            "prefix_cache_hit_rate": {"type": "number", "minimum": 0, "maximum": 1},
            "prefix_cache_cached_tokens": count,
            "embedding_cache_hits": count, "embedding_cache_misses": count,
            "encoder_batches": _closed_object({"vision": encoder, "audio": encoder}),
            "requests_running": count, "requests_waiting": count,
        }),
    }


def _usage_schemas() -> dict[str, Schema]:
    counts = {k: {"type": "integer", "minimum": 0} for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    return {
        "Usage": _closed_object(counts, description="Each prompt counted once, however many choices it has."),
        "ChatUsage": _closed_object({
            **counts,
            "prompt_tokens_details": _closed_object({"cached_tokens": {
                "type": "integer", "minimum": 0, "description": "Prompt tokens the prefix cache served.",
            }}),
        }),
    }


def _chat_response_schemas() -> dict[str, Schema]:
    index = {**_int_range(0, MAX_CHOICES - 1), "description": "Which of the request's n choices."}
    logprobs = _nullable(_ref("ChatLogprobs"))
    return {
        "ChatCompletion": _envelope("chat.completion", "ChatUsage", {
            "type": "array", "minItems": 1, "maxItems": MAX_CHOICES, "items": _closed_object({
                "index": index,
                "message": _ref("ChatMessage"),
                "finish_reason": {"enum": _CHAT_FINISH_REASONS},
                "logprobs": logprobs,
            }),
        }, usage_required=True),
        # reasoning_content only when the server has a reasoning parser; tool_calls only when calls were made.
        "ChatMessage": _closed_object({
            "role": _const("assistant"),
            "content": {**_nullable({"type": "string"}), "description": "null when the answer is tool calls only."},
            "reasoning_content": _nullable({"type": "string"}),
            "tool_calls": {"type": "array", "minItems": 1, "items": _closed_object({
                "id": {"type": "string"},
                "type": _const("function"),
                "function": _closed_object({
                    "name": {"type": "string"},
                    "arguments": {"type": "string", "description": "JSON text, as the model wrote it."},
                }),
            })},
        }, ["role", "content"]),
        # Each chunk carries one choice's delta (its first one the role), or no choice: the usage chunk.
        "ChatCompletionChunk": _envelope("chat.completion.chunk", "ChatUsage", {
            "type": "array", "maxItems": 1, "items": _closed_object({
                "index": index,
                "delta": _ref("ChatDelta"),
                "finish_reason": {"enum": [*_CHAT_FINISH_REASONS, None]},
                "logprobs": logprobs,
            }),
        }, usage_required=False),
        "ChatDelta": _object({
            "role": _const("assistant"),
            "reasoning_content": {"type": "string"},
            "content": {"type": "string"},
            "tool_calls": {"type": "array", "items": _ref("ToolCallDelta")},
        }, additionalProperties=False),
        # A call's first delta names it; the next ones add to its arguments.
        "ToolCallDelta": _object({
            "index": {"type": "integer", "minimum": 0, "description": "Which of the choice's calls."},
            "id": {"type": "string"},
            "type": _const("function"),
            "function": _object({"name": {"type": "string"}, "arguments": {"type": "string"}}, ["arguments"],
                                additionalProperties=False),
        }, ["index", "function"], additionalProperties=False),
    }


def _logprob_schemas() -> dict[str, Schema]:
    # Log-softmax of the model's logits, before any penalty, grammar or temperature.
    logprob = {"type": "number", "description": "At most 0."}
    token = {"token": {"type": "string"}, "logprob": logprob,
             "bytes": {"type": "array", "items": _int_range(0, 255), "description": "The token's text in UTF-8."}}
    return {
        "ChatLogprobs": _closed_object({"content": {"type": "array", "items": _closed_object({
            **token,
            "top_logprobs": {"type": "array", "maxItems": MAX_TOP_LOGPROBS, "items": _closed_object(token)},
        })}}),
        "CompletionLogprobs": _closed_object({
            "tokens": {"type": "array", "items": {"type": "string"}},
            "token_logprobs": {"type": "array", "items": logprob},
            "top_logprobs": {"type": "array", "items": {
                "type": "object", "maxProperties": MAX_TOP_LOGPROBS, "additionalProperties": logprob,
                "description": "The most likely tokens' texts and log-probabilities.",
            }},
            "text_offset": {"type": "array", "items": {"type": "integer", "minimum": 0},
                            "description": "Where each token's text starts in the choice's text (of this chunk's "
                                           "choice, in a stream)."},
        }, description="Parallel lists, one entry per token; null when logprobs was not asked for."),
    }


def _envelope(kind: str, usage: str, choices: Schema, *, usage_required: bool) -> Schema:
    """The id/object/created/model envelope every completion object shares."""
    properties = {
        "id": {"type": "string"},
        "object": _const(kind),
        "created": {"type": "integer"},
        "model": {"type": "string"},
        "choices": choices,
        "usage": _ref(usage),
    }
    required = [k for k in properties if k != "usage" or usage_required]
    return _object(properties, required, additionalProperties=False)


# The building blocks a route set mounted beside the API documents its paths with.
operation, ok_response, error_responses, json_content, text_content = _operation, _ok, _errors, _json, _text
schema_ref, object_schema, closed_object, nullable = _ref, _object, _closed_object, _nullable
SECURED_ERRORS = (401,)  # what a secured operation may answer for want of the key
