"""The embedding store as the stack's processes see it: this machine's shared
memory, then, across machines, the key's owner on a consistent-hash ring of
the encoders' HTTP ports (``--embedding-peers``: ``NODE=URL,...`` or
``dns://NAME:PORT``, every address NAME resolves to being one node)."""

from __future__ import annotations

import asyncio
import logging

from api.stack.transport import parse_peers, resolve_peers
from embedding_cache import ConsistentHashRing, EmbeddingCache, RemoteCacheNode, SharedEmbeddingStore

__all__ = ["embedding_cache", "keep_ring_fresh"]

log = logging.getLogger(__name__)


def _ring_nodes(peers: str) -> dict[str, str]:
    """node -> base URL."""
    nodes: dict[str, str] = {}
    entries = [e.strip() for e in peers.split(",") if e.strip()]
    named = [e for e in entries if "=" in e]
    for entry in named:
        node, _, url = entry.partition("=")
        if not node or not url.startswith(("http://", "https://")):
            raise ValueError(f"bad --embedding-peers entry {entry!r}: use NODE=http://HOST:PORT or dns://NAME:PORT")
        nodes[node] = url.rstrip("/")
    dns = ",".join(e for e in entries if "=" not in e)
    for address in resolve_peers(parse_peers(dns)) if dns else []:
        host_port = address.removeprefix("tcp://")
        nodes[host_port.rpartition(":")[0].strip("[]")] = f"http://{host_port}"
    return nodes


def embedding_cache(store: SharedEmbeddingStore | None, peers: str, node: str | None) -> EmbeddingCache:
    """This machine's store, in front of the ring ``peers`` names (none: the store alone)."""
    cache = EmbeddingCache(store, node=node)
    if peers:
        _refresh(cache, peers)
    return cache


def _refresh(cache: EmbeddingCache, peers: str) -> None:
    nodes = _ring_nodes(peers)
    if cache.node is not None and cache.node not in nodes:
        nodes[cache.node] = ""  # this machine is a node whatever DNS says yet
    remotes = {n: cache.remotes.get(n) or RemoteCacheNode(url) for n, url in nodes.items() if n != cache.node}
    cache.set_ring(ConsistentHashRing(nodes) if nodes else None, remotes)


async def keep_ring_fresh(cache: EmbeddingCache, peers: str, every_s: float = 10.0) -> None:
    """Resolve DNS-named peers again now and then (machines come and go)."""
    if "dns://" not in peers:
        return
    while True:
        await asyncio.sleep(every_s)
        try:
            _refresh(cache, peers)
        except Exception:  # noqa: BLE001 - keep the last ring
            log.exception("refreshing the embedding ring failed")
