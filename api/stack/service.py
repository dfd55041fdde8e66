"""What the encoder and worker processes share: their lifetime (a stop event
set by SIGTERM/SIGINT), the HTTP side port (health, metrics), and the APIs
that talk to them (registered by their pings, forgotten when they go quiet)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import uvicorn
import zmq
import zmq.asyncio
from starlette.applications import Starlette
from starlette.routing import Route

from api.stack.transport import bind_router, recv_message

__all__ = ["HttpSide", "Peers", "ServiceSocket", "every", "install_stop_signals"]

log = logging.getLogger(__name__)

# An API that has not pinged for this long is gone: its requests are aborted.
# Far beyond a starved event loop: at 5 s a worker cancelled a live API's
# stream on a loaded 2-core machine, and that API, never told, waited on it.
PEER_TIMEOUT_S = 30.0


class _QuietServer(uvicorn.Server):
    """uvicorn inside a process that handles its own signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpSide:
    """A small HTTP server beside a role's message socket, in the same event loop."""

    def __init__(self, routes: list[Route], host: str, port: int, log_level: str = "warning") -> None:
        config = uvicorn.Config(Starlette(routes=routes), host=host, port=port, log_level=log_level,
                                lifespan="off", access_log=False)
        self._server = _QuietServer(config)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._server.serve())
        while not self._server.started:
            if self._task.done():
                self._task.result()  # the port was taken, say
                raise RuntimeError("the HTTP server stopped while starting")
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        self._server.should_exit = True
        if self._task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._task, timeout=5)


class ServiceSocket:
    """A service's message socket and HTTP side, its chores, and the work it
    holds per request (tasks, cancelled when the service stops)."""

    def __init__(self, host: str, port: int, health_port: int, routes: list[Route],
                 ipc_path: str | None = None) -> None:
        self.context = zmq.asyncio.Context()
        self.sock = bind_router(self.context, host, port, ipc_path)
        self.http = HttpSide(routes, host, health_port)
        self.held: dict[str, tuple[bytes, asyncio.Task[None]]] = {}  # request id -> (its API, its task)
        self.peers = Peers()  # the APIs that talk to this service: each message's sender is ``seen``

    async def run_until(self, stop: asyncio.Event, chores: list[Coroutine[Any, Any, None]]) -> None:
        """Serve (``chores`` running beside) until ``stop``; then cancel
        everything and close the sockets."""
        await self.http.start()
        watch = every(1.0, self.forget_silent_peers, "checking peers")
        tasks = [asyncio.create_task(chore) for chore in (*chores, watch)]
        try:
            await stop.wait()
        finally:
            held = [task for _, task in self.held.values()]
            for task in (*tasks, *held):
                task.cancel()
            await asyncio.gather(*tasks, *held, return_exceptions=True)
            await self.http.stop()
            self.sock.close()
            # Every socket made from this context goes with it, a decode worker's
            # links to prefill workers among them: term() would wait for those
            # forever, and a stopping worker would be killed after the grace period.
            self.context.destroy(linger=0)

    async def dispatch(self, handle: Callable[[bytes, object], Awaitable[None]]) -> None:
        """Every message received, with its sender's identity, to ``handle`` in
        order: a chore. One message's failure is logged, and the next is read."""
        while True:
            identity, message = await recv_message(self.sock, with_identity=True)
            assert identity is not None
            try:
                await handle(identity, message)
            except Exception:  # noqa: BLE001 - one bad message must not stop the service
                log.exception("handling %s failed", type(message).__name__)

    def forget_silent_peers(self) -> None:
        """Cancel what each API that went quiet still held: nobody would read it.
        Silence is not judged while messages wait unread (after a long engine
        step, say): they may be the pings of the APIs that look quiet."""
        if self.sock.get(zmq.EVENTS) & zmq.POLLIN:
            return
        for identity in self.peers.expired():
            lost = [task for who, task in self.held.values() if who == identity]
            for task in lost:
                task.cancel()
            if lost:
                log.warning("an API went quiet; cancelled its %d requests", len(lost))


def install_stop_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)


class Service(Protocol):
    async def serve(self, stop: asyncio.Event) -> None: ...


async def run_service(build: Callable[[], Service], name: str) -> None:
    """A role's process: its service built off the event loop (loading weights
    must not block it), then served until SIGTERM or SIGINT."""
    stop = asyncio.Event()
    install_stop_signals(stop)
    started = time.perf_counter()
    service = await asyncio.to_thread(build)
    log.info("%s loaded in %.1f s", name, time.perf_counter() - started)
    await service.serve(stop)


@dataclass
class Peers:
    """The APIs talking to a service, by their socket identity."""

    last_seen: dict[bytes, float] = field(default_factory=dict)

    def seen(self, identity: bytes) -> bool:
        """Record a message from ``identity``; True when it is new."""
        new = identity not in self.last_seen
        self.last_seen[identity] = time.monotonic()
        return new

    def expired(self, timeout_s: float = PEER_TIMEOUT_S) -> list[bytes]:
        now = time.monotonic()
        gone = [peer for peer, seen in self.last_seen.items() if now - seen > timeout_s]
        for peer in gone:
            del self.last_seen[peer]
        return gone

    def __iter__(self) -> Iterator[bytes]:
        return iter(list(self.last_seen))


async def every(seconds: float, fn: Callable[[], object], what: str) -> None:
    """Run ``fn`` (sync or async) every ``seconds`` until cancelled; a failure is logged, not fatal."""
    while True:
        await asyncio.sleep(seconds)
        try:
            result = fn()
            if asyncio.iscoroutine(result):
                await result
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - a periodic chore must not end the service
            log.exception("%s failed", what)
