"""The prefix cache's records: a node of its radix tree (a full page, and
the SWA of its positions while alive), the lock a running request holds on
its cached prefix, a match and its pages on the tiers, and the hit counters."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from llm_core.kv.tiers.kv_tiers import TIERS, Tier

__all__ = ["CacheLock", "CacheStats", "PageKey", "PrefixMatch", "RadixNode", "TierLengths", "TierPage"]

PageKey = Hashable  # tuple of a page's token ids (engine) or a block identity (trace)


@dataclass(eq=False)
class RadixNode:
    key: PageKey | None
    parent: RadixNode | None
    depth: int  # pages from the root; this node covers positions [(depth-1)*ps, depth*ps)
    address: bytes = b""  # hash chain of the prefix through this page (with tiers only)
    full_page: int = -1
    swa: list[int] | None = None  # SWA slots of this page's positions, None: tombstone
    children: dict[PageKey, RadixNode] = field(default_factory=dict)
    lock: int = 0  # running requests reading this node's full KV
    swa_lock: int = 0  # running requests reading this node's SWA KV
    stamp: int = 0  # last use of the full KV (any hit through this page), for LRU
    swa_stamp: int = 0  # last use of this page's SWA KV as a hit's window or a new checkpoint
    # 0: only an interval checkpoint's window (insurance, evicted first);
    # 1: the window of a prompt end, a finished request, or of a hit.
    swa_priority: int = 0
    alive: bool = True


@dataclass
class CacheLock:
    """What one running request holds in the cache."""

    nodes: list[RadixNode] = field(default_factory=list)
    swa_nodes: list[RadixNode] = field(default_factory=list)
    checkpoints: set[int] = field(default_factory=set)  # token ends already inserted


@dataclass(frozen=True)
class TierPage:
    """A page of a match past the device tree: where its full KV is."""

    key: PageKey
    address: bytes
    tier: Tier


@dataclass(frozen=True)
class PrefixMatch:
    nodes: tuple[RadixNode, ...]  # on the device
    length: int  # tokens
    restore: tuple[TierPage, ...] = ()  # the pages after ``nodes``, from the tiers

    def tokens_by_tier(self, page_size: int) -> dict[str, int]:
        """Hit tokens by where their full KV was found."""
        out = {"device": len(self.nodes) * page_size, **{t: 0 for t in TIERS}}
        for page in self.restore:
            out[page.tier] += page_size
        return out


@dataclass(frozen=True)
class TierLengths:
    """Cached (window-safe) prefix lengths using the device only, the device
    and host memory, and every tier."""

    device: int
    host: int
    disk: int


@dataclass
class CacheStats:
    cached_prompt_tokens: int = 0
    computed_prompt_tokens: int = 0
    cached_tokens_by_tier: dict[str, int] = field(default_factory=lambda: {"device": 0, **{t: 0 for t in TIERS}})

    @property
    def hit_rate(self) -> float:
        total = self.cached_prompt_tokens + self.computed_prompt_tokens
        return self.cached_prompt_tokens / total if total else 0.0
