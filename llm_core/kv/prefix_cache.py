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

With ``KVTiers`` below it (``kv_tiers.py``), the tree is what is on the
device and evicting demotes instead of dropping: a full page and the SWA
suffix of a page go to host memory (then disk) under the page's address. A
match walks the tree and then keeps going by address through the tiers; it
is window-safe when every page's full KV and every window page's SWA KV are
each on some tier, and ``attach`` restores what is not on the device.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from typing import TypeVar

from llm_core.kv.kv_events import KVEventLog
from llm_core.kv.kv_pool import KVAllocator, SequenceView
from llm_core.kv.tiers.kv_tiers import FULL, SWA, TIERS, KVTiers, Tier
from llm_core.kv.page_address import CacheGeometry, model_fingerprint, page_address, token_bytes
from llm_core.kv.prefix_cache_records import (
    CacheLock,
    CacheStats,
    PageKey,
    PrefixMatch,
    RadixNode,
    TierLengths,
    TierPage,
)


class RadixCache:
    def __init__(
        self,
        allocator: KVAllocator,
        checkpoint_interval: int | None = None,
        keep_all_swa: bool | None = None,
        fallback: bool = True,
        prompt_checkpoints: bool = True,
        tiers: KVTiers | None = None,
        fingerprint: bytes | None = None,
        key_bytes: Callable[[PageKey], bytes] = token_bytes,
        events: KVEventLog | None = None,
    ) -> None:
        """``keep_all_swa`` keeps SWA KV for every cached token (required when
        SWA layers keep the whole sequence, ``swa_mode="full"``);
        ``fallback=False`` matches only the deepest full-KV point and
        ``prompt_checkpoints=False`` keeps SWA only where requests finish
        (together: the tombstones-without-checkpoints baseline).
        ``tiers``: host/disk tiers under the device, pages addressed by a hash
        chain seeded with ``fingerprint`` over ``key_bytes`` of each page key.
        ``events``: every page stored or dropped and every checkpoint window's
        SWA kept or dropped is recorded there (pages are then addressed even
        without tiers), for a router."""
        self.allocator = allocator
        self.page_size = allocator.full.page_size
        self.window_tokens = max(allocator.window - 1, 0)  # W
        self.keep_all_swa = allocator.swa_mode == "full" if keep_all_swa is None else keep_all_swa
        self.checkpoint_interval = checkpoint_interval
        self.fallback = fallback
        self.prompt_checkpoints = prompt_checkpoints
        self.tiers = tiers if tiers is not None and tiers.config.enabled else None
        self.key_bytes = key_bytes
        self.events = events
        self.root = RadixNode(None, None, 0, address=fingerprint or model_fingerprint("swallow"))
        self.stats = CacheStats()
        self._clock = itertools.count(1)
        self._tie = itertools.count()
        self._full_heap: list[tuple[int, int, RadixNode]] = []
        self._swa_heap: list[tuple[tuple[int, int], int, RadixNode]] = []
        self.num_nodes = 0
        self.swa_slots_cached = 0

    # ------------------------------------------------------------ geometry
    def geometry(self) -> CacheGeometry:
        """How a router addresses this cache's pages and judges its windows."""
        return CacheGeometry(self.root.address, self.page_size, self.window_tokens, self.keep_all_swa)

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
        """Deepest window-safe prefix of ``keys`` (at most ``max_pages``),
        through the device tree and then the tiers."""
        ps = self.page_size
        limit = len(keys) if max_pages is None else min(len(keys), max_pages)
        path, pages, best = self._walk(keys, limit, TIERS if self.tiers is not None else ())
        if not self.fallback and best != len(path) + len(pages):
            best = 0
        device = path[:best]
        stamp = next(self._clock)
        for n in device:
            self._touch(n, stamp)
        found = PrefixMatch(tuple(device), best * ps, tuple(pages[: max(0, best - len(path))]))
        # Only the window a hit reads counts as SWA use: checkpoints passed on
        # the way age, so the SWA pool keeps the ones that serve hits.
        window = self._window_needs(device, found)
        self._touch_swa([n for n, _ in window if n is not None], stamp, priority=1)
        if self.tiers is not None:  # what a restore will read goes last in the tiers' LRU
            for page in found.restore:
                self.tiers.touch_page(page.address)
            for n, _ in window:
                if n is not None:
                    self.tiers.touch_page(n.address)
        return found

    def peek(self, keys: Sequence[PageKey], max_pages: int | None = None) -> TierLengths:
        """Cached lengths of ``keys`` per tier, changing nothing (no LRU touch)."""
        limit = len(keys) if max_pages is None else min(len(keys), max_pages)
        if self.tiers is None:
            device = self._walk(keys, limit, ())[2] * self.page_size
            return TierLengths(device, device, device)
        return TierLengths(*(self._walk(keys, limit, tiers)[2] * self.page_size for tiers in ((), TIERS[:1], TIERS)))

    def _walk(
        self, keys: Sequence[PageKey], limit: int, tiers: Sequence[Tier]
    ) -> tuple[list[RadixNode], list[TierPage], int]:
        """The device nodes on ``keys``' path, the pages after them found in
        ``tiers``, and how many pages of the two are a window-safe prefix."""
        ps = self.page_size
        node, path, pages = self.root, [], []
        address = node.address
        covered = 0  # tokens of SWA KV (on some tier) ending at the current depth
        best = 0
        for key in keys[:limit]:
            child = node.children.get(key) if not pages else None
            if child is not None:
                path.append(child)
                node, address = child, child.address
                held = len(child.swa) if child.swa is not None else 0
                if tiers and held < ps:
                    held = max(held, self.tiers.swa_tokens(address, tiers))  # type: ignore[union-attr]
            elif tiers:
                address = page_address(address, self.key_bytes(key))
                tier = self.tiers.full_tier(address, tiers)  # type: ignore[union-attr]
                if tier is None:
                    break
                pages.append(TierPage(key, address, self.tiers.origin(address, tier)))  # type: ignore[union-attr]
                held = self.tiers.swa_tokens(address, tiers)  # type: ignore[union-attr]
            else:
                break
            covered = held + covered if held == ps else held
            end = (len(path) + len(pages)) * ps
            if covered >= end - self.window_start(end):
                best = len(path) + len(pages)
        return path, pages, best

    def disk_keys(self, match: PrefixMatch) -> list[bytes]:
        """Tier keys of what restoring ``match`` would read from disk (entries
        no nearer tier holds): full pages past the device tree, and the
        window's SWA."""
        tiers = self.tiers
        if tiers is None:
            return []
        keys = [page.address + FULL for page in match.restore if page.address + FULL not in tiers.host]
        # Device nodes, then the pages still in a tier: both carry their address.
        for page, need in self._window_nodes([*match.nodes, *match.restore], match.length):  # type: ignore[list-item]
            swa = page.swa if isinstance(page, RadixNode) else None
            key = page.address + SWA
            if (swa is None or len(swa) < need) and tiers.host.tokens(key) < need:
                keys.append(key)
        return keys

    def _device_safe(self, nodes: Sequence[RadixNode]) -> int:
        """How many of ``nodes`` are a window-safe prefix with device SWA alone."""
        ps, covered, best = self.page_size, 0, 0
        for i, n in enumerate(nodes):
            held = len(n.swa) if n.swa is not None else 0
            covered = held + covered if held == ps else held
            end = (i + 1) * ps
            if covered >= end - self.window_start(end):
                best = i + 1
        return best

    def attach(self, view: SequenceView, match: PrefixMatch) -> CacheLock | None:
        """Point an empty view at a matched prefix (no copy) and lock it. Pages
        and windows found in the tiers are restored first; with no room for
        them on the device, the view gets the deepest window-safe point of the
        device part instead. None when a restore failed (a bad page, which is
        forgotten): match again."""
        lock = CacheLock()
        nodes = list(match.nodes)
        if not nodes and not match.restore:
            return lock
        self._lock(lock, nodes, [])
        e = match.length
        if self.tiers is not None and (match.restore or self._needs_swa(nodes, match)):
            outcome = self._restore(nodes, match, lock)
            if outcome is None:
                self.release(lock)
                return None
            if not outcome:  # no room on the device
                self._unlock_swa(lock)
                keep = self._device_safe(nodes)
                self._unlock(lock, keep)
                nodes = nodes[:keep]
                e = keep * self.page_size
                if not nodes:
                    return lock
            stamp = next(self._clock)
            for n in nodes:
                self._touch(n, stamp)
            self._touch_swa([n for n, _ in self._window_nodes(nodes, e)], stamp, priority=1)
        window = self._window_nodes(nodes, e)
        view.full_pages = [n.full_page for n in nodes]
        view.rewrote_full_pages(0)
        view.shared_full_pages = len(nodes)
        view.swa_base = self.window_start(e)
        view.swa_ring = [slot for n, need in window for slot in n.swa[len(n.swa) - need :]]  # type: ignore[index]
        view.shared_swa_end = e
        view.num_tokens = e
        self._unlock_swa(lock)
        self._lock(lock, [], [n for n, _ in window])
        lock.checkpoints.add(e)
        return lock

    def _window_needs(self, nodes: Sequence[RadixNode], match: PrefixMatch) -> list[tuple[RadixNode | None, int]]:
        """(node or None for a page still in a tier, SWA tokens needed) of the match's window."""
        return self._window_nodes([*nodes, *([None] * len(match.restore))], match.length)  # type: ignore[list-item]

    def _needs_swa(self, nodes: Sequence[RadixNode], match: PrefixMatch) -> bool:
        return any(n is None or n.swa is None or len(n.swa) < need for n, need in self._window_needs(nodes, match))

    def _restore(self, nodes: list[RadixNode], match: PrefixMatch, lock: CacheLock) -> bool | None:
        """Bring ``match.restore``'s pages and the window's SWA onto the device,
        as locked tree nodes appended to ``nodes``. False: no room (nothing
        changed but evictions); None: a load failed."""
        assert self.tiers is not None
        needs = self._window_needs(nodes, match)
        # Window pages already on the device must survive the evictions below.
        self._lock(lock, [], [n for n, need in needs if n is not None and n.swa is not None and len(n.swa) >= need])
        swa_needed = sum(need for n, need in needs if n is None or n.swa is None or len(n.swa) < need)
        full, swa = self.allocator.full, self.allocator.swa
        self.make_room(len(match.restore), swa_needed)
        if full.free_pages < len(match.restore) or swa.free_pages < swa_needed:
            return False
        parent = nodes[-1] if nodes else self.root
        slots = full.allocate(len(match.restore))
        loaded = self.tiers.load_full_run([page.address for page in match.restore], slots)
        full.release(slots[loaded:])
        for page, slot in zip(match.restore[:loaded], slots):
            child = self._new_node(page.key, parent, slot, page.address)
            self._lock(lock, [child], [])
            nodes.append(child)
            parent = child
        if loaded < len(match.restore):
            return None
        for node, need in self._window_nodes(nodes, match.length):
            held = len(node.swa) if node.swa is not None else 0
            if held >= need:
                continue
            slots = swa.allocate(need)
            if not self.tiers.load_swa(node.address, slots):
                swa.release(slots)
                return None
            if node.swa is not None:
                swa.release(node.swa)
            self._set_swa(node, slots)
        return True

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
            self._set_swa(node, list(ring))  # the request's slots become the tree's

    def _set_swa(self, node: RadixNode, slots: list[int] | None) -> None:
        """The node's SWA slots from now on (None: a tombstone); the old ones are the caller's."""
        self.swa_slots_cached += (len(slots) if slots is not None else 0) - (len(node.swa) if node.swa else 0)
        node.swa = slots
        if self.events is not None:
            self.events.record("device", node.address, SWA, len(slots) if slots is not None else 0)

    def _unlock_swa(self, lock: CacheLock) -> None:
        for n in lock.swa_nodes:
            n.swa_lock -= 1
            if n.swa_lock == 0 and n.swa is not None:
                self._push_swa(n)
        lock.swa_nodes = []

    def _unlock(self, lock: CacheLock, keep: int) -> None:
        """Unlock ``lock.nodes[keep:]`` (a path: deepest first)."""
        for n in reversed(lock.nodes[keep:]):
            n.lock -= 1
            if n.lock == 0 and n.alive and not n.children:
                if n.swa is None:
                    self._remove(n)
                else:
                    self._push_full(n)
        del lock.nodes[keep:]

    def release(self, lock: CacheLock) -> None:
        """The request is done with everything it held."""
        self._unlock_swa(lock)
        self._unlock(lock, 0)  # never leaves a tombstone leaf

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

    def make_room(self, full_pages: int, swa_slots: int) -> None:
        """Evict until ``full_pages`` pages and ``swa_slots`` slots are free (or
        nothing more can go). Pages whose demotion copy is still running come
        back first; only when evictions alone fall short does this wait for
        those copies."""
        full, swa = self.allocator.full, self.allocator.swa
        self.reclaim()
        self.evict_full(full_pages - full.free_pages)
        self.evict_swa(swa_slots - swa.free_pages)
        if full.free_pages < full_pages or swa.free_pages < swa_slots:
            self.reclaim(wait=True)

    def reclaim(self, wait: bool = False) -> None:
        """Return to the pools the pages and slots whose demotion to host
        memory has finished (``wait``: all of them, once their copies finish)."""
        if self.tiers is None:
            return
        for part, ids in self.tiers.finished_demotions(wait):
            (self.allocator.full if part == FULL else self.allocator.swa).release(ids)

    def flush(self) -> None:
        """Drop everything no running request holds."""
        while self.evict_full(1 << 62) or self.evict_swa(1 << 62):
            pass
        self.reclaim(wait=True)

    # ------------------------------------------------------------- helpers
    def _new_node(self, key: PageKey, parent: RadixNode, full_page: int, address: bytes | None = None) -> RadixNode:
        if address is None and (self.tiers is not None or self.events is not None):
            address = page_address(parent.address, self.key_bytes(key))
        node = RadixNode(key, parent, parent.depth + 1, address=address or b"", full_page=full_page)
        parent.children[key] = node
        self.num_nodes += 1
        if self.events is not None:
            self.events.record("device", node.address, FULL, 1)
        return node

    def _remove(self, node: RadixNode) -> int:
        """Evict a leaf completely; a parent left as an unlocked tombstone
        leaf goes too (never leave one), otherwise it may become evictable."""
        freed = 0
        while True:
            # A page still being copied to host memory comes back through reclaim.
            if self.tiers is None or not self.tiers.demote_full(node.address, node.full_page):
                self.allocator.full.release([node.full_page])
            self._tombstone(node)
            node.alive = False
            if self.events is not None:
                self.events.record("device", node.address, FULL, 0)
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
        if self.tiers is None or not self.tiers.demote_swa(node.address, node.swa):
            self.allocator.swa.release(node.swa)
        n = len(node.swa)
        self._set_swa(node, None)
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

    # Every touch pushes an entry and old ones are only skipped when popped, so
    # the heaps are rebuilt from their current entries once they outgrow the
    # tree: bounded memory, amortised O(1) per push.
    def _push_full(self, node: RadixNode) -> None:
        heapq.heappush(self._full_heap, (node.stamp, next(self._tie), node))
        if len(self._full_heap) > 2 * self.num_nodes + _HEAP_SLACK:
            self._full_heap = _current(self._full_heap, lambda key, n: n.alive and key == n.stamp)

    def _push_swa(self, node: RadixNode) -> None:
        heapq.heappush(self._swa_heap, ((node.swa_priority, node.swa_stamp), next(self._tie), node))
        if len(self._swa_heap) > 2 * self.num_nodes + _HEAP_SLACK:
            self._swa_heap = _current(self._swa_heap, lambda key, n: n.alive and n.swa is not None
                                      and key == (n.swa_priority, n.swa_stamp))


_HEAP_SLACK = 1024
_Entry = TypeVar("_Entry", bound=tuple)


def _current(heap: list[_Entry], valid: Callable[[object, RadixNode], bool]) -> list[_Entry]:
    """A heap of ``heap``'s entries that are still current, one per node. A
    node dropped here is pushed again whenever it becomes evictable."""
    seen: set[int] = set()
    kept = []
    for entry in sorted(heap):
        key, _, node = entry
        if id(node) not in seen and valid(key, node):
            seen.add(id(node))
            kept.append(entry)
    return kept  # sorted: already a heap
