"""The OpenAPI 3.1 document the server publishes at ``GET /openapi.json``.

It is built per server because the limits a request must respect are the
served model's own: the vocabulary bounds token ids, ``top_k`` and stop ids;
the context length bounds ``max_tokens``; only the media kinds the model has
encoders for may appear in a chat message. Property-based tests
(tests/api/test_openapi_fuzz.py) fuzz a live server from this document, so it
must say exactly what the server accepts and answers, no more and no less.

Request objects allow additional properties: like vLLM, the server ignores
OpenAI fields it does not implement (``logprobs``, ``presence_penalty``, ...)
instead of refusing clients that send them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from api.chat import MAX_STOP_CHARS, MAX_STOP_STRINGS
from llm_core.sampling import MAX_SEED, MAX_TEMPERATURE, MIN_SEED, MIN_TEMPERATURE

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
}
# Content part "type" per media kind the model may take.
_MEDIA_PARTS = {"image": "image_url", "video": "video_url", "audio": "input_audio"}


def openapi_document(model_name: str, vocab_size: int, max_model_len: int, media_kinds: Iterable[str]) -> dict:
    """The OpenAPI document of a server answering with ``model_name``."""
    kinds = sorted(media_kinds)
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
        "paths": _paths(kinds),
        "components": {
            "schemas": _schemas(vocab_size, max_model_len, kinds),
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


def _closed_object(properties: dict[str, Schema], required: Iterable[str] = ()) -> Schema:
    """A response object: every property always present, nothing else."""
    return _object(properties, required or properties, additionalProperties=False)


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
        "/openapi.json": {"get": _operation("This document", _ok("OpenAPI 3.1.", _json({"type": "object"})))},
        "/": {"get": _operation("The video-QA demo page", {**_ok("The page.", _text("html")), **_errors(404)})},
    }


# ---------------------------------------------------------------------------------------
# Schemas
# ---------------------------------------------------------------------------------------


def _schemas(vocab_size: int, max_model_len: int, media_kinds: list[str]) -> dict[str, Schema]:
    return {
        **_request_schemas(vocab_size, max_model_len, media_kinds),
        **_response_schemas(media_kinds),
    }


def _request_schemas(vocab_size: int, max_model_len: int, media_kinds: list[str]) -> dict[str, Schema]:
    token_id = _int_range(0, vocab_size - 1)
    sampling = _sampling_properties(vocab_size, max_model_len, token_id)
    chat_properties = {
        "model": {"type": "string", "description": "Ignored: the server serves one model."},
        "messages": {"type": "array", "minItems": 1, "items": _ref("Message")},
        "max_completion_tokens": {**sampling["max_tokens"], "description": "Takes precedence over max_tokens."},
        **sampling,
        "n": _const(1),
    }
    return {
        "ChatCompletionRequest": _object(chat_properties, ["messages"]),
        "ChatCompletionMultipart": _object(
            {"request": _ref("ChatCompletionRequest")},
            ["request"],
            description=(
                "The JSON body in the `request` part; every other part is a file that image_url/video_url/file "
                "parts name by its form field name."
            ),
            **_other_form_fields({"type": "string", "contentMediaType": "application/octet-stream"}),
        ),
        "Message": {"anyOf": [_ref("UserMessage"), _ref("OtherMessage")]},
        "UserMessage": _message(["user"], _user_parts(media_kinds)),
        "OtherMessage": _message(["system", "assistant"], [_ref("TextPart")]),
        "TextPart": _part("text", {"type": "string"}),
        **_media_part_schemas(media_kinds),
        "CompletionRequest": _object(
            {
                "model": chat_properties["model"],
                "prompt": {
                    "anyOf": [
                        {"type": "string", "minLength": 1},
                        {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
                        {"type": "array", "minItems": 1, "items": token_id},
                        {"type": "array", "minItems": 1,
                         "items": {"type": "array", "minItems": 1, "items": token_id}},
                    ],
                    "description": "Text, token ids, or a list of either: one completion each.",
                },
                **sampling,
                "max_tokens": {**sampling["max_tokens"], "default": 16},
                "n": _const(1),
                "best_of": _const(1),
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
    }


def _other_form_fields(schema: Schema) -> Schema:
    """More form fields: named, and each name once (a repeated or unnamed part is refused)."""
    return {"additionalProperties": schema, "propertyNames": {"minLength": 1}}


def _message(roles: list[str], parts: list[Schema]) -> Schema:
    content = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"anyOf": parts}}]}
    return _object({"role": {"enum": roles}, "content": content}, ["role", "content"])


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


def _response_schemas(media_kinds: list[str]) -> dict[str, Schema]:
    usage = _closed_object({k: {"type": "integer", "minimum": 0}
                            for k in ("prompt_tokens", "completion_tokens", "total_tokens")})
    return {
        "Error": _closed_object({
            "error": _closed_object({"message": {"type": "string"}, "type": {"type": "string"},
                                     "code": {"type": "integer"}}),
        }),
        "Usage": usage,
        "ChatCompletion": _envelope("chat.completion", _closed_object({
            "index": {"type": "integer", "minimum": 0},
            "message": _closed_object({"role": _const("assistant"), "content": {"type": "string"}}),
            "finish_reason": {"enum": _FINISH_REASONS},
            "logprobs": {"type": "null"},
        }), usage_required=True),
        "ChatCompletionChunk": _envelope("chat.completion.chunk", _closed_object({
            "index": {"type": "integer", "minimum": 0},
            "delta": _object({"role": _const("assistant"), "content": {"type": "string"}},
                             additionalProperties=False),
            "finish_reason": {"enum": [*_FINISH_REASONS, None]},
            "logprobs": {"type": "null"},
        }), usage_required=False),
        "TextCompletion": _envelope("text_completion", _closed_object({
            "index": {"type": "integer", "minimum": 0},
            "text": {"type": "string"},
            "token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0}},
            "logprobs": {"type": "null"},
            "finish_reason": {"enum": [*_FINISH_REASONS, None], "description": "null on a stream's inner chunks"},
        }), usage_required=False),
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
    }


def _envelope(kind: str, choice: Schema, *, usage_required: bool) -> Schema:
    """The id/object/created/model envelope every completion object shares."""
    properties = {
        "id": {"type": "string"},
        "object": _const(kind),
        "created": {"type": "integer"},
        "model": {"type": "string"},
        "choices": {"type": "array", "items": choice},
        "usage": _ref("Usage"),
    }
    required = [k for k in properties if k != "usage" or usage_required]
    return _object(properties, required, additionalProperties=False)
