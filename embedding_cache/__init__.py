"""Content-addressed multimodal embedding cache.

``media_key`` names an embedding by what produced it (media kind, content,
preprocessing parameters, encoder); ``SharedEmbeddingStore`` keeps embeddings in
shared memory for every server process on a machine; ``ConsistentHashRing``
decides which machine of a cluster owns a key and ``EmbeddingCache`` asks it;
``MediaEmbedder`` puts the cache in front of preprocessing and the encoders.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llm_core.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from embedding_cache.cluster import EmbeddingCache, RemoteCacheNode, embedding_cache_routes
    from embedding_cache.keys import KEY_BYTES, key_hex, media_key
    from embedding_cache.ring import ConsistentHashRing
    from embedding_cache.service import MediaEmbedder, MediaEmbedderConfig
    from embedding_cache.store import SharedEmbeddingStore
    from embedding_cache.store_segment import DTYPE_NAMES, MAX_NDIM, StoreLayoutError

# Where each public name lives, loaded on first use: a process that only makes
# or reads the store (a stack's supervisor, a worker) never imports the cluster
# client, the encoders or media decoding (torch, torchvision).
_EXPORTS = {
    "EmbeddingCache": "embedding_cache.cluster",
    "RemoteCacheNode": "embedding_cache.cluster",
    "embedding_cache_routes": "embedding_cache.cluster",
    "KEY_BYTES": "embedding_cache.keys",
    "key_hex": "embedding_cache.keys",
    "media_key": "embedding_cache.keys",
    "ConsistentHashRing": "embedding_cache.ring",
    "MediaEmbedder": "embedding_cache.service",
    "MediaEmbedderConfig": "embedding_cache.service",
    "SharedEmbeddingStore": "embedding_cache.store",
    "DTYPE_NAMES": "embedding_cache.store_segment",
    "MAX_NDIM": "embedding_cache.store_segment",
    "StoreLayoutError": "embedding_cache.store_segment",
}

__all__ = [
    "DTYPE_NAMES",
    "KEY_BYTES",
    "MAX_NDIM",
    "ConsistentHashRing",
    "EmbeddingCache",
    "MediaEmbedder",
    "MediaEmbedderConfig",
    "RemoteCacheNode",
    "SharedEmbeddingStore",
    "StoreLayoutError",
    "embedding_cache_routes",
    "key_hex",
    "media_key",
]

__getattr__ = lazy_exports(__name__, globals(), _EXPORTS)
