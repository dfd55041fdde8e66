"""A step's sampling: every sampling chunk's next token (and the verification
of its drafts) drawn in one batch, with penalties, grammar masks and
log-probabilities applied to the rows that ask for them, and one
device-to-host copy. A row that cannot be sampled fails alone."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from llm_core.device import to_device
from llm_core.sample.grammar import GrammarCompiler, GrammarMatcher
from llm_core.request import Request
from llm_core.sample.sampling import (
    SamplingPlan,
    TokenCounts,
    apply_penalties,
    apply_token_mask,
    sample_tokens,
    token_logprobs,
    verify_drafts,
)
from llm_core.sched.scheduler import ScheduledChunk

__all__ = ["DraftMasker", "Drawn", "NOTHING", "StepSampler"]


@dataclass(frozen=True)
class Drawn:
    """A request's tokens from one step, with their log-probabilities when it asked."""

    tokens: list[int]
    logprobs: list[float] | None = None
    top: list[tuple[tuple[int, float], ...]] | None = None


NOTHING = Drawn([])


@dataclass(frozen=True)
class _GrammarMasks:
    bits: np.ndarray  # [requests * width, words] int32
    drafts: list[int]  # each request's drafts its grammar takes


class DraftMasker:
    """Grammar masks for the MTP pass, depth by depth: each constrained row's
    grammar takes the row's earlier drafts (tentatively: ``rollback`` undoes
    them), and the next depth's logits are masked to what it allows then. A
    row whose draft ends the output, or that the grammar leaves, drafts freely
    from there (verification refuses those drafts anyway)."""

    def __init__(self, rows: list[tuple[int, GrammarMatcher]], words: int, ends: frozenset[int]) -> None:
        self.rows = rows  # (index among the drafting rows, its grammar)
        self.ends = ends
        self.bits = np.full((len(rows), words), -1, dtype=np.int32)
        self.taken = [0] * len(rows)
        self.alive = [True] * len(rows)
        self._index = torch.tensor([k for k, _ in rows])

    def __call__(self, depth: int, logits: torch.Tensor, drafts: list[torch.Tensor]) -> torch.Tensor:
        previous = drafts[-1][self._index.to(drafts[-1].device)].tolist() if depth else None
        for r, (_, matcher) in enumerate(self.rows):
            row = self.bits[r]
            if previous is not None and self.alive[r]:
                _, taken = matcher.take_draft(row, previous[r], self.ends)
                self.taken[r] += taken
                self.alive[r] = taken and not matcher.stopped
            if self.alive[r]:
                matcher.fill_mask(row)
                if not row.any():
                    self.alive[r] = False
            if not self.alive[r]:
                row.fill(-1)
        return apply_token_mask(logits, self._index.to(logits.device), self.bits)

    def rollback(self) -> None:
        for (_, matcher), taken in zip(self.rows, self.taken):
            matcher.rollback(taken)
        self.taken = [0] * len(self.rows)


class StepSampler:
    def __init__(self, requests: Mapping[int, Request], counts: TokenCounts, grammars: GrammarCompiler | None,
                 vocab_size: int, device: torch.device) -> None:
        """``requests``: the engine's live requests; ``counts``: the token
        counts of those with penalties."""
        self.requests = requests
        self.counts = counts
        self.grammars = grammars
        self.vocab_size = vocab_size
        self.device = device

    def _drafts_of(self, chunk: ScheduledChunk) -> tuple[torch.Tensor, torch.Tensor | None]:
        pending = self.requests[chunk.seq.request_id].drafts
        assert pending is not None, "a verify chunk without drafts"
        return pending

    def draw(self, chunks: list[ScheduledChunk], logits: torch.Tensor) -> dict[int, Drawn | Exception]:
        """Every sampling chunk's new tokens, in one batched draw and one
        device-to-host copy; if that fails, chunk by chunk, so only the chunks
        that fail end (e.g. NaN logits)."""
        try:
            return self._draw_batch(chunks, logits)
        except Exception as exc:  # noqa: BLE001 - narrowed to the failing chunks below
            if len(chunks) == 1:
                return {chunks[0].seq.request_id: exc}
            out: dict[int, Drawn | Exception] = {}
            offset = 0
            for chunk in chunks:
                n = chunk.drafts + 1
                out.update(self.draw([chunk], logits[offset : offset + n]))
                offset += n
            return out

    def _draw_batch(self, chunks: list[ScheduledChunk], logits: torch.Tensor) -> dict[int, Drawn | Exception]:
        rows = [self.requests[chunk.seq.request_id].sampling_row() for chunk in chunks]
        plan = SamplingPlan.build(rows, logits.shape[-1], logits.device)
        most = max(chunk.drafts for chunk in chunks)
        width = most + 1
        if most == 0:
            raw = logits
            adjusted, _ = self._adjust(chunks, logits, 1, None)
            tokens = sample_tokens(adjusted, plan).view(-1, 1)
            accepted: torch.Tensor | None = None  # no drafts: each chunk keeps its one token
        else:
            # Each chunk's rows (its next position, then its drafts) padded to most + 1.
            index, offset = [], 0
            for chunk in chunks:
                index.append([offset + min(i, chunk.drafts) for i in range(width)])
                offset += chunk.drafts + 1
            rows_logits = logits[to_device(torch.tensor(index), logits.device)]
            drafts, probs = self._pending_drafts(chunks, most, plan)
            raw = rows_logits.view(-1, rows_logits.shape[-1])
            adjusted, num = self._adjust(chunks, raw, width, drafts)
            num_drafts = to_device(torch.tensor(num), logits.device)
            tokens, accepted = verify_drafts(adjusted.view_as(rows_logits), drafts, num_drafts, probs, plan)
        logprobs = self._logprobs(chunks, raw, tokens)
        # One copy: the tokens, and the count of accepted drafts where there are drafts.
        host = (tokens if accepted is None else torch.cat((tokens, accepted[:, None]), dim=1)).tolist()
        out: dict[int, Drawn | Exception] = {}
        for i, (chunk, row) in enumerate(zip(chunks, host)):
            n = 0 if accepted is None else row[-1]
            chosen, top = logprobs.get(i, (None, None))
            out[chunk.seq.request_id] = Drawn(row[: n + 1], chosen[: n + 1] if chosen is not None else None,
                                               top[: n + 1] if top is not None else None)
        return out

    def _adjust(self, chunks: list[ScheduledChunk], logits: torch.Tensor, width: int,
                drafts: torch.Tensor | None) -> tuple[torch.Tensor, list[int]]:
        """``logits`` [B * width, vocab] (chunk i's rows from i * width: its
        next position, then one per draft) with the penalties and grammar masks
        of the chunks that have them, and each chunk's drafts, fewer where a
        draft breaks the request's grammar (the rows after it cannot be kept)."""
        num = [chunk.drafts for chunk in chunks]
        penalised = [i for i, chunk in enumerate(chunks) if chunk.seq.request_id in self.counts]
        constrained = [i for i, chunk in enumerate(chunks) if self.requests[chunk.seq.request_id].matcher is not None]
        if not penalised and not constrained:
            return logits, num
        draft_ids = drafts.tolist() if drafts is not None else [[] for _ in chunks]
        if penalised:
            ids = [chunks[i].seq.request_id for i in penalised]
            penalties = self.counts.penalties(
                [i * width + j for i in penalised for j in range(width)],
                [rid for rid in ids for _ in range(width)],
                [self.requests[rid].params for rid in ids for _ in range(width)],
                [draft_ids[i][:j] for i in penalised for j in range(width)],
            )
            logits = apply_penalties(logits, penalties)
        if constrained:
            masks = self._grammar_masks([chunks[i].seq.request_id for i in constrained],
                                        [draft_ids[i] for i in constrained], [num[i] for i in constrained], width)
            for k, i in enumerate(constrained):
                num[i] = masks.drafts[k]
            rows = to_device(torch.tensor([i * width + j for i in constrained for j in range(width)]), logits.device)
            logits = apply_token_mask(logits, rows, masks.bits)
        return logits, num

    def _grammar_masks(self, request_ids: list[int], drafts: list[list[int]], num: list[int],
                       width: int) -> _GrammarMasks:
        """Each request's allowed-token bitmask at its next position and after
        each of its drafts, found by taking the drafts into its grammar and
        rolling them back; a draft the grammar refuses ends the request's
        drafts there. Rows past them allow everything (they are never kept)."""
        assert self.grammars is not None
        bits = np.full((len(request_ids) * width, self.grammars.words), -1, dtype=np.int32)
        ends = self.grammars.eos_ids
        kept: list[int] = []
        for k, (request_id, proposed, n) in enumerate(zip(request_ids, drafts, num)):
            matcher = self.requests[request_id].matcher
            assert matcher is not None
            valid = taken = 0  # drafts the grammar allows; of them, those it took (an end is not taken)
            try:
                for j in range(n + 1):
                    row = bits[k * width + j]
                    matcher.fill_mask(row)
                    if not row.any():
                        raise ValueError(f"the request's grammar allows no token here: {matcher.error}")
                    if j == n:
                        break
                    allowed, took = matcher.take_draft(row, proposed[j], ends)
                    valid += allowed
                    if not took:
                        break  # refused, or an allowed end: the output ends with this draft
                    taken += 1
                    if matcher.stopped:  # a draft completed the output: nothing after it is kept
                        break
            finally:
                matcher.rollback(taken)
            kept.append(valid)
        return _GrammarMasks(bits, kept)

    def _logprobs(self, chunks: list[ScheduledChunk], logits: torch.Tensor,
                  tokens: torch.Tensor) -> dict[int, tuple[list[float], list[tuple[tuple[int, float], ...]] | None]]:
        """Chunk index -> (logprob of each drawn token, its top alternatives) for
        the chunks that asked; ``logits`` [B * width, vocab] raw, ``tokens`` [B, width]."""
        want = [(i, self.requests[chunk.seq.request_id].params.logprobs) for i, chunk in enumerate(chunks)]
        want = [(i, top) for i, top in want if top is not None]
        if not want:
            return {}
        width = tokens.shape[1]
        top = max(k for _, k in want)
        rows = to_device(torch.tensor([i * width + j for i, _ in want for j in range(width)]), logits.device)
        chosen, values, ids = token_logprobs(logits[rows], tokens.reshape(-1)[rows], top)
        # One copy: token ids are exact in float32 (below 2**24).
        parts = [chosen[:, None]] if values is None or ids is None else [chosen[:, None], values, ids.float()]
        host = torch.cat(parts, dim=1).view(len(want), width, -1).tolist()
        out: dict[int, tuple[list[float], list[tuple[tuple[int, float], ...]] | None]] = {}
        for w, (i, k) in enumerate(want):
            alternatives = None
            if top:
                alternatives = [tuple(zip(map(int, row[1 + top : 1 + top + k]), row[1 : 1 + k])) for row in host[w]]
            out[i] = ([row[0] for row in host[w]], alternatives)
        return out


    def _pending_drafts(self, chunks: list[ScheduledChunk], most: int,
                        plan: SamplingPlan) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The chunks' drafts [B, most] (0-padded) and the sampled rows' draft
        distributions [S, most, vocab] (zero where a chunk has fewer)."""
        vocab = self.vocab_size
        if plan.sampled_rows is None and all(chunk.drafts == most for chunk in chunks):  # the common case
            return torch.stack([self._drafts_of(chunk)[0][:most] for chunk in chunks]), None
        tokens, probs = [], []
        sampled = set(plan.sampled_rows.tolist()) if plan.sampled_rows is not None else set()
        for i, chunk in enumerate(chunks):
            pending = self.requests[chunk.seq.request_id].drafts
            n = chunk.drafts
            row = torch.zeros(most, dtype=torch.long, device=self.device)
            q = torch.zeros(most, vocab, device=self.device) if i in sampled else None
            if pending is not None and n:
                row[:n] = pending[0][:n]
                if q is not None and pending[1] is not None:
                    q[:n] = pending[1][:n]
            tokens.append(row)
            if q is not None:
                probs.append(q)
        return torch.stack(tokens), torch.stack(probs) if probs else None


    def draft_masker(self, drafting: list[Request]) -> DraftMasker | None:
        """Drafts drawn within the requests' grammars (those that have one):
        a draft the grammar would refuse is never proposed, so the verify step
        is not spent on it."""
        rows = [(k, r.matcher) for k, r in enumerate(drafting) if r.matcher is not None]
        if not rows:
            return None
        assert self.grammars is not None
        return DraftMasker(rows, self.grammars.words, frozenset(self.grammars.eos_ids))
