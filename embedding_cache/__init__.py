"""Content-addressed multimodal embedding cache.

``media_key`` names an embedding by what produced it (media kind, content,
preprocessing parameters, encoder); ``SharedEmbeddingStore`` keeps embeddings in
shared memory for every server process on a machine; ``ConsistentHashRing``
decides which machine of a cluster owns a key and ``EmbeddingCache`` asks it;
``MediaEmbedder`` puts the cache in front of preprocessing and the encoders.
"""

from embedding_cache.cluster import EmbeddingCache, RemoteCacheNode, embedding_cache_routes
from embedding_cache.keys import KEY_BYTES, key_hex, media_key
from embedding_cache.ring import ConsistentHashRing
from embedding_cache.store import SharedEmbeddingStore
from embedding_cache.store_segment import DTYPE_CODES, MAX_NDIM, StoreLayoutError

__all__ = [
    "DTYPE_CODES",
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


def __getattr__(name: str) -> object:
    # The embedder needs media decoding and the encoders (torchvision): loaded on
    # first use, so a process that only reads the store (a worker) never imports them.
    if name in ("MediaEmbedder", "MediaEmbedderConfig"):
        from embedding_cache import service

        return getattr(service, name)
    raise AttributeError(f"module 'embedding_cache' has no attribute {name!r}")
