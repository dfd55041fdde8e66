"""The component schemas of the API's OpenAPI document: requests (with the
served model's limits), messages, tools and response formats, responses."""

from __future__ import annotations

from collections.abc import Iterable

from api.chat import MAX_CHOICES, MAX_STOP_CHARS, MAX_STOP_STRINGS
from api.openapi_blocks import Schema, _const, _int_range, _nullable, _object, _ref
from api.openapi_responses import response_schemas
from api.structured import _NAME as _TOOL_NAME
from api.structured import MAX_TOOLS
from llm_core.sample.params import (
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_SEED,
    MAX_TEMPERATURE,
    MAX_TOP_LOGPROBS,
    MIN_REPETITION_PENALTY,
    MIN_SEED,
    MIN_TEMPERATURE,
)

# Tool and response-format names, as api.structured checks them (JSON Schema patterns are unanchored).
_TOOL_NAME_PATTERN = f"^{_TOOL_NAME.pattern}$"

# Content part "type" per media kind the model may take.
_MEDIA_PARTS = {"image": "image_url", "video": "video_url", "audio": "input_audio"}


def component_schemas(vocab_size: int, max_model_len: int, media_kinds: list[str]) -> dict[str, Schema]:
    return {
        **_request_schemas(vocab_size, max_model_len, media_kinds),
        **_message_schemas(media_kinds),
        **_tool_request_schemas(),
        **response_schemas(media_kinds),
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
