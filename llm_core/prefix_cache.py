"""Window-safe radix prefix cache for hybrid SWA models.

A trie with one node per full page of tokens, shared by all requests of a
worker. Each node owns its page in the full pool and, while alive, the SWA
slots of its positions; SWA can be dropped (a tombstone) while the full KV
stays. A cached prefix of e tokens is reusable only if every page has full KV
and the SWA KV of its last W tokens is alive (*window-safe*); ``match``
returns the deepest window-safe point on the request's path, falling back to
earlier ones, never straight to zero.

SWA is kept only at checkpoints: the end of a prompt's last full page, the
end of a finished request, and optionally every ``checkpoint_interval``
tokens. Full KV and SWA KV have separate LRU eviction; nodes used by running
requests are locked. No torch here: the same cache runs in the engine and in
the trace simulator.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from llm_core.kv_pool import KVAllocator, SequenceView

PageKey = Hashable  # tuple of a page's token ids (engine) or a block identity (trace)


@dataclass(eq=False)
class RadixNode:
    key: PageKey | None
    parent: RadixNode | None
    depth: int  # pages from the root; this node covers positions [(depth-1)*ps, depth*ps)
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
class PrefixMatch:
    nodes: tuple[RadixNode, ...]
    length: int  # tokens


@dataclass
class CacheStats:
    cached_prompt_tokens: int = 0
    computed_prompt_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        total = self.cached_prompt_tokens + self.computed_prompt_tokens
        return self.cached_prompt_tokens / total if total else 0.0


class RadixCache:
    def __init__(
        self,
        allocator: KVAllocator,
        checkpoint_interval: int | None = None,
        keep_all_swa: bool | None = None,
        fallback: bool = True,
        prompt_checkpoints: bool = True,
    ) -> None:
        """``keep_all_swa`` keeps SWA KV for every cached token (required when
        SWA layers keep the whole sequence, ``swa_mode="full"``);
        ``fallback=False`` matches only the deepest full-KV point and
        ``prompt_checkpoints=False`` keeps SWA only where requests finish
        (together: the tombstones-without-checkpoints baseline)."""
        self.allocator = allocator
        self.page_size = allocator.full.page_size
        self.window_tokens = max(allocator.window - 1, 0)  # W
        self.keep_all_swa = allocator.swa_mode == "full" if keep_all_swa is None else keep_all_swa
        self.checkpoint_interval = checkpoint_interval
        self.fallback = fallback
        self.prompt_checkpoints = prompt_checkpoints
        self.root = RadixNode(None, None, 0)
        self.stats = CacheStats()
        self._clock = itertools.count(1)
        self._tie = itertools.count()
        self._full_heap: list[tuple[int, int, RadixNode]] = []
        self._swa_heap: list[tuple[tuple[int, int], int, RadixNode]] = []
        self.num_nodes = 0
        self.swa_slots_cached = 0

    # ------------------------------------------------------------ geometry
    def page_keys(self, tokens: Sequence[int]) -> list[PageKey]:
        ps = self.page_size
        return [tuple(tokens[i : i + ps]) for i in range(0, len(tokens) - ps + 1, ps)]

    def window_start(self, end: int) -> int:
        """First position whose SWA KV a hit ending at ``end`` needs."""
        return 0 if self.keep_all_swa else max(0, end - self.window_tokens)

    def _window_nodes(self, path: Sequence[RadixNode], end: int) -> list[tuple[RadixNode, int]]:
        """(node, SWA tokens needed from the end of its page) for the window of ``end``."""
        ps, start = self.page_size, self.window_start(end)
        return [(path[j], (j + 1) * ps - max(start, j * ps)) for j in range(start // ps, end // ps)]

    # --------------------------------------------------------------- match
    def match(self, keys: Sequence[PageKey], max_pages: int | None = None) -> PrefixMatch:
        """Deepest window-safe prefix of ``keys`` (at most ``max_pages``)."""
        ps = self.page_size
        limit = len(keys) if max_pages is None else min(len(keys), max_pages)
        node, path = self.root, []
        covered = 0  # tokens of live SWA KV ending at the current depth
        best = 0
        for key in keys[:limit]:
            child = node.children.get(key)
            if child is None:
                break
            path.append(child)
            node = child
            held = len(child.swa) if child.swa is not None else 0
            covered = held + covered if held == ps else held
            end = len(path) * ps
            if covered >= end - self.window_start(end):
                best = len(path)
        if not self.fallback and best != len(path):
            best = 0
        stamp = next(self._clock)
        for n in path[:best]:
            self._touch(n, stamp)
        # Only the window a hit reads counts as SWA use: checkpoints passed on
        # the way age, so the SWA pool keeps the ones that serve hits.
        self._touch_swa([n for n, _ in self._window_nodes(path[:best], best * ps)], stamp, priority=1)
        return PrefixMatch(tuple(path[:best]), best * ps)

    def attach(self, view: SequenceView, match: PrefixMatch) -> CacheLock:
        """Point an empty view at a matched prefix (no copy) and lock it."""
        lock = CacheLock()
        if not match.nodes:
            return lock
        e = match.length
        window = self._window_nodes(match.nodes, e)
        view.full_pages = [n.full_page for n in match.nodes]
        view.rewrote_full_pages(0)
        view.shared_full_pages = len(match.nodes)
        view.swa_base = self.window_start(e)
        view.swa_ring = [slot for n, need in window for slot in n.swa[len(n.swa) - need :]]  # type: ignore[index]
        view.shared_swa_end = e
        view.num_tokens = e
        self._lock(lock, list(match.nodes), [n for n, _ in window])
        lock.checkpoints.add(e)
        return lock

    # -------------------------------------------------------------- insert
    def insert(
        self, view: SequenceView, keys: Sequence[PageKey], num_tokens: int, lock: CacheLock, durable: bool = True
    ) -> None:
        """Hand the request's first ``num_tokens`` tokens (page-aligned down)
        to the tree, with a checkpoint of the SWA KV of the W tokens before
        their end. ``durable=False`` marks an interval checkpoint, whose SWA
        goes before that of prompt ends and finished requests.

        Works mid-request (a prompt-end or interval checkpoint) as well as at
        the end: the request keeps reading what it handed over, now the
        tree's and locked under ``lock`` until ``release``.
        """
        ps = self.page_size
        pages = min(len(keys), num_tokens // ps, len(view.full_pages))
        e = pages * ps
        if pages == 0 or e in lock.checkpoints:
            return
        path = self._insert_full_pages(view, keys, pages)
        start = self.window_start(e)
        self._drop_ring_before(view, start)
        window = self._window_nodes(path, e)
        checkpointed = (
            view.swa_base <= start
            and e <= view.swa_end_pos
            and all(n.swa is None or len(n.swa) >= need or not n.swa_lock for n, need in window)
        )
        if checkpointed:
            self._checkpoint_swa(view, window)
            view.shared_swa_end = max(view.shared_swa_end, e)
        # Lock the new part of the path; the SWA lock moves to the newest window.
        self._lock(lock, path[len(lock.nodes) :], [])
        self._unlock_swa(lock)
        self._lock(lock, [], [n for n, _ in window] if checkpointed else [])
        lock.checkpoints.add(e)
        stamp = next(self._clock)
        for n in path:
            self._touch(n, stamp)
        if checkpointed:
            self._touch_swa([n for n, _ in window], stamp, priority=int(durable))

    def _insert_full_pages(self, view: SequenceView, keys: Sequence[PageKey], pages: int) -> list[RadixNode]:
        node, path = self.root, []
        for i in range(pages):
            child = node.children.get(keys[i])
            if child is None:
                child = self._new_node(keys[i], node, view.full_pages[i])
            elif child.full_page != view.full_pages[i]:
                # Another request cached this page first: read its copy, free ours.
                self.allocator.full.release([view.full_pages[i]])
                view.full_pages[i] = child.full_page
                view.rewrote_full_pages(i)
            path.append(child)
            node = child
        view.shared_full_pages = max(view.shared_full_pages, pages)
        return path

    def _drop_ring_before(self, view: SequenceView, pos: int) -> None:
        """Ring positions below ``pos`` are needed neither by the checkpoint
        nor by the request (its next query is at or after the checkpoint)."""
        cut = min(pos, view.swa_end_pos) - view.swa_base
        if cut <= 0:
            return
        owned_from = max(0, view.shared_swa_end - view.swa_base)
        self.allocator.swa.release(view.swa_ring[owned_from:cut])
        del view.swa_ring[:cut]
        view.swa_base += cut

    def _checkpoint_swa(self, view: SequenceView, window: list[tuple[RadixNode, int]]) -> None:
        """Give each window page the SWA suffix it needs, from the request's
        ring, unless the tree already has it (then the request reads the
        tree's copy and frees its own)."""
        ps = self.page_size
        for node, need in window:
            page_end = (node.depth) * ps
            lo, hi = page_end - need - view.swa_base, page_end - view.swa_base
            ring = view.swa_ring[lo:hi]
            owned = page_end - need >= view.shared_swa_end
            if node.swa is not None and len(node.swa) >= need:
                if owned:
                    self.allocator.swa.release(ring)
                    view.swa_ring[lo:hi] = node.swa[len(node.swa) - need :]
                continue
            if node.swa is not None:  # a shorter suffix, unlocked: replace it
                self.allocator.swa.release(node.swa)
                self.swa_slots_cached -= len(node.swa)
            node.swa = list(ring)  # the request's slots become the tree's
            self.swa_slots_cached += need

    def _unlock_swa(self, lock: CacheLock) -> None:
        for n in lock.swa_nodes:
            n.swa_lock -= 1
            if n.swa_lock == 0 and n.swa is not None:
                self._push_swa(n)
        lock.swa_nodes = []

    def release(self, lock: CacheLock) -> None:
        """The request is done with everything it held."""
        self._unlock_swa(lock)
        for n in reversed(lock.nodes):
            n.lock -= 1
            if n.lock == 0 and n.alive and not n.children:
                if n.swa is None:
                    self._remove(n)  # never leave a tombstone leaf
                else:
                    self._push_full(n)
        lock.nodes = []

    # ------------------------------------------------------------ eviction
    def evict_full(self, num_pages: int) -> int:
        """Free up to ``num_pages`` full pages from least recently used leaves."""
        freed = 0
        while freed < num_pages and self._full_heap:
            stamp, _, node = heapq.heappop(self._full_heap)
            if not node.alive or node.lock or node.children or stamp != node.stamp:
                continue
            freed += self._remove(node)
        return freed

    def evict_swa(self, num_slots: int) -> int:
        """Free up to ``num_slots`` SWA slots by tombstoning least recently used
        pages; a leaf left without SWA is useless and goes entirely."""
        freed = 0
        while freed < num_slots and self._swa_heap:
            (priority, stamp), _, node = heapq.heappop(self._swa_heap)
            if not node.alive or node.swa is None or node.swa_lock or (priority, stamp) != (
                node.swa_priority, node.swa_stamp
            ):
                continue
            freed += self.drop_swa(node)
        return freed

    def drop_swa(self, node: RadixNode) -> int:
        """Tombstone one unlocked node; a leaf left without SWA goes entirely."""
        if node.swa_lock:
            raise ValueError("node's SWA KV is in use")
        freed = self._tombstone(node)
        if not node.children and not node.lock and node.alive:
            self._remove(node)
        return freed

    def flush(self) -> None:
        """Drop everything no running request holds."""
        while self.evict_full(1 << 62) or self.evict_swa(1 << 62):
            pass

    # ------------------------------------------------------------- helpers
    def _new_node(self, key: PageKey, parent: RadixNode, full_page: int) -> RadixNode:
        node = RadixNode(key, parent, parent.depth + 1, full_page=full_page)
        parent.children[key] = node
        self.num_nodes += 1
        return node

    def _remove(self, node: RadixNode) -> int:
        """Evict a leaf completely; a parent left as an unlocked tombstone
        leaf goes too (never leave one), otherwise it may become evictable."""
        freed = 0
        while True:
            self.allocator.full.release([node.full_page])
            self._tombstone(node)
            node.alive = False
            parent = node.parent
            assert parent is not None
            del parent.children[node.key]
            self.num_nodes -= 1
            freed += 1
            if parent is self.root or parent.children or parent.lock:
                return freed
            if parent.swa is not None:
                self._push_full(parent)
                return freed
            node = parent

    def _tombstone(self, node: RadixNode) -> int:
        if node.swa is None:
            return 0
        node.swa_priority = 0
        self.allocator.swa.release(node.swa)
        n = len(node.swa)
        node.swa = None
        self.swa_slots_cached -= n
        return n

    def _lock(self, lock: CacheLock, nodes: list[RadixNode], swa_nodes: list[RadixNode]) -> None:
        for n in nodes:
            n.lock += 1
        for n in swa_nodes:
            n.swa_lock += 1
        lock.nodes.extend(nodes)
        lock.swa_nodes.extend(swa_nodes)

    def _touch(self, node: RadixNode, stamp: int) -> None:
        node.stamp = stamp
        if not node.children and not node.lock:
            self._push_full(node)

    def _touch_swa(self, nodes: list[RadixNode], stamp: int, priority: int) -> None:
        for node in nodes:
            node.swa_stamp = stamp
            node.swa_priority = max(node.swa_priority, priority)
            if node.swa is not None and not node.swa_lock:
                self._push_swa(node)

    def _push_full(self, node: RadixNode) -> None:
        heapq.heappush(self._full_heap, (node.stamp, next(self._tie), node))

    def _push_swa(self, node: RadixNode) -> None:
        heapq.heappush(self._swa_heap, ((node.swa_priority, node.swa_stamp), next(self._tie), node))
