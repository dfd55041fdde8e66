"""EmbeddingCache across machines: owner lookups over HTTP, dead nodes cost only a miss."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import httpx
import pytest
import torch
from starlette.applications import Starlette

from embedding_cache.cluster import EmbeddingCache, RemoteCacheNode, embedding_cache_routes
from embedding_cache.keys import media_key
from embedding_cache.ring import ConsistentHashRing
from embedding_cache.store import SharedEmbeddingStore

NODES = ("node-a", "node-b", "node-c")


@pytest.fixture
def stores() -> Iterator[dict[str, SharedEmbeddingStore]]:
    made = {n: SharedEmbeddingStore.create(f"swallow-{n}-{uuid.uuid4().hex[:10]}", 4 << 20) for n in NODES}
    yield made
    for s in made.values():
        s.close()
        s.unlink()


def _remote(store: SharedEmbeddingStore, name: str) -> RemoteCacheNode:
    """A node reached through its real HTTP routes (in-process ASGI transport)."""
    app = Starlette(routes=embedding_cache_routes(store))
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=f"http://{name}")
    return RemoteCacheNode(f"http://{name}", client=client)


def _cache(me: str, stores: dict[str, SharedEmbeddingStore], ring: ConsistentHashRing) -> EmbeddingCache:
    remotes = {n: _remote(stores[n], n) for n in ring.nodes if n != me}
    return EmbeddingCache(stores[me], ring, me, remotes)


def _keys(n: int) -> list[bytes]:
    return [media_key("image", str(i).encode(), {}, "enc") for i in range(n)]


def test_value_computed_on_one_node_is_found_from_another(stores: dict) -> None:
    ring = ConsistentHashRing(NODES)
    keys = _keys(30)

    async def main() -> None:
        a, c = _cache("node-a", stores, ring), _cache("node-c", stores, ring)
        values = {k: torch.randn(5, 7).to(torch.bfloat16 if i % 2 else torch.float32) for i, k in enumerate(keys)}
        for k, v in values.items():
            await a.put(k, v)
        for k, v in values.items():
            owner = ring.node_for(k)
            assert torch.equal(stores[owner].get(k), v)  # the owner machine holds it
            got = await c.get(k)
            assert got is not None and got.dtype == v.dtype and torch.equal(got, v)
        # Keys node-c owns were pushed to it by node-a's put; the rest come from their owners.
        owned_by_c = sum(ring.node_for(k) == "node-c" for k in keys)
        assert 0 < owned_by_c < len(keys)
        assert c.stats.local_hits == owned_by_c and c.stats.remote_hits == len(keys) - owned_by_c
        # Fetched values are replicated locally: the second read is local.
        before = c.stats.remote_hits
        for k in keys:
            await c.get(k)
        assert c.stats.remote_hits == before
        await a.aclose()
        await c.aclose()

    asyncio.run(main())


def test_dead_owner_costs_a_miss_not_an_error(stores: dict) -> None:
    ring = ConsistentHashRing(("node-a", "node-b"))
    dead = RemoteCacheNode("http://127.0.0.1:9", timeout_s=0.5)  # nothing listens on the discard port
    cache = EmbeddingCache(stores["node-a"], ring, "node-a", {"node-b": dead})
    key = next(k for k in _keys(50) if ring.node_for(k) == "node-b")

    async def main() -> None:
        assert await cache.get(key) is None
        await cache.put(key, torch.ones(3))  # stored locally, owner unreachable
        assert torch.equal(await cache.get(key), torch.ones(3))
        assert cache.stats.remote_errors == 2
        await cache.aclose()

    asyncio.run(main())


def test_routes_reject_bad_requests(stores: dict) -> None:
    app = Starlette(routes=embedding_cache_routes(stores["node-a"]))

    async def main() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x") as client:
            assert (await client.get("/internal/embeddings/zz")).status_code == 400
            key = "ab" * 32
            assert (await client.get(f"/internal/embeddings/{key}")).status_code == 404
            bad = await client.put(f"/internal/embeddings/{key}", content=b"123",
                                   headers={"x-swallow-dtype": "float32", "x-swallow-shape": "2"})
            assert bad.status_code == 400 and "needs 8" in bad.text
            ok = await client.put(f"/internal/embeddings/{key}", content=b"\0" * 8,
                                  headers={"x-swallow-dtype": "float32", "x-swallow-shape": "2"})
            assert ok.status_code == 204
            got = await client.get(f"/internal/embeddings/{key}")
            assert got.status_code == 200 and got.headers["x-swallow-shape"] == "2"

    asyncio.run(main())


def test_ring_node_without_address_is_refused(stores: dict) -> None:
    with pytest.raises(ValueError, match="no address"):
        EmbeddingCache(stores["node-a"], ConsistentHashRing(NODES), "node-a", {})
    with pytest.raises(ValueError, match="must be one of"):
        EmbeddingCache(stores["node-a"], ConsistentHashRing(NODES), "node-z", {})
