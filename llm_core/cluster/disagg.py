"""Prefill/decode disaggregation: what a prefilled request's KV transfer
carries, and its packing out of one engine's pools into another's.

A decode worker continues a request prefilled elsewhere from the first
sampled token, at position n = the prompt's length. Its next query reads:

* the full-attention layers' KV of every position [0, n);
* the SWA and MTP layers' KV of the live window only, [s, n) with
  s = ``live_window_start(n)``: the W - 1 tokens before the page boundary at
  or below n, then the partial page (at most W + page - 2 tokens, so the
  receiver can still checkpoint its prefix cache at that boundary), with the
  hidden states the MTP layers chain on over the same positions.

Nothing else: the SWA KV of the rest of the prompt never leaves the prefill
worker, which is where a hybrid model's transfer shrinks to ~1/7 of a
full-attention model's for long prompts. ``plan_transfer`` counts it without
tensors, so the same planning prices the transfer of a model too large for
this machine (``plan_for_config``).

A transfer is one contiguous byte blob: for each full-slot tensor (in
``KVCacheTensors.pool_tensors`` order) the rows of positions [0, n), then for
each SWA-slot tensor the rows of positions [s, n).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llm_core.model.config import ModelConfig
from llm_core.kv.kv_pool import SequenceView, SWAMode, live_window_start
from llm_core.kv.paged_attention import KVCacheTensors

__all__ = ["KVReservation", "PrefilledKV", "SequenceKVPacker", "TransferPlan", "plan_for_config", "plan_transfer"]


@dataclass(frozen=True)
class TransferPlan:
    num_tokens: int  # prompt positions whose KV the decode side receives
    swa_start: int  # first position of the SWA window sent
    full_bytes: int  # full-attention layers, every position
    swa_bytes: int  # SWA and MTP layers (and MTP hidden states), the window only
    # What a transfer unaware of SWA sends for the same prompt: every layer, every position.
    full_attention_bytes: int

    @property
    def bytes(self) -> int:
        return self.full_bytes + self.swa_bytes

    @property
    def swa_tokens(self) -> int:
        return self.num_tokens - self.swa_start

    @property
    def ratio(self) -> float:
        """Bytes sent against a full-attention-style transfer of the same prompt."""
        return self.bytes / self.full_attention_bytes if self.full_attention_bytes else 1.0


def plan_transfer(num_tokens: int, page_size: int, window: int, full_bytes_per_token: int,
                  swa_bytes_per_token: int, swa_mode: SWAMode = "hybrid") -> TransferPlan:
    """The bytes of one prefilled request's transfer (``swa_mode="full"``: an
    engine that keeps SWA layers like full attention, and sends them whole)."""
    if num_tokens < 1:
        raise ValueError("a transfer carries at least one token")
    start = live_window_start(num_tokens, page_size, window, swa_mode)
    return TransferPlan(num_tokens, start, num_tokens * full_bytes_per_token,
                        (num_tokens - start) * swa_bytes_per_token,
                        num_tokens * (full_bytes_per_token + swa_bytes_per_token))


def plan_for_config(config: ModelConfig, num_tokens: int, *, page_size: int = 64, dtype: torch.dtype = torch.bfloat16,
                    mtp_layers: int | None = None, swa_mode: SWAMode = "hybrid") -> TransferPlan:
    """``plan_transfer`` for a model shape, its bytes per token counted from a
    KV layout on the meta device (no memory): ``mtp_layers`` with
    speculative decoding on (default: all the checkpoint has), 0 without."""
    layers = config.num_mtp_layers if mtp_layers is None else mtp_layers
    probe = KVCacheTensors(config, 0, 0, dtype, "meta", mtp_layers=layers, draft_depths=layers)
    window = config.sliding_attention.sliding_window or 1
    return plan_transfer(num_tokens, page_size, window, probe.full_bytes_per_token, probe.swa_bytes_per_token,
                         swa_mode)


@dataclass(frozen=True)
class PrefilledKV:
    """What a prefill worker hands over for one request: its KV (``blob``), the
    first token, and what the decode side needs to go on sampling exactly as
    one engine would (the seed: sampling is keyed by seed and position)."""

    num_tokens: int
    first_token: int
    seed: int
    cached_tokens: int  # prompt tokens the prefill side's prefix cache served
    finish_reason: str | None  # set when the first token already ends the request
    blob: torch.Tensor  # uint8, on the host
    plan: TransferPlan
    logprob: float | None = None  # the first token's, when the request asked for logprobs
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass
class KVReservation:
    """Slots a decode engine holds for a request whose KV is on its way."""

    reservation_id: int
    view: SequenceView
    num_tokens: int
    max_tokens: int
    plan: TransferPlan
    filled: bool = False


class SequenceKVPacker:
    """Packs one request's transfer out of a ``KVCacheTensors`` and unpacks it
    into another one's slots (the same model, dtype and page size)."""

    def __init__(self, kv: KVCacheTensors, window: int, swa_mode: SWAMode = "hybrid") -> None:
        self.kv = kv
        self.window = window
        self.swa_mode = swa_mode
        self.full_tensors, self.swa_tensors = kv.pool_tensors()
        self._full_row = [t[0].numel() * t.element_size() for t in self.full_tensors]
        self._swa_row = [t[0].numel() * t.element_size() for t in self.swa_tensors]

    def plan(self, num_tokens: int) -> TransferPlan:
        return plan_transfer(num_tokens, self.kv.page_size, self.window, sum(self._full_row), sum(self._swa_row),
                             self.swa_mode)

    def _indices(self, view: SequenceView, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, TransferPlan]:
        plan = self.plan(num_tokens)
        ps = self.kv.page_size
        pages = torch.tensor(view.full_pages[: -(-num_tokens // ps)], dtype=torch.long)
        full_rows = (pages[:, None] * ps + torch.arange(ps)).reshape(-1)[:num_tokens]
        swa_slots = torch.tensor(view.swa_slots(plan.swa_start, num_tokens), dtype=torch.long)
        return full_rows.to(self.kv.device), swa_slots.to(self.kv.device), plan

    def pack(self, view: SequenceView, num_tokens: int) -> tuple[torch.Tensor, TransferPlan]:
        """The blob of the view's first ``num_tokens`` positions, on the host."""
        full_rows, swa_slots, plan = self._indices(view, num_tokens)
        parts = [t.index_select(0, full_rows).reshape(-1).view(torch.uint8) for t in self.full_tensors]
        parts += [t.index_select(0, swa_slots).reshape(-1).view(torch.uint8) for t in self.swa_tensors]
        blob = torch.cat(parts).cpu() if parts else torch.empty(0, dtype=torch.uint8)
        assert blob.numel() == plan.bytes
        return blob, plan

    def unpack(self, blob: torch.Tensor, view: SequenceView, num_tokens: int) -> None:
        """Write a blob into the slots ``view`` holds for its first ``num_tokens`` positions."""
        full_rows, swa_slots, plan = self._indices(view, num_tokens)
        if blob.dtype != torch.uint8 or blob.numel() != plan.bytes:
            raise ValueError(f"a transfer of {num_tokens} tokens is {plan.bytes} bytes, got {blob.numel()}")
        blob = blob.to(self.kv.device)
        offset = 0
        for tensors, index, rows in ((self.full_tensors, full_rows, self._full_row),
                                     (self.swa_tensors, swa_slots, self._swa_row)):
            n = index.numel()
            for t, row in zip(tensors, rows):
                part = blob[offset : offset + n * row].view(t.dtype).view(n, *t.shape[1:])
                t.index_copy_(0, index, part)
                offset += n * row
