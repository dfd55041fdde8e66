"""How a prefix cache names its pages, shared by the cache, its tiers and
the router that predicts its hits.

A full page's address is a hash chain over the token ids of every page from
the start of the sequence (multimodal spans enter as their cache tokens),
seeded with a model fingerprint: the same prefix has the same address in
every process and after a restart, and another model's pages are never read.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

ADDRESS_BYTES = 16


def model_fingerprint(*parts: bytes | str) -> bytes:
    """The root of every address chain: a hash of what makes KV bytes
    comparable (model config, weights identity, KV dtype, page size)."""
    h = xxhash.xxh3_128()
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.digest()


def token_bytes(key: Hashable) -> bytes:
    """A page key (a tuple of token ids, negative for multimodal cache tokens)
    as the bytes its address hashes."""
    return np.asarray(key, dtype=np.int64).tobytes()


def page_address(parent: bytes, key_bytes: bytes) -> bytes:
    """Address of a page: its parent's address chained with its own tokens."""
    return xxhash.xxh3_128_digest(parent + key_bytes)


@dataclass(frozen=True)
class CacheGeometry:
    """What a router must know of a worker's prefix cache: how its pages are
    addressed and what makes a prefix window-safe there."""

    fingerprint: bytes  # the root of the address chain (model, weights, KV layout)
    page_size: int
    window_tokens: int  # W: the SWA positions a hit needs before its end
    keep_all_swa: bool = False  # SWA KV for every position (no SWA support): the window is the whole prefix

    def window_start(self, end: int) -> int:
        return 0 if self.keep_all_swa else max(0, end - self.window_tokens)

    def max_pages(self, num_tokens: int) -> int:
        """Pages a request of ``num_tokens`` can reuse: one token must always run."""
        return max(0, num_tokens - 1) // self.page_size


def chain_addresses(root: bytes, page_keys: Iterable[bytes]) -> list[bytes]:
    """Addresses of consecutive pages given each page key's bytes (``page_address`` chained)."""
    out, parent = [], root
    for key in page_keys:
        parent = page_address(parent, key)
        out.append(parent)
    return out


def token_page_addresses(geometry: CacheGeometry, tokens: Sequence[int], max_pages: int | None = None) -> list[bytes]:
    """Addresses of the full pages of ``tokens`` (the prefix cache's view of a
    prompt: a multimodal span's positions hold its negative cache token)."""
    ps = geometry.page_size
    pages = len(tokens) // ps if max_pages is None else min(len(tokens) // ps, max_pages)
    raw = np.asarray(tokens[: pages * ps], dtype=np.int64).tobytes()
    width = ps * 8
    return chain_addresses(geometry.fingerprint, (raw[i * width : (i + 1) * width] for i in range(pages)))
