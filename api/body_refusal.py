"""Refusing a request body so the client hears why: the error (400 / 413 / 415),
a Content-Length over a limit refused before the body is read, and the rest of a
body refused part-way read and thrown away first when that is cheap, so the
connection can stay open. Used by the uploads and by every JSON body."""

from __future__ import annotations

import asyncio

from starlette.requests import ClientDisconnect, Request

# A body refused before it was read to its end is read on and thrown away first, as
# nginx's lingering_close does: a client that is still sending (httpx always is) and
# finds the connection closed gets a reset instead of our answer. Draining is bounded
# so a slow or endless sender cannot hold a connection: past either bound the answer
# goes out with Connection: close. 1 GiB takes a second or two on a LAN or localhost.
_DRAIN_SECONDS = 5.0
_DRAIN_MAX_BYTES = 1 << 30


class UploadError(Exception):
    """An upload refused with an HTTP status (400 / 413 / 415) and a message for the user.

    `close_connection` is set when the request body was abandoned part-way: the
    response should then carry `headers` (Connection: close), otherwise uvicorn
    keeps reading, and discarding, the rest of a possibly huge body.
    `settle_refusal` clears it when the rest of the body could be drained cheaply.
    """

    def __init__(self, status: int, message: str, *, close_connection: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.close_connection = close_connection

    @property
    def headers(self) -> dict[str, str]:
        return {"Connection": "close"} if self.close_connection else {}


async def settle_refusal(request: Request, error: UploadError, *, body_started: bool = True) -> UploadError:
    """`error`, ready to answer: when it abandons the body part-way, the rest is read
    and discarded first if that is cheap, and the connection then stays open.

    `body_started` is False for a refusal before the body was read: a client that
    sent `Expect: 100-continue` is then still waiting to send it, so nothing is drained.
    Bodies without a Content-Length (chunked) are never drained: they may be endless.
    """
    if not error.close_connection or not await _drained(request, body_started):
        return error
    return UploadError(error.status, error.message)


async def _drained(request: Request, body_started: bool) -> bool:
    """Read and drop the rest of the body; True when it ended within the bounds."""
    declared = declared_length(request)
    if declared is None or declared > _DRAIN_MAX_BYTES:
        return False
    if not body_started and request.headers.get("expect", "").lower() == "100-continue":
        return False
    try:
        async with asyncio.timeout(_DRAIN_SECONDS):
            async for _ in request.stream():
                pass
    except (TimeoutError, ClientDisconnect):
        return False
    except RuntimeError:  # Starlette's "Stream consumed": the body had already ended
        return True
    return True


def declared_length(request: Request) -> int | None:
    """The request's Content-Length, or None (absent, chunked or unreadable)."""
    declared = request.headers.get("content-length")
    return int(declared) if declared is not None and declared.isdigit() else None


async def refuse_declared_oversize(request: Request, max_bytes: int, message: str) -> None:
    """413 `message` for a body whose Content-Length is over `max_bytes`, before reading any of it."""
    declared = declared_length(request)
    if declared is not None and declared > max_bytes:
        raise await settle_refusal(request, UploadError(413, message, close_connection=True), body_started=False)


def format_size(n: int) -> str:
    """1048576 -> "1 MB", 1536 -> "1.5 KB": limits as users read them."""
    for unit, shift in (("GB", 30), ("MB", 20), ("KB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f}".removesuffix(".0") + f" {unit}"
    return f"{n} bytes"
