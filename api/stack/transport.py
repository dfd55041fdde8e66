"""ZeroMQ sockets and peer addresses for the stack's processes.

Services (encoders, workers) bind a ROUTER socket; each API connects one
DEALER per service it uses. Frames are ``messages.encode``d structs; a frame
that is not one is logged and dropped, never trusted.

Peer lists are configuration, not code that assumes one host: comma-
separated ``tcp://HOST:PORT`` addresses, or ``dns://NAME:PORT`` for every
address NAME resolves to (a Kubernetes headless Service), resolved again
every few seconds so peers that come and go are picked up.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio

from api.stack.messages import ProtocolError, decode, encode

__all__ = ["PeerSpec", "bind_router", "connect_dealer", "parse_peers", "recv_message", "resolve_peers", "send"]

log = logging.getLogger(__name__)

# A socket closes at once, dropping what it could not send: a dead peer must not hold up a shutdown.
_LINGER_MS = 0
# Messages queued per peer before sends to it are dropped (a peer that stopped reading).
_HIGH_WATER_MARK = 100_000
# ZMTP heartbeats: libzmq's own threads ping the peer and answer its pings,
# whatever the process's Python is doing (a long engine step holds the event
# loop, not the connection). A connection that hears nothing for the timeout
# after a ping is closed: its peer was killed, frozen or cut off.
HEARTBEAT_INTERVAL_S = 0.25
HEARTBEAT_TIMEOUT_S = 1.25


@dataclass(frozen=True)
class PeerSpec:
    """One entry of a peer list: a fixed address, or a DNS name and port."""

    scheme: str  # "tcp" | "dns" | "ipc"
    host: str  # for "ipc": the socket's path
    port: int

    @property
    def address(self) -> str:
        return f"ipc://{self.host}" if self.scheme == "ipc" else f"tcp://{self.host}:{self.port}"


def parse_peers(text: str) -> list[PeerSpec]:
    """``tcp://HOST:PORT`` / ``dns://NAME:PORT`` entries, comma-separated."""
    peers = []
    for entry in (part.strip() for part in text.split(",")):
        if not entry:
            continue
        scheme, sep, rest = entry.partition("://")
        if scheme == "ipc" and rest:
            peers.append(PeerSpec("ipc", rest, 0))  # a Unix socket on this machine (`serve`'s engine core)
            continue
        host, colon, port = rest.rpartition(":")
        if not sep or scheme not in ("tcp", "dns") or not colon or not host or not port.isdigit():
            raise ValueError(f"bad peer address {entry!r}: use tcp://HOST:PORT, dns://NAME:PORT or ipc://PATH")
        peers.append(PeerSpec(scheme, host.strip("[]"), int(port)))
    return peers


def resolve_peers(peers: list[PeerSpec]) -> list[str]:
    """Every ``tcp://`` address the peer list names now (DNS names looked up;
    one that does not resolve names nobody, for now)."""
    out: list[str] = []
    for peer in peers:
        if peer.scheme in ("tcp", "ipc"):
            out.append(peer.address)
            continue
        try:
            infos = socket.getaddrinfo(peer.host, peer.port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            log.warning("peer name %s does not resolve (%s)", peer.host, exc)
            continue
        # One address per peer: a dual-stack name (localhost) must not become two links to one process.
        v4 = [info for info in infos if info[0] == socket.AF_INET]
        for info in sorted({info[4][0] for info in v4 or infos}):
            host = f"[{info}]" if ":" in info else info
            out.append(f"tcp://{host}:{peer.port}")
    return list(dict.fromkeys(out))


def _configure(sock: zmq.asyncio.Socket) -> zmq.asyncio.Socket:
    sock.setsockopt(zmq.LINGER, _LINGER_MS)
    sock.setsockopt(zmq.SNDHWM, _HIGH_WATER_MARK)
    sock.setsockopt(zmq.RCVHWM, _HIGH_WATER_MARK)
    return sock


def bind_router(context: zmq.asyncio.Context, host: str, port: int, ipc_path: str | None = None) -> zmq.asyncio.Socket:
    """On ``tcp://host:port``, or on the Unix socket ``ipc_path`` when given."""
    sock = _configure(context.socket(zmq.ROUTER))
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # an API that reconnects under its old id takes its place
    if ipc_path is not None:
        sock.bind(f"ipc://{ipc_path}")
        return sock
    if ":" in host and not host.startswith("["):
        sock.setsockopt(zmq.IPV6, 1)
        host = f"[{host}]"
    sock.bind(f"tcp://{host}:{port}")
    return sock


def connect_dealer(context: zmq.asyncio.Context, address: str, identity: bytes,
                   heartbeats: bool = False) -> zmq.asyncio.Socket:
    """With ``heartbeats``, a peer that goes silent at the transport closes the
    connection (what it was sent and did not take is lost): for a link whose
    owner watches its connection. Without, a frozen peer's messages wait for it."""
    sock = _configure(context.socket(zmq.DEALER))
    sock.setsockopt(zmq.IDENTITY, identity)
    # Messages are not queued for a peer that is not connected: a request sent
    # to a worker that is down must fail now, not reach its next incarnation.
    sock.setsockopt(zmq.IMMEDIATE, 1)
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
    if heartbeats:
        sock.setsockopt(zmq.HEARTBEAT_IVL, int(HEARTBEAT_INTERVAL_S * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(HEARTBEAT_TIMEOUT_S * 1000))
    if "[" in address:
        sock.setsockopt(zmq.IPV6, 1)
    sock.connect(address)
    return sock


async def send(sock: zmq.asyncio.Socket, message: object, identity: bytes | None = None) -> bool:
    """Send without blocking; False when it cannot go now (no connected peer,
    or the peer's queue is full)."""
    frames = [encode(message)] if identity is None else [identity, encode(message)]  # type: ignore[arg-type]
    try:
        await sock.send_multipart(frames, flags=zmq.NOBLOCK)
    except zmq.Again:
        return False
    except zmq.ZMQError as exc:
        if exc.errno == zmq.EHOSTUNREACH:
            return False
        raise
    return True


async def recv_message(sock: zmq.asyncio.Socket, with_identity: bool,
                       on_bad: Callable[[str], None] | None = None) -> tuple[bytes | None, object]:
    """The next well-formed message (and its sender's identity, on a ROUTER)."""
    while True:
        frames = await sock.recv_multipart()
        identity = frames[0] if with_identity else None
        body = frames[-1]
        try:
            return identity, decode(body)
        except ProtocolError as exc:
            (on_bad or log.warning)(f"dropped a frame: {exc}")
            await asyncio.sleep(0)
