"""Why a worker refuses a request, and the HTTP status its answer carries: an
API's ``Refused`` and a decode worker's ``PrefillFailed`` say it alike."""

from __future__ import annotations

from api.streams import EngineOverloaded, EngineUnavailable, RequestFailed

__all__ = ["MissingEmbedding", "refusal_status"]


class MissingEmbedding(LookupError):
    """A span's embedding is not in the store (evicted, or its machine unreachable): 503, retry."""


def refusal_status(exc: Exception) -> int:
    if isinstance(exc, EngineOverloaded):
        return 429
    if isinstance(exc, EngineUnavailable | MissingEmbedding):
        return 503
    if isinstance(exc, RequestFailed):
        return 500
    return 400
