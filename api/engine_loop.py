"""The engine on its own thread, driven from asyncio.

The engine is not thread-safe and its ``step`` blocks for a whole forward, so
one thread owns it: it takes commands (add, abort) from a queue, steps while
any request is unfinished, and hands each token to the waiting coroutine with
``call_soon_threadsafe``. The event loop never runs engine code.

A request may bring a detokenizer (anything with ``push(token, final)`` and
``stopped``): the engine thread then turns each token into its text delta before
posting it, so decoding never holds up the event loop's I/O for other requests,
and a stop string found in the text ends the request in the engine at once.

A coroutine that stops listening -- the client disconnected, the stream was
cancelled -- aborts its request, which frees its KV at the next command drain.

One request's failure is that request's alone: a refusal at admission reaches
only its caller (before any token, so a server can still answer 400), a
failure inside a step ends only the requests the engine attributes it to
(``RequestFailed``), and only a step failure no request explains fails every
request in flight, after which the engine is rebuilt for new ones.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import torch

from api.streams import (
    Detokenizer, EngineOverloaded, EngineUnavailable, RequestFailed, StreamEvent, admitted_stream,
)
from llm_core import LLM, MultimodalSpan, SamplingParams
from llm_core.cluster.disagg import KVReservation, PrefilledKV
from llm_core.engine import TokenEvent

__all__ = ["AsyncEngine", "Submission"]

log = logging.getLogger(__name__)
T = TypeVar("T")


# An inline engine's event-loop turns between steps (``AsyncEngine.run_inline``).
LOOP_TURNS_PER_STEP = 3

# Posted to a request's queue once the engine has accepted it.
_ADMITTED = object()
_SUNK_LAST = object()  # a sink stream's final event went to its sink: the stream ends

# Where a stream's admission (None) and tokens go instead of its queue, called
# on the stream's event loop in the step's one callback.
Sink = Callable[["StreamEvent | None"], None]


@dataclass
class _Handle:
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[Any]  # _ADMITTED, then StreamEvents; or an exception
    text: Detokenizer | None = None  # touched on the engine thread only, once admitted
    sink: Sink | None = None
    request_id: int | None = None  # the engine's
    label: str = ""  # the API's id of the request, for logs
    finished: bool = False
    export_kv: bool = False
    released: bool = False  # its caller let go: counted out of ``pending``, aborted unless finished


@dataclass(frozen=True)
class _Prefilled:
    """A request prefilled elsewhere: its reservation, and the received KV to fill it with."""

    reservation: KVReservation
    prefilled: PrefilledKV
    blob: torch.Tensor


@dataclass(frozen=True)
class _Add:
    handle: _Handle
    prompt_ids: list[int]
    params: SamplingParams
    spans: tuple[MultimodalSpan, ...]
    prefilled: _Prefilled | None = None


@dataclass(frozen=True)
class _Call:
    """Run ``fn(llm)`` on the engine thread; ``done(result or exception)`` there after."""

    fn: Callable[[LLM], Any]
    done: Callable[[Any], None]


@dataclass(frozen=True)
class _Abort:
    handle: _Handle


@dataclass(frozen=True)
class _Flush:
    done: Callable[[dict[str, Any]], None]  # called on the engine thread with the stats after the flush


class AsyncEngine:
    def __init__(
        self,
        llm: LLM,
        *,
        max_pending: int = 256,
        on_step: Callable[[dict[str, Any]], None] | None = None,
        inline: bool = False,
    ) -> None:
        """``max_pending``: requests admitted but unfinished before new ones get
        ``EngineOverloaded``. ``on_step(stats)`` runs on the engine thread after
        steps (at most every 0.5 s), for metrics.

        ``inline``: no engine thread; ``run_inline`` steps the engine on the event
        loop's own thread, the loop's I/O between steps. For an engine-core
        process, whose loop has nothing to do while a step runs: a second
        thread would only contend with the steps for the GIL (measured: decode
        steps 40% slower, prefill steps 80%, beside the loop's per-step sends)."""
        self.llm = llm
        self.max_pending = max_pending
        self._on_step = on_step
        self._commands: queue.SimpleQueue[_Add | _Abort | _Flush | _Call | None] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._pending = 0  # touched on the event loop only
        self._live: dict[int, _Handle] = {}  # engine thread only
        self._broken: str | None = None  # why the engine could not be rebuilt (engine thread only)
        self._staged: list[tuple[_Handle, Any]] = []  # engine thread: this step's deliveries, posted together
        self._stats: dict[str, Any] = llm.stats()
        self._last_stats = 0.0
        self._inline = inline
        self._inline_wake: asyncio.Event | None = None  # inline: set by every command
        self._thread: threading.Thread | None = None
        if not inline:
            self._thread = threading.Thread(target=self._run, name="swallow-engine", daemon=True)
            self._thread.start()

    # -- event-loop side -------------------------------------------------------

    @property
    def pending(self) -> int:
        return self._pending

    def stats(self) -> dict[str, Any]:
        """The engine's stats as of its last step (a snapshot; safe from any thread)."""
        return self._stats

    @property
    def broken(self) -> str | None:
        """Why the engine could not be rebuilt after a failure, or None while it serves."""
        return self._broken

    async def open(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        spans: Sequence[MultimodalSpan] = (),
        text: Detokenizer | None = None,
        sink: Sink | None = None,
        request_id: str | None = None,
    ) -> AsyncGenerator[StreamEvent, None]:
        """Admit a request and return its token stream. Everything the engine checks
        (lengths, KV pool, spans, vocabulary) is refused here, as ``ValueError``,
        before any token -- so a server can still answer it with a 400. Closing
        the stream early (or cancelling the task reading it) aborts the request
        and frees its KV. ``text`` is the request's detokenizer, from then on used
        by the engine thread alone.

        With ``sink``, the admission (as None, before ``open`` returns) and every
        event go to ``sink`` instead, in the callback that settles the step: no
        task wakes per request and step. The stream then yields nothing; it ends
        after the final event, or raises the request's failure. ``request_id``:
        the API's id of the request, which the engine loop's log lines name."""
        return await self.submit(prompt_ids, params, spans, text, sink, request_id).admitted()

    async def open_export(self, prompt_ids: list[int], params: SamplingParams, spans: Sequence[MultimodalSpan] = (),
                          request_id: str | None = None) -> AsyncGenerator[StreamEvent, None]:
        """``open`` for a prefill worker's request: it ends after its first
        token, whose event carries the request's packed KV (``exported``)."""
        handle = self._queue(prompt_ids, params, spans, None, export_kv=True, label=request_id)
        return await Submission(self, handle).admitted()

    async def open_prefilled(self, reservation: KVReservation, prompt_ids: list[int], params: SamplingParams,
                             prefilled: PrefilledKV, blob: torch.Tensor, spans: Sequence[MultimodalSpan] = (),
                             text: Detokenizer | None = None, sink: Sink | None = None,
                             request_id: str | None = None) -> AsyncGenerator[StreamEvent, None]:
        """``open`` for a request prefilled elsewhere: ``blob`` fills the
        reservation, and the stream starts at the first token (ValueError if
        it does not fit the reservation, which is then still held)."""
        handle = self._queue(prompt_ids, params, spans, text, sink=sink,
                             prefilled=_Prefilled(reservation, prefilled, blob), label=request_id)
        return await Submission(self, handle).admitted()

    def submit(self, prompt_ids: list[int], params: SamplingParams, spans: Sequence[MultimodalSpan] = (),
               text: Detokenizer | None = None, sink: Sink | None = None,
               request_id: str | None = None) -> Submission:
        """``open`` in two halves: the request is queued for the engine now,
        without awaiting anything (a caller on the event loop gets it into the
        next step, where a task would start a loop turn later), and
        ``Submission.admitted`` waits for the admission. The caller owns the
        submission: ``admitted`` and its stream, or ``release``, let it go.
        ``EngineOverloaded`` here, at once."""
        return Submission(self, self._queue(prompt_ids, params, spans, text, sink=sink, label=request_id))

    def post(self, fn: Callable[[LLM], Any]) -> None:
        """``fn(llm)`` on the engine thread, not waited for (a clean-up that
        must happen even from a cancelled task)."""
        self._send(_Call(fn, lambda _: None))

    async def call(self, fn: Callable[[LLM], T]) -> T:
        """``fn(llm)`` run on the engine thread, between steps (its exception is raised here)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.create_future()

        def resolve(result: Any) -> None:
            def settle() -> None:
                if done.done():
                    return
                if isinstance(result, BaseException):
                    done.set_exception(result)
                else:
                    done.set_result(result)
            loop.call_soon_threadsafe(settle)

        self._send(_Call(fn, resolve))
        return await done

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        spans: Sequence[MultimodalSpan] = (),
        text: Detokenizer | None = None,
    ) -> AsyncIterator[StreamEvent]:
        """Tokens as they are sampled (``open`` and iterate, in one)."""
        stream = await self.open(prompt_ids, params, spans, text)
        try:
            async for event in stream:
                yield event
        finally:
            await stream.aclose()

    async def current_stats(self) -> dict[str, Any]:
        """The engine's stats now, taken between steps (``stats`` is the last snapshot)."""
        return await self.call(lambda llm: llm.stats())

    async def flush_cache(self) -> dict[str, Any]:
        """Drop every cached prefix no running request holds; the engine's stats after."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[dict[str, Any]] = loop.create_future()

        def resolve(stats: dict[str, Any]) -> None:
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(stats))

        self._send(_Flush(resolve))
        return await done

    def _queue(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        spans: Sequence[MultimodalSpan],
        text: Detokenizer | None,
        export_kv: bool = False,
        prefilled: _Prefilled | None = None,
        sink: Sink | None = None,
        label: str | None = None,
    ) -> _Handle:
        if self._pending >= self.max_pending:
            raise EngineOverloaded(f"the server is at capacity ({self._pending} requests in progress)")
        handle = _Handle(asyncio.get_running_loop(), asyncio.Queue(), text, sink, export_kv=export_kv,
                         label=label or uuid.uuid4().hex)
        self._pending += 1
        self._send(_Add(handle, prompt_ids, params, tuple(spans), prefilled))
        return handle

    def _release(self, handle: _Handle) -> None:
        if handle.released:
            return
        handle.released = True
        self._pending -= 1
        if not handle.finished:
            self._send(_Abort(handle))

    @staticmethod
    async def _items(handle: _Handle) -> AsyncGenerator[StreamEvent | None, None]:
        """What the engine thread posted to the request: its admission (None),
        then its events; a refusal or failure raises."""
        while True:
            item = await handle.events.get()
            if isinstance(item, BaseException):
                raise item
            if item is _SUNK_LAST:
                return
            yield None if item is _ADMITTED else item

    def close(self) -> None:
        self._send(None)
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _send(self, command: _Add | _Abort | _Flush | _Call | None) -> None:
        self._commands.put(command)
        self._wake.set()
        if self._inline_wake is not None:
            self._inline_wake.set()

    async def run_inline(self) -> None:
        """The engine loop of an ``inline`` engine, on the calling event loop until
        ``close``. Between steps the loop runs ``LOOP_TURNS_PER_STEP`` turns: the
        step's outputs (queued by deliveries called directly, in order) go out,
        and a request that arrived during the step gets from its socket to the
        engine's queue (the read, then the receiving task, which ``submit``s
        it: a turn each) before the next."""
        assert self._inline, "run_inline is for an AsyncEngine made with inline=True"
        self._inline_wake = asyncio.Event()
        while (state := self._turn()) != "stop":
            if state == "idle":
                await self._inline_wake.wait()
                self._inline_wake.clear()
                continue
            for _ in range(LOOP_TURNS_PER_STEP):
                await asyncio.sleep(0)

    # -- engine thread ---------------------------------------------------------

    def _run(self) -> None:
        while (state := self._turn()) != "stop":
            if state == "idle":
                self._wake.wait(timeout=1.0)
                self._wake.clear()

    def _turn(self) -> str:
        """One pass of the engine loop: "stop" once asked to, "idle" with nothing
        to step, else "stepped"."""
        try:
            if not self._drain():
                return "stop"
            if self._broken is not None or not self.llm.engine.has_unfinished():
                self._publish_stats(force=True)
                return "idle"
            for event in self.llm.step():
                self._deliver(event)  # inside: a stop string's abort is engine work too
            self._post_staged()
        except Exception as exc:  # noqa: BLE001 - no request explains it: start over
            self._post_staged()
            log.exception("engine step failed; every request in flight is lost and the engine is rebuilt")
            self._fail_all(EngineUnavailable(f"the engine failed ({type(exc).__name__}: {exc}); retry"))
            self._restart()
            return "stepped"
        self._publish_stats(force=False)
        return "stepped"

    def _drain(self) -> bool:
        """Apply queued commands; False once asked to stop."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
            if command is None:
                self._fail_all(EngineUnavailable("the server is shutting down"))
                return False
            if isinstance(command, _Add):
                self._add(command)
            elif isinstance(command, _Call):
                self._call(command)
            elif isinstance(command, _Flush):
                if self._broken is None:
                    self.llm.flush_cache()
                self._publish_stats(force=True)
                command.done(self._stats)
            else:
                self._abort(command.handle)

    def _add(self, command: _Add) -> None:
        handle = command.handle
        if self._broken is not None:
            self._restart()  # the device may be back
        if self._broken is not None:
            self._post(handle, EngineUnavailable(f"the engine is unavailable: {self._broken}"))
            return
        try:
            rid = self._admit(command)
        except ValueError as exc:
            self._post(handle, exc)
            return
        except Exception as exc:  # noqa: BLE001 - this request's problem: the engine thread goes on
            log.exception("admitting request %s failed", handle.label)
            self._post(handle, RequestFailed(f"the request could not be admitted: {type(exc).__name__}: {exc}"))
            return
        handle.request_id = rid
        log.debug("request %s is engine request %d", handle.label, rid)
        self._live[rid] = handle
        self._post(handle, _ADMITTED)

    def _admit(self, command: _Add) -> int:
        handle, prefilled = command.handle, command.prefilled
        if prefilled is None:
            return self.llm.add_request(command.prompt_ids, command.params, command.spans, handle.export_kv)
        self.llm.fill_reservation(prefilled.reservation, prefilled.blob)
        return self.llm.add_prefilled(prefilled.reservation, command.prompt_ids, command.params,
                                      prefilled.prefilled, command.spans)

    def _call(self, command: _Call) -> None:
        try:
            result = command.fn(self.llm)
        except Exception as exc:  # noqa: BLE001 - the caller's to handle
            result = exc
        command.done(result)

    def _abort(self, handle: _Handle) -> None:
        # Identity, not just the id: after a rebuild a new request may have the old id.
        if handle.request_id is not None and self._live.get(handle.request_id) is handle:
            del self._live[handle.request_id]
            self.llm.abort(handle.request_id)

    def _deliver(self, event: TokenEvent) -> None:
        handle = self._live.get(event.request_id)
        if handle is None:
            if event.finish_reason is not None:
                self.llm.take_export(event.request_id)  # an aborted prefill's KV, if it got that far
            return
        item = self._outcome(handle, event)
        if isinstance(item, BaseException) or item.finish_reason is not None:
            del self._live[event.request_id]
            if handle.export_kv and not isinstance(item, BaseException):
                item = replace(item, exported=self.llm.take_export(event.request_id))
            if event.finish_reason is None:  # ended by its text: free its KV now, before the next step
                self.llm.abort(event.request_id)
        self._staged.append((handle, item))

    def _post_staged(self) -> None:
        """The step's deliveries, one callback per event loop: every stream
        the step advanced wakes in the same loop turn (a worker sends them as
        one frame)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Handle, Any]]] = {}
        for handle, item in self._staged:
            by_loop.setdefault(handle.loop, []).append((handle, item))
        self._staged = []
        for loop, items in by_loop.items():
            if self._inline:
                _settle(items)  # on that loop's thread already, after every earlier post
                continue
            try:
                loop.call_soon_threadsafe(_settle, items)
            except RuntimeError:
                pass  # that event loop is gone

    @staticmethod
    def _outcome(handle: _Handle, event: TokenEvent) -> StreamEvent | RequestFailed:
        """What the request's stream gets for this event: the token with its text,
        or the request's failure."""
        if event.error is not None:
            log.warning("request %s (engine request %d) failed: %s", handle.label, event.request_id, event.error)
            return RequestFailed(f"the request failed while generating: {event.error}")
        extra = {"logprob": event.logprob, "top_logprobs": event.top_logprobs, "cached_tokens": event.cached_tokens}
        if handle.text is None:
            return StreamEvent(event.token, event.finish_reason, **extra)
        try:
            delta = handle.text.push(event.token, final=event.finish_reason is not None)
        except Exception as exc:  # noqa: BLE001 - this request's problem: the engine thread goes on
            log.exception("decoding the text of request %s failed", handle.label)
            return RequestFailed(f"the request's text could not be decoded: {type(exc).__name__}: {exc}")
        return StreamEvent(event.token, "stop" if handle.text.stopped else event.finish_reason, delta, **extra)

    def _fail_all(self, exc: BaseException) -> None:
        for rid, handle in list(self._live.items()):
            self._post(handle, exc)
            try:
                self.llm.abort(rid)
            except Exception:  # noqa: BLE001 - the engine may be broken; it is rebuilt next
                log.exception("aborting request %d failed", rid)
        self._live.clear()

    def _restart(self) -> None:
        try:
            self.llm.reset_engine()
        except Exception as exc:  # noqa: BLE001 - keep the thread alive; admissions fail with the reason
            log.exception("rebuilding the engine failed")
            self._broken = f"{type(exc).__name__}: {exc}"
            return
        self._broken = None
        self._publish_stats(force=True)

    def _post(self, handle: _Handle, item: Any) -> None:
        """One item at once (admissions, refusals, failures: not a step's tokens)."""
        if self._inline:
            _settle([(handle, item)])
            return
        try:
            handle.loop.call_soon_threadsafe(_settle, [(handle, item)])
        except RuntimeError:
            pass  # that request's event loop is gone

    def _publish_stats(self, *, force: bool) -> None:
        now = time.monotonic()
        if not force and now - self._last_stats < 0.5:
            return
        self._last_stats = now
        if self._broken is not None:
            return  # keep the last stats: the broken engine has none to give
        self._stats = self.llm.stats()
        if self._on_step is not None:
            try:
                self._on_step(self._stats)
            except Exception:  # noqa: BLE001 - metrics must never stop the engine
                log.exception("engine stats callback failed")


class Submission:
    """A request queued for the engine (``AsyncEngine.submit``), not yet admitted."""

    def __init__(self, engine: AsyncEngine, handle: _Handle) -> None:
        self._engine = engine
        self._handle = handle

    async def admitted(self) -> AsyncGenerator[StreamEvent, None]:
        """Wait for the admission; then the request's stream, as ``open`` returns
        it (a refusal raises here, as ``ValueError`` and the like)."""
        return await admitted_stream(self._engine._items(self._handle), self._finish)

    def _finish(self, finished: bool) -> None:
        self._handle.finished = finished
        self._engine._release(self._handle)

    def release(self) -> None:
        """Let the request go whether or not ``admitted`` ever ran (say, a task
        cancelled before it started): it stops counting as pending, and the
        engine drops it unless it has finished. Idempotent."""
        self._engine._release(self._handle)


def _settle(items: list[tuple[_Handle, Any]]) -> None:
    for handle, item in items:
        if handle.sink is None or isinstance(item, BaseException):
            handle.events.put_nowait(item)
            continue
        try:
            handle.sink(None if item is _ADMITTED else item)
        except Exception as exc:  # noqa: BLE001 - the sink's failure ends its own stream only
            handle.events.put_nowait(RequestFailed(f"delivering the request's output failed: {exc}"))
            continue
        if item is _ADMITTED:
            handle.events.put_nowait(item)  # ``open`` returns
        elif item.finish_reason is not None:
            handle.events.put_nowait(_SUNK_LAST)
