"""Embedding lookups across machines.

Each machine keeps one ``SharedEmbeddingStore`` that all its processes share. A
``ConsistentHashRing`` over the machines names one *owner* per key; a miss in
local shared memory asks the owner, and a freshly computed embedding is stored
locally and sent to its owner, so any machine that meets the same content later
finds it with one network hop. Adding or removing a machine changes the owner
of only ~1/N of the keys.

A remote node that is down or slow costs a miss, never a failed request.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import httpx
import torch
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from embedding_cache.keys import KEY_BYTES
from embedding_cache.ring import ConsistentHashRing
from embedding_cache.store import SharedEmbeddingStore

__all__ = ["EmbeddingCache", "RemoteCacheNode", "embedding_cache_routes"]

log = logging.getLogger(__name__)

ROUTE = "/internal/embeddings/{key}"
_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}
_MAX_VALUE_BYTES = 256 << 20


def _encode(value: torch.Tensor) -> tuple[bytes, dict[str, str]]:
    if value.dtype not in _DTYPE_NAMES:
        raise ValueError(f"cannot ship a {value.dtype} embedding")
    flat = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    headers = {"x-swallow-dtype": _DTYPE_NAMES[value.dtype], "x-swallow-shape": ",".join(map(str, value.shape))}
    return flat.numpy().tobytes(), headers


def _decode(body: bytes, dtype_name: str | None, shape_text: str | None) -> torch.Tensor:
    if dtype_name not in _DTYPES or shape_text is None:
        raise ValueError("missing or unknown x-swallow-dtype / x-swallow-shape headers")
    shape = tuple(int(x) for x in shape_text.split(",")) if shape_text else ()
    dtype = _DTYPES[dtype_name]
    expected = dtype.itemsize
    for n in shape:
        expected *= n
    if len(body) != expected:
        raise ValueError(f"body has {len(body)} bytes, {dtype_name}{list(shape)} needs {expected}")
    return torch.frombuffer(bytearray(body), dtype=torch.uint8).view(dtype).reshape(shape)


def _parse_key(text: str) -> bytes:
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise ValueError(f"a key is {2 * KEY_BYTES} hex digits")
    return key


def embedding_cache_routes(store: SharedEmbeddingStore) -> list[Route]:
    """GET/PUT of raw embeddings by hex key, for other machines' ``RemoteCacheNode``."""

    async def get(request: Request) -> Response:
        try:
            key = _parse_key(request.path_params["key"])
        except ValueError as exc:
            return Response(str(exc), status_code=400)
        value = store.get(key)
        if value is None:
            return Response(status_code=404)
        body, headers = _encode(value)
        return Response(body, media_type="application/octet-stream", headers=headers)

    async def put(request: Request) -> Response:
        try:
            key = _parse_key(request.path_params["key"])
            if int(request.headers.get("content-length", "0")) > _MAX_VALUE_BYTES:
                return Response("embedding too large", status_code=413)
            value = _decode(
                await request.body(), request.headers.get("x-swallow-dtype"), request.headers.get("x-swallow-shape")
            )
        except ValueError as exc:
            return Response(str(exc), status_code=400)
        stored = store.put(key, value)
        return Response(status_code=204 if stored else 507)

    return [Route(ROUTE, get, methods=["GET"]), Route(ROUTE, put, methods=["PUT"])]


class RemoteCacheNode:
    """Another machine's embedding store, over HTTP."""

    def __init__(self, base_url: str, timeout_s: float = 1.0, client: httpx.AsyncClient | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self._client = client or httpx.AsyncClient(timeout=timeout_s)

    def _url(self, key: bytes) -> str:
        return self.base_url + ROUTE.format(key=key.hex())

    async def get(self, key: bytes) -> torch.Tensor | None:
        response = await self._client.get(self._url(key))
        if response.status_code == 404:
            return None
        response.raise_for_status()
        return _decode(
            response.content, response.headers.get("x-swallow-dtype"), response.headers.get("x-swallow-shape")
        )

    async def put(self, key: bytes, value: torch.Tensor) -> bool:
        body, headers = _encode(value)
        response = await self._client.put(self._url(key), content=body, headers=headers)
        return response.status_code == 204

    async def aclose(self) -> None:
        await self._client.aclose()


@dataclass
class ClusterStats:
    local_hits: int = 0
    remote_hits: int = 0
    misses: int = 0
    remote_errors: int = 0


class EmbeddingCache:
    """Local shared memory, then the key's owner machine (when a ring is given).
    ``node`` is this machine's name in the ring; a process on a machine that
    owns no keys (an LLM worker beside no encoder) passes None and asks each
    key's owner."""

    def __init__(
        self,
        local: SharedEmbeddingStore | None,
        ring: ConsistentHashRing | None = None,
        node: str | None = None,
        remotes: Mapping[str, RemoteCacheNode] | None = None,
    ) -> None:
        self.local = local
        self.node = node
        self.ring: ConsistentHashRing | None = None
        self.remotes: dict[str, RemoteCacheNode] = {}
        self.set_ring(ring, remotes or {})
        self.stats = ClusterStats()

    def set_ring(self, ring: ConsistentHashRing | None, remotes: Mapping[str, RemoteCacheNode]) -> None:
        """The machines of the cluster, now (they change when machines come and go)."""
        node = self.node
        if ring is not None and node is not None and node not in ring.nodes:
            raise ValueError(f"this node {node!r} must be one of the ring's nodes {ring.nodes}")
        missing = set(ring.nodes if ring is not None else ()) - {node} - set(remotes)
        if missing:
            raise ValueError(f"no address for ring nodes {sorted(missing)}")
        self.ring, self.remotes = ring, dict(remotes)

    def owner(self, key: bytes) -> str | None:
        return None if self.ring is None else self.ring.node_for(key)

    def _remote_for(self, key: bytes) -> RemoteCacheNode | None:
        owner = self.owner(key)
        return None if owner is None or owner == self.node else self.remotes[owner]

    async def get(self, key: bytes) -> torch.Tensor | None:
        if self.local is not None and (value := self.local.get(key)) is not None:
            self.stats.local_hits += 1
            return value
        remote = self._remote_for(key)
        if remote is not None:
            try:
                value = await remote.get(key)
            except (httpx.HTTPError, ValueError) as exc:
                self.stats.remote_errors += 1
                log.warning("embedding cache node %s unavailable: %s", remote.base_url, exc)
                value = None
            if value is not None:
                self.stats.remote_hits += 1
                if self.local is not None:
                    self.local.put(key, value)
                return value
        self.stats.misses += 1
        return None

    async def put(self, key: bytes, value: torch.Tensor) -> None:
        if self.local is not None:
            self.local.put(key, value)
        remote = self._remote_for(key)
        if remote is not None:
            try:
                await remote.put(key, value)
            except httpx.HTTPError as exc:
                self.stats.remote_errors += 1
                log.warning("embedding cache node %s unavailable: %s", remote.base_url, exc)

    async def aclose(self) -> None:
        for remote in self.remotes.values():
            await remote.aclose()
