"""Disaggregation on one engine, both ends: on a prefill worker, a request's
KV packed after its first token for the decode worker to take; on a decode
worker, slots held for KV on its way, filled when it arrives, and given to
the request that goes on from its first token."""

from __future__ import annotations

from collections.abc import Callable

import torch

from llm_core.cluster.disagg import KVReservation, PrefilledKV, SequenceKVPacker
from llm_core.kv.kv_pool import KVAllocator
from llm_core.kv.prefix_cache import RadixCache
from llm_core.request import Request

__all__ = ["KVHandoff"]


class KVHandoff:
    def __init__(self, allocator: KVAllocator, cache: RadixCache | None, packer: SequenceKVPacker,
                 max_running_requests: int, running: Callable[[], int]) -> None:
        """``running``: how many requests the engine runs now (reservations count against the same limit)."""
        self.allocator = allocator
        self.cache = cache
        self.packer = packer
        self.max_running_requests = max_running_requests
        self.running = running
        self._exports: dict[int, PrefilledKV] = {}
        self._reservations: dict[int, KVReservation] = {}
        self._next_reservation = 0

    # ------------------------------------------------------------ prefill side
    def export(self, request: Request, reason: str) -> None:
        """Pack a prefilled request's KV, before its end hands it to the cache."""
        seq, first = request.seq, request.first_event
        assert first is not None, "an exported request without its first token"
        blob, plan = self.packer.pack(seq.view, len(seq.prompt))
        self._exports[request.id] = PrefilledKV(
            len(seq.prompt), first.token, request.seed, seq.cached_tokens or 0,
            None if reason == "prefilled" else reason, blob, plan, first.logprob, first.top_logprobs)

    def take_export(self, request_id: int) -> PrefilledKV | None:
        """The packed KV of a prefilled ``export_kv`` request (once)."""
        return self._exports.pop(request_id, None)

    # ------------------------------------------------------------- decode side
    def reserve(self, num_prompt_tokens: int, max_tokens: int) -> KVReservation | None:
        """Hold the slots of a request prefilled elsewhere before its KV is
        sent: full pages for the prompt, SWA slots for its live window (cached
        prefixes are evicted to make room). None when the pools or the running
        limit have no room now."""
        if self.running() + len(self._reservations) >= self.max_running_requests:
            return None
        if not self.allocator.can_reserve(num_prompt_tokens) and self.cache is not None:
            self.cache.make_room(*self.allocator.reserve_needs(num_prompt_tokens))
        if not self.allocator.can_reserve(num_prompt_tokens):
            return None
        view = self.allocator.new_view()
        self.allocator.reserve(view, num_prompt_tokens)
        reservation = KVReservation(self._next_reservation, view, num_prompt_tokens, max_tokens,
                                    self.packer.plan(num_prompt_tokens))
        self._next_reservation += 1
        self._reservations[reservation.reservation_id] = reservation
        return reservation

    def fill(self, reservation: KVReservation, blob: torch.Tensor) -> None:
        """Write a received transfer into the reserved slots (ValueError if it does not fit them)."""
        if self._reservations.get(reservation.reservation_id) is not reservation:
            raise ValueError("that reservation was cancelled or used")
        self.packer.unpack(blob, reservation.view, reservation.num_tokens)
        reservation.filled = True

    def cancel(self, reservation: KVReservation) -> bool:
        """Give the reserved slots back (a transfer failed, or its request was aborted)."""
        if self._reservations.pop(reservation.reservation_id, None) is None:
            return False
        self.allocator.free(reservation.view)
        return True

    def check_filled(self, reservation: KVReservation, num_prompt_tokens: int, prefilled: PrefilledKV) -> None:
        """ValueError unless the reservation holds this prompt's received KV."""
        if self._reservations.get(reservation.reservation_id) is not reservation or not reservation.filled:
            raise ValueError("the reservation holds no received KV")
        if num_prompt_tokens != reservation.num_tokens or prefilled.num_tokens != reservation.num_tokens:
            raise ValueError(f"the reservation holds {reservation.num_tokens} tokens, "
                             f"the prompt has {num_prompt_tokens}")

    def spend(self, reservation: KVReservation) -> None:
        """The reservation's slots now belong to its request."""
        del self._reservations[reservation.reservation_id]
