"""The engine on its own thread, driven from asyncio.

The engine is not thread-safe and its ``step`` blocks for a whole forward, so
one thread owns it: it takes commands (add, abort) from a queue, steps while
any request is unfinished, and hands each token to the waiting coroutine with
``call_soon_threadsafe``. The event loop never runs engine code.

A coroutine that stops listening -- the client disconnected, the stream was
cancelled -- aborts its request, which frees its KV at the next command drain.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from llm_core import LLM, MultimodalSpan, SamplingParams
from llm_core.engine import TokenEvent

__all__ = ["AsyncEngine", "EngineOverloaded", "GenerationStats"]

log = logging.getLogger(__name__)


class EngineOverloaded(RuntimeError):
    """Too many requests are waiting; the caller should answer 429."""


@dataclass
class GenerationStats:
    """Timing of one request, for metrics."""

    submitted: float
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)


@dataclass
class _Handle:
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[TokenEvent | BaseException]
    request_id: int | None = None
    finished: bool = False


@dataclass(frozen=True)
class _Add:
    handle: _Handle
    prompt_ids: list[int]
    params: SamplingParams
    spans: tuple[MultimodalSpan, ...]


@dataclass(frozen=True)
class _Abort:
    handle: _Handle


class AsyncEngine:
    def __init__(
        self,
        llm: LLM,
        *,
        max_pending: int = 256,
        on_step: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        """``max_pending``: requests admitted but unfinished before new ones get
        ``EngineOverloaded``. ``on_step(stats)`` runs on the engine thread after
        steps (at most every 0.5 s), for metrics."""
        self.llm = llm
        self.max_pending = max_pending
        self._on_step = on_step
        self._commands: queue.SimpleQueue[_Add | _Abort | None] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._pending = 0  # touched on the event loop only
        self._live: dict[int, _Handle] = {}  # engine thread only
        self._stats: dict[str, Any] = llm.stats()
        self._last_stats = 0.0
        self._thread = threading.Thread(target=self._run, name="swallow-engine", daemon=True)
        self._thread.start()

    # -- event-loop side -------------------------------------------------------

    @property
    def pending(self) -> int:
        return self._pending

    def stats(self) -> dict[str, Any]:
        """The engine's stats as of its last step (a snapshot; safe from any thread)."""
        return self._stats

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, spans: Sequence[MultimodalSpan] = ()
    ) -> AsyncIterator[TokenEvent]:
        """Tokens as they are sampled. Closing the iterator early (or cancelling the
        task iterating it) aborts the request and frees its KV."""
        if self._pending >= self.max_pending:
            raise EngineOverloaded(f"the server is at capacity ({self._pending} requests in progress)")
        handle = _Handle(asyncio.get_running_loop(), asyncio.Queue())
        self._pending += 1
        self._send(_Add(handle, prompt_ids, params, tuple(spans)))
        try:
            while True:
                item = await handle.events.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    handle.finished = True
                    return
        finally:
            self._pending -= 1
            if not handle.finished:
                self._send(_Abort(handle))

    def close(self) -> None:
        self._send(None)
        self._thread.join(timeout=10)

    def _send(self, command: _Add | _Abort | None) -> None:
        self._commands.put(command)
        self._wake.set()

    # -- engine thread ---------------------------------------------------------

    def _run(self) -> None:
        while True:
            if not self._drain():
                return
            if not self.llm.engine.has_unfinished():
                self._publish_stats(force=True)
                self._wake.wait(timeout=1.0)
                self._wake.clear()
                continue
            try:
                events = self.llm.step()
            except Exception as exc:  # noqa: BLE001 - a broken step must not kill the server silently
                log.exception("engine step failed")
                self._fail_all(exc)
                continue
            for event in events:
                self._deliver(event)
            self._publish_stats(force=False)

    def _drain(self) -> bool:
        """Apply queued commands; False once asked to stop."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
            if command is None:
                self._fail_all(RuntimeError("the server is shutting down"))
                return False
            if isinstance(command, _Add):
                self._add(command)
            else:
                self._abort(command.handle)

    def _add(self, command: _Add) -> None:
        handle = command.handle
        try:
            rid = self.llm.add_request(command.prompt_ids, command.params, mm_spans=command.spans)
        except ValueError as exc:
            self._post(handle, exc)
            return
        handle.request_id = rid
        self._live[rid] = handle

    def _abort(self, handle: _Handle) -> None:
        if handle.request_id is not None and self._live.pop(handle.request_id, None) is not None:
            self.llm.abort(handle.request_id)

    def _deliver(self, event: TokenEvent) -> None:
        handle = self._live.get(event.request_id)
        if handle is None:
            return
        if event.finish_reason is not None:
            del self._live[event.request_id]
        self._post(handle, event)

    def _fail_all(self, exc: BaseException) -> None:
        for rid, handle in list(self._live.items()):
            self.llm.abort(rid)
            self._post(handle, exc)
        self._live.clear()

    @staticmethod
    def _post(handle: _Handle, item: TokenEvent | BaseException) -> None:
        try:
            handle.loop.call_soon_threadsafe(handle.events.put_nowait, item)
        except RuntimeError:
            pass  # that request's event loop is gone

    def _publish_stats(self, *, force: bool) -> None:
        now = time.monotonic()
        if not force and now - self._last_stats < 0.5:
            return
        self._last_stats = now
        self._stats = self.llm.stats()
        if self._on_step is not None:
            try:
                self._on_step(self._stats)
            except Exception:  # noqa: BLE001 - metrics must never stop the engine
                log.exception("engine stats callback failed")
