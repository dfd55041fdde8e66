"""What every route shares: JSON error answers (every client mistake a 4xx
with its reason, the server's own failures a 5xx), reading a JSON body within
a limit, and work that stops when the client goes away."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from api.body_refusal import UploadError, format_size, refuse_declared_oversize
from api.chat import BadRequest, UnsupportedMedia, parse_json_body
from api.streams import EngineOverloaded, EngineUnavailable, RequestFailed
from encoders import EncoderQueueFull
from llm_core.model.chat import ChatTemplateError
from media import MediaError

__all__ = ["JSON_BODY_LIMIT", "error_for", "error_response", "guarded", "read_json", "until_disconnected"]

JSON_BODY_LIMIT = 64 << 20  # plain JSON bodies (base64 media included)


def error_response(
    status: int, message: str, kind: str = "invalid_request_error", headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status,
                        headers=headers)


def error_for(exc: Exception) -> JSONResponse | None:
    """The 4xx/5xx answer for a failure the client should hear about, or None."""
    if isinstance(exc, BadRequest | ChatTemplateError):
        return error_response(400, str(exc))
    if isinstance(exc, UnsupportedMedia):
        return error_response(415, str(exc), "unsupported_media_type")
    if isinstance(exc, UploadError):
        # Refused mid-upload: closing the connection stops the client sending the rest.
        return error_response(exc.status, exc.message, "upload_error", exc.headers)
    if isinstance(exc, MediaError):
        return error_response(exc.status, str(exc), "media_error")
    if isinstance(exc, EngineOverloaded):
        return error_response(429, str(exc), "rate_limit_exceeded")
    if isinstance(exc, EngineUnavailable):
        return error_response(503, str(exc), "server_overloaded")
    if isinstance(exc, RequestFailed):  # the server's fault, this request's alone: others go on
        return error_response(500, str(exc), "server_error")
    if isinstance(exc, EncoderQueueFull):
        return error_response(503, f"{exc}; retry shortly", "server_overloaded")
    if isinstance(exc, ValueError):  # engine-side validation (length, KV pool, spans)
        return error_response(400, str(exc))
    return None


async def until_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Run ``work``; cancel it (aborting its generation) if the client goes away."""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise ClientDisconnect()


async def read_json(request: Request, limit: int) -> Any:
    too_large = f"request body exceeds the {format_size(limit)} limit"
    await refuse_declared_oversize(request, limit, too_large)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise UploadError(413, too_large, close_connection=True)
    return parse_json_body(bytes(body))


async def guarded(request: Request, handler: Callable[[], Awaitable[Response]]) -> Response:
    """``handler()``'s answer, or the 4xx/5xx of a failure the client should hear
    about; 499 when the client went away."""
    try:
        return await handler()
    except ClientDisconnect:
        return Response(status_code=499)
    except Exception as exc:  # noqa: BLE001 - mapped to a status below, else re-raised
        answer = error_for(exc)
        if answer is None:
            raise
        return answer
