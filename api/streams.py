"""A request's token stream, as the API reads it from an engine in this
process (``AsyncEngine``) or from a stack's worker (``RemoteEngineClient``):
its events, its errors, and the one rule for when it is over.

The rule: a stream is opened by waiting for its admission, and from then on
the engine holds the request until it is over. It is over at its last event
(one with a ``finish_reason``), when its source ends, or when its source raises
(a refusal, a failure, a lost engine: the engine holds nothing of it then).
A reader that stops before that -- a client gone, a task cancelled -- leaves it
unfinished, and the release aborts it in the engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from llm_core.cluster.disagg import PrefilledKV

__all__ = [
    "Detokenizer", "EngineOverloaded", "EngineUnavailable", "RequestFailed", "StreamEvent", "admitted_stream",
]


class EngineOverloaded(RuntimeError):
    """Too many requests are waiting; the caller should answer 429."""


class RequestFailed(RuntimeError):
    """The request failed while it was generating (the server's fault, not the
    client's: HTTP 500); other requests were not affected."""


class EngineUnavailable(RuntimeError):
    """The engine failed as a whole (every request in flight was lost) or is
    shutting down; a caller should answer 503."""


class Detokenizer(Protocol):
    """A request's text, advanced one token at a time by whoever receives its tokens."""

    stopped: bool  # the text reached a stop string: the request ends here

    def push(self, token: int, final: bool = False) -> str:
        """The text delta for this token; ``final`` on the request's last one."""


@dataclass(frozen=True)
class StreamEvent:
    """One generated token as a request's stream yields it."""

    token: int
    finish_reason: str | None  # on the last one: "stop" (a stop token or string) or "length"
    text: str = ""  # the text delta, when the request brought a detokenizer
    logprob: float | None = None  # with SamplingParams.logprobs: see TokenEvent
    top_logprobs: tuple[tuple[int, float], ...] = ()
    cached_tokens: int | None = None  # on the first event: prompt tokens served by the prefix cache
    exported: PrefilledKV | None = None  # on the last event of an ``export_kv`` request: its KV


async def admitted_stream(
    source: AsyncIterator[StreamEvent | None],
    release: Callable[[bool], Awaitable[None] | None],
) -> AsyncGenerator[StreamEvent, None]:
    """Wait for the request's admission -- ``source``'s first item, None; a
    refusal raises here -- and return its stream of events from ``source``.
    ``release(finished)`` runs once, when the stream ends or is closed;
    ``finished`` False means the engine still holds the request."""
    stream = _relay(source, release)
    await stream.__anext__()  # admitted: from here closing the stream releases the request
    return stream  # type: ignore[return-value]  # yields only StreamEvents from now on


async def _relay(
    source: AsyncIterator[StreamEvent | None],
    release: Callable[[bool], Awaitable[None] | None],
) -> AsyncGenerator[StreamEvent | None, None]:
    finished = False
    try:
        while True:
            try:
                item = await source.__anext__()
            except StopAsyncIteration:
                finished = True
                return
            except asyncio.CancelledError:
                raise
            except BaseException:
                finished = True  # refused, failed or lost: the engine holds nothing of it
                raise
            # Done before it is handed over: a reader that stops at the last
            # event and closes the stream aborts nothing.
            finished = item is not None and item.finish_reason is not None
            yield item
            if finished:
                return
    finally:
        if isinstance(source, AsyncGenerator):
            await source.aclose()
        done = release(finished)
        if done is not None:
            await done
