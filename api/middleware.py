"""The server's ASGI middleware: the API key and per-endpoint request metrics."""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.http import error_response
from api.metrics import ServerMetrics

__all__ = ["ApiKeyMiddleware", "RequestMetricsMiddleware"]


class ApiKeyMiddleware:
    """``Authorization: Bearer <key>`` on the paths ``needs_key`` names (/v1/*,
    admin actions, what route sets mounted beside the API declare) when the
    server has a key."""

    def __init__(self, app: ASGIApp, api_key: str | None, needs_key: Callable[[str], bool]) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.needs_key = needs_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.expected is not None and scope["type"] == "http" and self.needs_key(scope["path"]):
            given = dict(scope["headers"]).get(b"authorization")
            if given != self.expected:
                reason = "missing API key" if given is None else "invalid API key"
                await error_response(401, f"{reason}: send 'Authorization: Bearer <key>'", "authentication_error")(
                    scope, receive, send
                )
                return
        await self.app(scope, receive, send)


class RequestMetricsMiddleware:
    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def capture(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, capture)
        finally:
            self.metrics.observe_request(_endpoint(scope["path"]), status)


def _endpoint(path: str) -> str:
    # File ids would give one label value per upload.
    return "/v1/files/{id}" if path.startswith("/v1/files/") else path
