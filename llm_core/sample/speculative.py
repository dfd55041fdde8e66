"""MTP speculative decoding: the draft pass over the MTP layers.

MTP layer j (its "depth") is trained to predict token t+j+2 from token t+j+1
and depth j-1's hidden state at t (depth -1: the target's final hidden state).
Here its rows are keyed by the token they read: depth j's row u reads token
u and depth j-1's state at row u-1, writes its K/V at u's SWA slot, and its
output predicts token u+1 (the rotary position is still t = u - j - 1). A
slot's MTP K/V and hidden states then depend on tokens up to its own
position only, the same as the target's K/V there: they are final as soon as
the slot's token is known, and a prefix-cache checkpoint (or a tier) holds
them with the prefix, never a false hit.

Each step, after the target forward and the commit, one pass per depth
brings every request's MTP rows up to its computed tokens (rows from
``Sequence.mtp_done``, also over prefill chunks) and, for requests about to
decode, goes on past them on draft tokens: depth j adds rows up to
``last + j`` and its output at that row is draft j+1. Rows past the computed
tokens write to the request's draft slots (past the allocator's SWA slots),
never to a slot of the pools, and are recomputed once their tokens are known.
With more drafts than MTP layers the last layer goes on alone, one row per
draft, on its own output.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from llm_core.model.attention import AttentionBackend
from llm_core.device import column, to_device
from llm_core.model.model import MiMoV2ForCausalLM
from llm_core.model.multimodal import MultimodalSpan
from llm_core.kv.attention_backends import DecodeAttentionBackend, PagedAttentionBackend
from llm_core.kv.paged_attention import (
    AttentionFn,
    DecodeAttentionFn,
    DecodeBatch,
    KVCacheTensors,
    PagedBatch,
)
from llm_core.sample.sampling import SamplingPlan, SamplingRow, draw_drafts
from llm_core.sched.scheduler import Sequence

__all__ = ["DraftTarget", "Drafts", "MTPDrafter", "SpeculativeStats"]


@dataclass(frozen=True)
class DraftTarget:
    """One request of a draft pass: its MTP rows are brought up to its computed
    tokens, and if ``sampling`` is set it also gets drafts for its next tokens."""

    seq: Sequence
    sampling: SamplingRow | None
    spans: tuple[MultimodalSpan, ...] = ()


@dataclass(frozen=True)
class Drafts:
    """The drafts of a pass's drafting requests, in their order."""

    tokens: torch.Tensor  # [B, k] int64
    probs: torch.Tensor | None  # [S, k, vocab]: q of the rows that sample (plan.sampled_rows)
    plan: SamplingPlan


@dataclass(frozen=True)
class _Rows:
    """One request's rows at one depth: positions [first, end]."""

    target: int  # index in the pass
    first: int
    end: int


# Rows per request up to which a depth runs as one-query rows through the
# decode kernels (drafting steps); longer runs (prefill chunks) go through the
# mixed-batch attention, whose metadata is O(rows), not O(rows x W).
SHORT_ROWS = 16

MTPForward = Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor, AttentionBackend], torch.Tensor]


def mtp_layer_forward(layer: nn.Module, embeds: torch.Tensor, prev_hidden: torch.Tensor, positions: torch.Tensor,
                      backend: AttentionBackend) -> torch.Tensor:
    """One MTP depth over its rows (what is compiled with ``compile``)."""
    return layer(embeds, prev_hidden, positions, backend)


class MTPDrafter:
    def __init__(self, model: MiMoV2ForCausalLM, kv: KVCacheTensors, window: int, num_drafts: int,
                 attention_fn: AttentionFn, decode_attention_fn: DecodeAttentionFn, device: torch.device,
                 forward: MTPForward = mtp_layer_forward) -> None:
        self.model = model
        self.kv = kv
        self.window = window
        self.num_drafts = num_drafts
        self.num_layers = model.config.num_mtp_layers
        self.attention_fn = attention_fn
        self.decode_attention_fn = decode_attention_fn
        self.device = device
        self.forward = forward

    def run(self, targets: list[DraftTarget], constrain: DraftConstraint | None = None) -> Drafts | None:
        """Run the pass; the drafts of the targets that sample, or None if none does.
        ``constrain(depth, logits, drafts so far)`` may mask each depth's logits
        (rows: the targets that sample, in order) before its drafts are drawn."""
        drafting = [i for i, t in enumerate(targets) if t.sampling is not None]
        plan = SamplingPlan.build([targets[i].sampling for i in drafting],  # type: ignore[misc]
                                  self.model.config.vocab_size, self.device) if drafting else None
        tokens: list[torch.Tensor] = []  # per depth: [len(drafting)] drafts
        probs: list[torch.Tensor] = []
        previous: tuple[torch.Tensor, dict[int, int]] | None = None  # last depth's outputs, row of each drafter
        for depth in range(self.num_drafts):
            rows = [r for i, t in enumerate(targets) if (r := self._rows(i, t, depth)) is not None]
            if not rows:
                break
            hidden, draft_row = self._depth(targets, rows, depth, tokens, drafting, previous)
            previous = (hidden, draft_row)
            if plan is not None:
                logits = self.model.compute_logits(hidden[[draft_row[i] for i in drafting]])
                if constrain is not None:
                    logits = constrain(depth, logits, tokens)
                drawn, q = draw_drafts(logits, plan, depth)
                tokens.append(drawn)
                if q is not None:
                    probs.append(q)
        for target in targets:
            target.seq.mtp_done = target.seq.num_computed
        if plan is None:
            return None
        return Drafts(torch.stack(tokens, dim=1), torch.stack(probs, dim=1) if probs else None, plan)

    # ----------------------------------------------------------------- rows
    def _layer(self, depth: int) -> int:
        return min(depth, self.num_layers - 1)

    def _rows(self, index: int, target: DraftTarget, depth: int) -> _Rows | None:
        seq = target.seq
        last = seq.num_tokens - 1  # the newest token (a drafting request has not computed it yet)
        if depth >= self.num_layers:  # the last layer, on alone: one row per draft
            return _Rows(index, last + depth, last + depth) if target.sampling is not None else None
        first = max(seq.mtp_done, depth + 1)  # depth j's first row reads token j+1 (position t = 0)
        end = last + depth if target.sampling is not None else seq.num_computed - 1
        return _Rows(index, first, end) if first <= end else None

    def _slots(self, index: int, seq: Sequence, start: int, end: int) -> list[int]:
        """SWA slots of positions [start, end]: the view's for computed tokens,
        the request's draft slots past them."""
        n = seq.num_computed
        real = seq.view.swa_slots(start, min(end + 1, n)) if start < n else []
        base = self.kv.draft_slot_base + index * self.num_drafts - n
        return real + [base + u for u in range(max(start, n), end + 1)]

    # ---------------------------------------------------------------- depth
    def _depth(
        self,
        targets: list[DraftTarget],
        rows: list[_Rows],
        depth: int,
        drafts: list[torch.Tensor],
        drafting: list[int],
        previous: tuple[torch.Tensor, dict[int, int]] | None,
    ) -> tuple[torch.Tensor, dict[int, int]]:
        """One depth's forward over its rows; its outputs and, per drafting
        target, the output row that predicts its next draft."""
        layer = self._layer(depth)
        draft_index = {t: j for j, t in enumerate(drafting)}
        short = all(r.end - r.first < SHORT_ROWS for r in rows)
        q_ranges, kv_slots, kv_first, writes = [], [], [], []
        row_keys: list[list[int]] = []  # short rows: [u, write slot, key count, key slots...]
        token_ids: list[int] = []
        from_draft: list[tuple[int, int]] = []  # (flat row, index into the stacked drafts)
        prev_slots: list[int] = []
        draft_row: dict[int, int] = {}
        offset = 0
        for r in rows:
            seq = targets[r.target].seq
            n = r.end - r.first + 1
            last = seq.num_tokens - 1
            key_lo = max(layer + 1, r.first - self.window + 1)
            slots = self._slots(r.target, seq, key_lo, r.end)
            if short:
                for u in range(r.first, r.end + 1):
                    lo = max(layer + 1, u - self.window + 1)
                    keys = slots[lo - key_lo : u - key_lo + 1]
                    row_keys.append([u, keys[-1], len(keys), *keys, *([0] * (self.window - len(keys)))])
            else:
                q_ranges.append((r.first, n))
                kv_slots.append(slots)
                kv_first.append(key_lo)
                writes.append(slots[r.first - key_lo :])
            known_end = min(r.end, last)
            token_ids += seq.token_slice(r.first, known_end + 1) if r.first <= known_end else []
            for u in range(max(r.first, last + 1), r.end + 1):
                # Token u is draft u - last (drawn by depth u - last - 1).
                token_ids.append(0)
                from_draft.append((offset + u - r.first, (u - last - 1) * len(drafting) + draft_index[r.target]))
            if depth < self.num_layers:
                prev_slots += self._slots(r.target, seq, r.first - 1, r.end - 1)
            if targets[r.target].sampling is not None:
                draft_row[r.target] = offset + n - 1
            offset += n
        ids = to_device(torch.tensor(token_ids, dtype=torch.long), self.device)
        if from_draft:
            at = torch.tensor([row for row, _ in from_draft], device=self.device)
            which = torch.tensor([d for _, d in from_draft], device=self.device)
            ids[at] = torch.cat(drafts)[which]
        if short:
            backend, positions, write_slots = self._decode_backend(row_keys)
        else:
            batch = PagedBatch.build(q_ranges, kv_slots, kv_first, writes, self.device)
            backend, positions, write_slots = PagedAttentionBackend(self.kv, batch, batch, self.attention_fn), \
                batch.q_pos, batch.write_slots
        embeds = self._embeds(targets, rows, ids)
        if depth < self.num_layers:
            prev_hidden = self.kv.hidden(depth)[to_device(torch.tensor(prev_slots, dtype=torch.long), self.device)]
        else:  # the last layer's own output at the row before
            assert previous is not None
            hidden, rows_of = previous
            prev_hidden = hidden[[rows_of[r.target] for r in rows]]
        out = self.forward(self.model.model.mtp.layers[layer], embeds, prev_hidden, positions - (layer + 1), backend)
        if depth + 1 < self.kv.draft_depths:
            self.kv.hidden(depth + 1).index_put_((write_slots,), out.to(self.kv.hidden(depth + 1).dtype))
        return out, draft_row

    def _decode_backend(self, row_keys: list[list[int]]) -> tuple[DecodeAttentionBackend, torch.Tensor, torch.Tensor]:
        """Rows of a few tokens each as one-query rows of a ``DecodeBatch`` (the
        decode kernels), from [position, write slot, key count, key slots...]."""
        meta = to_device(torch.tensor(row_keys, dtype=torch.int64), self.device)
        positions, write_slots, key_count = (column(meta, i) for i in range(3))
        batch = DecodeBatch(
            positions=positions,
            full_pages=meta.new_zeros(meta.shape[0], 1, dtype=torch.int32),  # MTP layers read the SWA pool only
            full_write=write_slots,
            swa_slots=meta[:, 3:].clone(memory_format=torch.contiguous_format),
            swa_len=key_count,
            swa_write=write_slots,
            page_size=self.kv.page_size,
        )
        return DecodeAttentionBackend(self.kv, batch, self.decode_attention_fn), positions, write_slots

    def _embeds(self, targets: list[DraftTarget], rows: list[_Rows], ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings of the rows, media rows taken from their spans (as the
        target reads them)."""
        embeds = self.model.model.embed_tokens(ids.clamp(min=0))
        offset = 0
        for r in rows:
            for span in targets[r.target].spans:
                lo, hi = max(r.first, span.offset), min(r.end + 1, span.end)
                if lo < hi:
                    embeds[offset + lo - r.first : offset + hi - r.first] = span.embeddings[lo - span.offset :
                                                                                           hi - span.offset]
            offset += r.end - r.first + 1
        return embeds


# (depth, that depth's logits [drafting rows, vocab], the drafts of earlier depths) -> logits to draw from
DraftConstraint = Callable[[int, torch.Tensor, list[torch.Tensor]], torch.Tensor]


class SpeculativeStats:
    """Drafts proposed and accepted per draft position, over verify steps."""

    def __init__(self, num_drafts: int) -> None:
        self.proposed = [0] * num_drafts
        self.accepted = [0] * num_drafts
        self.verify_steps = 0
        self.tokens = 0  # tokens the verify steps produced (accepted drafts + the target's own)

    def record(self, num_drafts: int, accepted: int) -> None:
        for i in range(num_drafts):
            self.proposed[i] += 1
            self.accepted[i] += i < accepted
        self.verify_steps += 1
        self.tokens += accepted + 1

    def as_dict(self) -> dict[str, object]:
        return {
            "num_speculative_tokens": len(self.proposed),
            "verify_steps": self.verify_steps,
            "drafts_proposed": list(self.proposed),
            "drafts_accepted": list(self.accepted),
            "acceptance_rate_per_position": [round(a / p, 4) if p else None
                                             for a, p in zip(self.accepted, self.proposed)],
            # Tokens per verify step, out of num_speculative_tokens + 1.
            "mean_acceptance_length": round(self.tokens / self.verify_steps, 4) if self.verify_steps else None,
        }
