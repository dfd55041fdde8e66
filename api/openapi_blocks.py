"""The building blocks of Swallow's OpenAPI documents: schema references,
content, responses, operations and object schemas. The API's document and
every route set mounted beside it (the demo's) are written with them."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = [
    "SECURED_ERRORS", "Schema", "closed_object", "error_responses", "json_content", "nullable", "object_schema",
    "ok_response", "operation", "schema_ref", "text_content",
]

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


# The building blocks a route set mounted beside the API documents its paths with.
operation, ok_response, error_responses, json_content, text_content = _operation, _ok, _errors, _json, _text
schema_ref, object_schema, closed_object, nullable = _ref, _object, _closed_object, _nullable
SECURED_ERRORS = (401,)  # what a secured operation may answer for want of the key
