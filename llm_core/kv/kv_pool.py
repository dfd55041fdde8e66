"""KV memory bookkeeping for hybrid SWA models, with no tensors and no model.

Two slot spaces, both paged:

* ``FullKVPool`` backs full-attention layers; a request's pages grow with its
  sequence and are kept until it ends.
* ``SWAKVPool`` backs sliding-window layers (and MTP layers); a request holds
  only the pages that still cover its live window. A page goes back to the
  pool as soon as every position on it has fallen out of the window. Its
  pages default to one token, so a request holds exactly its window plus the
  chunk in flight.

A ``SequenceView`` maps each position of one request to its full slot
(authoritative) and, for positions in the live window, to its SWA slot.
Everything here runs without torch, so capacity can be measured for models
that do not fit on this machine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

SWAMode = Literal["hybrid", "full"]


class PageAllocator:
    """A free list of fixed-size pages; slot = page * page_size + offset."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 0 or page_size < 1:
            raise ValueError(f"bad pool shape: {num_pages} pages of {page_size} slots")
        self.page_size = page_size
        self.num_pages = num_pages
        # A stack: allocation and release are slices, cheap for millions of pages.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))

    @property
    def capacity(self) -> int:
        """In slots (tokens)."""
        return self.num_pages * self.page_size

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def free_slots(self) -> int:
        return len(self._free) * self.page_size

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"asked for {n} pages, {len(self._free)} free")
        if n == 0:
            return []
        pages = self._free[-n:]
        del self._free[-n:]
        return pages

    def release(self, pages: list[int]) -> None:
        self._free.extend(pages)


class FullKVPool(PageAllocator):
    """Pages for full-attention layers."""


class SWAKVPool(PageAllocator):
    """Pages for sliding-window layers, used as a ring per request."""


@dataclass
class SequenceView:
    """Where one request's KV lives. Positions [0, num_tokens) have KV slots.

    The live SWA slots always cover one contiguous run of positions
    (``swa_base`` onward, one slot per token), so growing and releasing are
    list slices. The first ``shared_full_pages`` full pages and the SWA slots
    of positions below ``shared_swa_end`` belong to the prefix cache: the
    request reads them but never frees them.
    """

    full_page_size: int
    full_pages: list[int] = field(default_factory=list)
    swa_base: int = 0  # position of swa_ring[0]
    swa_ring: list[int] = field(default_factory=list)
    num_tokens: int = 0
    shared_full_pages: int = 0
    shared_swa_end: int = 0
    # full_pages[:full_pages_synced] are as the engine last copied them into its
    # device block table; it copies only the rest. Appending leaves it alone,
    # anything that rewrites pages lowers it (see ``rewrote_full_pages``).
    full_pages_synced: int = 0

    def rewrote_full_pages(self, first: int) -> None:
        """Pages from index ``first`` on were replaced or dropped."""
        self.full_pages_synced = min(self.full_pages_synced, first)

    def swa_slots(self, start: int, end: int) -> list[int]:
        if start < self.swa_base or end > self.swa_end_pos:
            raise KeyError(f"positions [{start}, {end}) are not all in the live SWA window")
        return self.swa_ring[start - self.swa_base : end - self.swa_base]

    @property
    def swa_end_pos(self) -> int:
        return self.swa_base + len(self.swa_ring)

    @property
    def swa_slots_held(self) -> int:
        """SWA slots this request owns (cache-owned ones are counted by the cache)."""
        return self.swa_end_pos - max(self.swa_base, self.shared_swa_end)


class KVAllocator:
    """Grows and shrinks sequence views over the two pools.

    ``window`` is the number of keys a query sees, itself included, so a
    query at position p needs KV for positions [p - window + 1, p]. SWA slots
    are kept from W tokens before the page boundary at or below p, so that a
    request ending anywhere still holds the window before its last full page
    (what a prefix-cache checkpoint needs): at most W + page - 1 slots between
    steps. In ``swa_mode="full"`` SWA layers keep the whole sequence, as
    engines without SWA support do.
    """

    def __init__(self, full: FullKVPool, swa: SWAKVPool, window: int, swa_mode: SWAMode = "hybrid") -> None:
        if swa.page_size != 1:
            raise ValueError("the SWA pool holds one token per slot")
        self.full = full
        self.swa = swa
        self.window = window
        self.swa_mode = swa_mode

    def new_view(self) -> SequenceView:
        return SequenceView(self.full.page_size)

    def first_live_pos(self, next_query_pos: int) -> int:
        """Lowest position whose SWA KV a query at ``next_query_pos`` or later may need."""
        return live_window_start(next_query_pos, self.full.page_size, self.window, self.swa_mode)

    # ------------------------------------------------------------- planning
    def pages_needed(self, view: SequenceView, new_len: int) -> tuple[int, int]:
        """(full pages, SWA slots) to allocate to grow ``view`` to ``new_len``."""
        full_needed = max(0, -(-new_len // self.full.page_size) - len(view.full_pages))
        start = max(self.first_live_pos(view.num_tokens), view.swa_end_pos if view.swa_ring else 0)
        return full_needed, max(0, new_len - start)

    def can_grow(self, view: SequenceView, new_len: int) -> bool:
        full_needed, swa_needed = self.pages_needed(view, new_len)
        releasable = self._num_releasable_owned(view, view.num_tokens)
        return full_needed <= self.full.free_pages and swa_needed <= self.swa.free_pages + releasable

    # ----------------------------------------------------------- mutations
    def grow(self, view: SequenceView, new_len: int) -> None:
        """Give positions [view.num_tokens, new_len) slots in both pools.

        SWA slots that left the window of the first new query are released
        first, so a chunk holds at most window + chunk + page SWA slots.
        """
        if not self.can_grow(view, new_len):
            raise MemoryError(f"cannot grow sequence to {new_len} tokens")
        self.release_out_of_window(view, view.num_tokens)
        full_needed, swa_needed = self.pages_needed(view, new_len)
        view.full_pages.extend(self.full.allocate(full_needed))
        if not view.swa_ring:
            view.swa_base = new_len - swa_needed
        view.swa_ring.extend(self.swa.allocate(swa_needed))
        view.num_tokens = new_len

    def release_out_of_window(self, view: SequenceView, next_query_pos: int) -> int:
        """Drop SWA slots no query at ``next_query_pos`` or later can see; the
        request's own go back to the pool. Returns how many were dropped."""
        n = min(len(view.swa_ring), max(0, self.first_live_pos(next_query_pos) - view.swa_base))
        if n:
            owned_from = max(0, view.shared_swa_end - view.swa_base)
            self.swa.release(view.swa_ring[owned_from:n])
            del view.swa_ring[:n]
            view.swa_base += n
        return n

    def reserve_needs(self, num_tokens: int) -> tuple[int, int]:
        """(full pages, SWA slots) a request arriving with ``num_tokens`` computed
        tokens holds: every full page, and the live window only."""
        return -(-num_tokens // self.full.page_size), num_tokens - self.first_live_pos(num_tokens)

    def can_reserve(self, num_tokens: int) -> bool:
        full_needed, swa_needed = self.reserve_needs(num_tokens)
        return full_needed <= self.full.free_pages and swa_needed <= self.swa.free_pages

    def reserve(self, view: SequenceView, num_tokens: int) -> None:
        """Give an empty view the slots of ``num_tokens`` tokens computed
        elsewhere (a prefill worker's): full pages for all of them, SWA slots
        for the live window before the next query only -- never the whole
        prompt's, as ``grow`` would for tokens about to be computed here."""
        if view.num_tokens or view.full_pages or view.swa_ring:
            raise ValueError("only an empty view can be reserved")
        if not self.can_reserve(num_tokens):
            raise MemoryError(f"cannot reserve {num_tokens} tokens")
        full_needed, swa_needed = self.reserve_needs(num_tokens)
        view.full_pages = self.full.allocate(full_needed)
        view.swa_base = num_tokens - swa_needed
        view.swa_ring = self.swa.allocate(swa_needed)
        view.num_tokens = num_tokens

    def free(self, view: SequenceView) -> None:
        """Return everything the request owns."""
        self.full.release(view.full_pages[view.shared_full_pages :])
        self.swa.release(view.swa_ring[max(0, view.shared_swa_end - view.swa_base) :])
        view.full_pages = []
        view.rewrote_full_pages(0)
        view.swa_ring = []
        view.swa_base = view.num_tokens = view.shared_full_pages = view.shared_swa_end = 0

    def truncate(self, view: SequenceView, new_len: int) -> None:
        """Forget positions >= new_len (rejected speculative tokens). What the
        prefix cache owns (full pages and SWA slots alike) stays with the view:
        only the cache may return it to the pools."""
        keep_full = max(-(-new_len // self.full.page_size), view.shared_full_pages)
        self.full.release(view.full_pages[keep_full:])
        del view.full_pages[keep_full:]
        view.rewrote_full_pages(keep_full)
        keep_swa = max(0, new_len - view.swa_base, view.shared_swa_end - view.swa_base)
        self.swa.release(view.swa_ring[keep_swa:])
        del view.swa_ring[keep_swa:]
        view.num_tokens = min(view.num_tokens, new_len)

    def _num_releasable_owned(self, view: SequenceView, next_query_pos: int) -> int:
        end = min(view.swa_end_pos, self.first_live_pos(next_query_pos))
        return max(0, end - max(view.swa_base, view.shared_swa_end))


def live_window_start(next_query_pos: int, page_size: int, window: int, swa_mode: SWAMode = "hybrid") -> int:
    """Lowest position whose SWA KV a query at ``next_query_pos`` or later may
    need: the window before the page boundary at or below it (so a
    checkpoint there stays possible); 0 in ``swa_mode="full"``."""
    if swa_mode == "full":
        return 0
    return max(0, next_query_pos // page_size * page_size - (window - 1))


@dataclass(frozen=True)
class PoolSizing:
    """How many tokens (slots) each pool gets from a KV memory budget."""

    full_tokens: int
    swa_tokens: int

    @staticmethod
    def from_budget(
        budget_bytes: int,
        full_bytes_per_token: int,
        swa_bytes_per_token: int,
        window: int,
        full_page_size: int,
        max_running_requests: int,
        max_num_batched_tokens: int,
        swa_mode: SWAMode = "hybrid",
    ) -> PoolSizing:
        """Hybrid: the SWA pool holds every running request's window and one
        step's worth of prefill tokens; the full pool gets the rest. Full
        mode: SWA layers keep every token, so both pools hold the same count."""
        if swa_mode == "full":
            tokens = budget_bytes // max(full_bytes_per_token + swa_bytes_per_token, 1)
            tokens -= tokens % full_page_size
            return PoolSizing(tokens, tokens)
        swa_tokens = max_running_requests * window + max_num_batched_tokens
        # A budget too small for every window still leaves the full pool a tenth.
        swa_tokens = min(swa_tokens, budget_bytes * 9 // 10 // max(swa_bytes_per_token, 1))
        full_tokens = (budget_bytes - swa_tokens * swa_bytes_per_token) // max(full_bytes_per_token, 1)
        full_tokens -= full_tokens % full_page_size
        return PoolSizing(int(full_tokens), int(swa_tokens))
