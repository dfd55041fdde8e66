"""The response schemas of the API's OpenAPI document: errors, completions
and their chunks, usage, logprobs, files, statistics and metrics."""

from __future__ import annotations

from api.chat import MAX_CHOICES
from api.openapi_blocks import Schema, _closed_object, _const, _int_range, _nullable, _object, _ref
from llm_core.sample.params import MAX_TOP_LOGPROBS

# The engine's "error" finish never reaches a client: it becomes a 500 or an error event.
_FINISH_REASONS = ["stop", "length"]
# Chat's stop after tool calls is OpenAI's "tool_calls".
_CHAT_FINISH_REASONS = [*_FINISH_REASONS, "tool_calls"]

def response_schemas(media_kinds: list[str]) -> dict[str, Schema]:
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
