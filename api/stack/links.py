"""The API's connections to the services it uses (workers, encoders).

One DEALER socket per service address, pinged every ``PING_INTERVAL_S``.
Whether a service is there is the connection's business: libzmq's ZMTP
heartbeats close a connection whose peer is killed, frozen or cut off, and a
closed connection takes its service out of routing at once, failing what it
held (streams, media items) with a clear error -- within ``DEAD_AFTER_S``,
never a hang. A service that is connected but does not answer pings is busy
(a long engine step holds its event loop) until ``HUNG_AFTER_S``, when it is
taken for hung. Pings go on, so a service that comes back (a restart: a new
incarnation) registers again. Addresses may come from DNS and change: the
list is resolved again every ``RESOLVE_INTERVAL_S``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from api.stack import messages as m
from api.stack.transport import (
    HEARTBEAT_INTERVAL_S, HEARTBEAT_TIMEOUT_S, PeerSpec, connect_dealer, recv_message, resolve_peers, send,
)

__all__ = ["DEAD_AFTER_S", "HUNG_AFTER_S", "Link", "LinkSet", "PING_INTERVAL_S", "ServiceDown"]

log = logging.getLogger(__name__)

PING_INTERVAL_S = 0.25
# The longest a dead service's connection stays open: a heartbeat, then its timeout.
DEAD_AFTER_S = HEARTBEAT_INTERVAL_S + HEARTBEAT_TIMEOUT_S  # inside the 2 s in which a dead worker leaves routing
# Far beyond any engine step (prefill is chunked) or encoder call.
HUNG_AFTER_S = 30.0
RESOLVE_INTERVAL_S = 5.0
_CONNECTION_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED


class ServiceDown(RuntimeError):
    """The service holding a request stopped answering (HTTP 503)."""


Pong = TypeVar("Pong", m.WorkerPong, m.EncoderPong)


@dataclass(eq=False)
class Link(Generic[Pong]):
    address: str
    sock: zmq.asyncio.Socket
    monitor: zmq.asyncio.Socket  # the socket's connection events
    pong: Pong | None = None  # the last answer: who it is, its load
    last_pong: float = 0.0
    alive: bool = False
    # Until the monitor says otherwise: a handshake may finish before the monitor is attached.
    connected: bool = True
    waiting: dict[str, asyncio.Queue[Any]] = field(default_factory=dict)  # request id -> its messages
    # Requests failed here when the link went down: the service may still be working on them.
    orphaned: set[str] = field(default_factory=set)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)  # its receiver and connection watcher

    @property
    def name(self) -> str:
        if self.pong is None:
            return self.address
        return self.pong.worker_id if isinstance(self.pong, m.WorkerPong) else self.pong.encoder_id

    @property
    def incarnation(self) -> str:
        return self.pong.incarnation if self.pong is not None else ""

    def fail_waiting(self, error: Exception) -> None:
        for queue in self.waiting.values():
            queue.put_nowait(error)


class LinkSet(Generic[Pong]):
    """Links to every address of a peer list, with liveness. Subclasses say
    what a pong means (``on_up``/``on_down``) and route other messages."""

    def __init__(self, peers: list[PeerSpec], pong_type: type[Pong], sender: str) -> None:
        self.peers = peers
        self.pong_type = pong_type
        self.sender = sender
        self.identity = f"{sender}-{uuid.uuid4().hex[:8]}".encode()
        self.links: dict[str, Link[Pong]] = {}
        self._context: zmq.asyncio.Context | None = None
        self._tasks: list[asyncio.Task[None]] = []

    # ------------------------------------------------------------------ life
    async def start(self) -> None:
        self._context = zmq.asyncio.Context()
        await self._resolve()
        self._tasks = [asyncio.create_task(self._keep_resolving()), asyncio.create_task(self._keep_pinging())]

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        for link in list(self.links.values()):
            self._drop(link)
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._context is not None:
            self._context.term()

    def alive(self) -> list[Link[Pong]]:
        return [link for link in self.links.values() if link.alive]

    # ------------------------------------------------------------- addresses
    async def _resolve(self) -> None:
        addresses = await asyncio.to_thread(resolve_peers, self.peers)
        for address in addresses:
            if address not in self.links:
                self._add(address)
        for address in set(self.links) - set(addresses):
            log.info("%s left the peer list", address)
            self._drop(self.links[address])

    async def _keep_resolving(self) -> None:
        if all(peer.scheme == "tcp" for peer in self.peers):
            return
        while True:
            await asyncio.sleep(RESOLVE_INTERVAL_S)
            with contextlib.suppress(Exception):
                await self._resolve()

    def _add(self, address: str) -> None:
        assert self._context is not None
        sock = connect_dealer(self._context, address, self.identity, heartbeats=True)
        link: Link[Pong] = Link(address, sock, sock.get_monitor_socket(_CONNECTION_EVENTS))
        link.tasks = [asyncio.create_task(self._receive(link)), asyncio.create_task(self._watch_connection(link))]
        self.links[address] = link

    def _drop(self, link: Link[Pong]) -> None:
        self._set_down(link, f"{link.name} left the peer list")
        self.links.pop(link.address, None)
        for task in link.tasks:
            task.cancel()
        link.sock.disable_monitor()
        link.monitor.close()
        link.sock.close()

    # -------------------------------------------------------------- liveness
    async def _keep_pinging(self) -> None:
        while True:
            now = time.monotonic()
            for link in list(self.links.values()):
                await send(link.sock, m.Ping(m.PROTOCOL_VERSION, self.sender, time.time()))
                if link.alive and now - link.last_pong > HUNG_AFTER_S:
                    log.warning("%s (%s) is connected but has not answered for %.0f s", link.name, link.address,
                                HUNG_AFTER_S)
                    self._set_down(link, f"{link.name} stopped answering")
            await asyncio.sleep(PING_INTERVAL_S)

    async def _watch_connection(self, link: Link[Pong]) -> None:
        while True:
            event = parse_monitor_message(await link.monitor.recv_multipart())["event"]
            link.connected = event == zmq.EVENT_HANDSHAKE_SUCCEEDED
            if not link.connected and link.alive:
                log.warning("%s (%s) stopped answering: its connection closed", link.name, link.address)
                self._set_down(link, f"{link.name} stopped answering")

    async def _receive(self, link: Link[Pong]) -> None:
        while True:
            _, message = await recv_message(link.sock, with_identity=False)
            try:
                if isinstance(message, self.pong_type):
                    self._on_pong(link, message)
                else:
                    self.on_message(link, message)
            except Exception:  # noqa: BLE001 - one bad message must not stop the link
                log.exception("handling %s from %s failed", type(message).__name__, link.address)

    def _on_pong(self, link: Link[Pong], pong: Pong) -> None:
        if not link.connected:
            return  # sent before its connection closed
        restarted = link.pong is not None and pong.incarnation != link.pong.incarnation
        if restarted and link.alive:
            self._set_down(link, f"{link.name} restarted")
        if restarted:
            link.orphaned.clear()  # a new incarnation holds nothing of the old one's
        link.pong, link.last_pong = pong, time.monotonic()
        if not link.alive:
            link.alive = True
            log.info("%s is up at %s", link.name, link.address)
            self.on_up(link)
            if link.orphaned:
                orphaned, link.orphaned = link.orphaned, set()
                self.on_orphans(link, orphaned)
        self.on_pong(link)

    def _set_down(self, link: Link[Pong], why: str) -> None:
        if not link.alive:
            return
        link.alive = False
        self.on_down(link)
        link.fail_waiting(ServiceDown(f"{why}; retry the request"))
        link.orphaned.update(link.waiting)
        link.waiting.clear()

    # ----------------------------------------------------------------- hooks
    def on_up(self, link: Link[Pong]) -> None:
        pass

    def on_down(self, link: Link[Pong]) -> None:
        pass

    def on_pong(self, link: Link[Pong]) -> None:
        pass

    def on_orphans(self, link: Link[Pong], request_ids: set[str]) -> None:
        """The service came back (the same incarnation) after its link went
        down: ``request_ids`` were failed here then and may still run there."""

    def on_message(self, link: Link[Pong], message: object) -> None:
        request_id = getattr(message, "request_id", None)
        queue = link.waiting.get(request_id) if request_id is not None else None
        if queue is not None:
            queue.put_nowait(message)

    # --------------------------------------------------------------- helpers
    async def request(self, link: Link[Pong], request_id: str, message: object) -> asyncio.Queue[Any]:
        """Send ``message`` and return the queue its answers arrive on (or an
        exception, if the service goes down)."""
        queue: asyncio.Queue[Any] = asyncio.Queue()
        link.waiting[request_id] = queue
        if not link.alive or not await send(link.sock, message):
            link.waiting.pop(request_id, None)
            raise ServiceDown(f"{link.name} is unreachable; retry the request")
        return queue

