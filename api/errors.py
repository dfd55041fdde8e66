"""What a client must fix: the errors every request parser raises, which the
server turns into HTTP 4xx responses with their reason."""

from __future__ import annotations


class BadRequest(ValueError):
    """A request the client must fix (HTTP 400)."""


class UnsupportedMedia(ValueError):
    """Media of a type the server cannot decode (HTTP 415)."""
