"""The batched sampler (a request's parameters: ``llm_core.sample.params``).

Every row of a step is sampled in one batched pass (greedy, temperature,
top-k, top-p) with random numbers that are a function of the request's seed
and its token count only, so a seeded request draws the same tokens whatever
else is in its batch, and the step needs one device-to-host copy of the
sampled tokens, not one per request.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from llm_core.device import to_device
from llm_core.sample.params import SamplingParams


@dataclass(frozen=True)
class SamplingRow:
    """One batch row to sample: its parameters, its seed and how many tokens the
    request has sampled so far (the counter that makes each draw fresh)."""

    params: SamplingParams
    seed: int
    offset: int


@dataclass(frozen=True)
class SamplingPlan:
    """The sampling parameters of a step's rows as tensors, built on the host in
    O(rows) from values it already has, so sampling needs no host round trip."""

    sampled_rows: torch.Tensor | None  # [S] rows that draw at random; None: every row is greedy
    temperature: torch.Tensor  # [S, 1] float32
    top_k: torch.Tensor | None  # [S, 1] int64 (the vocabulary size where off); None: no row filters
    top_p: torch.Tensor | None  # [S, 1] float32
    seed_lo: torch.Tensor  # [S, 1] int64: the seed's low and high 32 bits
    seed_hi: torch.Tensor
    offset: torch.Tensor  # [S, 1] int64

    @staticmethod
    def build(rows: Sequence[SamplingRow], vocab_size: int, device: torch.device | str) -> SamplingPlan:
        drawn = [(i, row) for i, row in enumerate(rows) if not row.params.greedy]
        if not drawn:
            # Every row greedy (the common decode step): its fields are never read,
            # and building six empty tensors was a tenth of a small step's host time.
            return _all_greedy_plan(torch.device(device))

        def column(values: list[float] | list[int], dtype: torch.dtype) -> torch.Tensor:
            return to_device(torch.tensor(values, dtype=dtype).view(-1, 1), device)

        params = [row.params for _, row in drawn]
        filters = any(p.top_k > 0 or p.top_p < 1.0 for p in params)
        seeds = [row.seed % (1 << 64) for _, row in drawn]
        return SamplingPlan(
            sampled_rows=column([i for i, _ in drawn], torch.int64).view(-1) if drawn else None,
            temperature=column([p.temperature for p in params], torch.float32),
            top_k=column([p.top_k if p.top_k > 0 else vocab_size for p in params], torch.int64) if filters else None,
            top_p=column([p.top_p for p in params], torch.float32) if filters else None,
            seed_lo=column([s & _MASK32 for s in seeds], torch.int64),
            seed_hi=column([s >> 32 for s in seeds], torch.int64),
            offset=column([row.offset & _MASK32 for _, row in drawn], torch.int64),
        )


@functools.cache
def _all_greedy_plan(device: torch.device) -> SamplingPlan:
    def empty(dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(0, 1, dtype=dtype, device=device)

    return SamplingPlan(None, empty(torch.float32), None, None, empty(torch.int64), empty(torch.int64),
                        empty(torch.int64))


def sample_tokens(logits: torch.Tensor, plan: SamplingPlan) -> torch.Tensor:
    """Next token of every row of ``logits`` [B, vocab], on the logits' device.

    Greedy rows take the argmax. The others draw by the Gumbel-max trick with
    noise that is a hash of (seed, offset, token id): a row's draw depends on
    nothing else in the batch, a seeded request repeats exactly, and all rows
    are sampled in one batched pass with no per-row host work.
    """
    tokens = logits.argmax(dim=-1)
    if plan.sampled_rows is None:
        return tokens
    kept = filter_logits(logits[plan.sampled_rows].float() / plan.temperature, plan.top_k, plan.top_p)
    tokens[plan.sampled_rows] = (kept + _gumbel(plan, kept.shape[-1], kept.device)).argmax(dim=-1)
    return tokens


def filter_logits(scaled: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """``scaled`` [S, vocab] with -inf outside each row's top-k / top-p set.

    In sorted order: rank < top_k, then the smallest prefix whose (top-k
    renormalised) mass reaches top_p; the top token always stays.
    """
    if top_k is None or top_p is None:
        return scaled
    ordered, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(ordered.shape[-1], device=ordered.device)
    ordered = ordered.masked_fill(rank >= top_k, float("-inf"))
    probs = ordered.softmax(dim=-1)
    drop = (probs.cumsum(dim=-1) - probs) >= top_p
    drop[:, 0] = False  # a top_p that rounds to 0 in float32 must still leave the top token
    ordered = ordered.masked_fill(drop, float("-inf"))
    return torch.empty_like(scaled).scatter_(1, order, ordered)


@dataclass(frozen=True)
class Penalties:
    """The penalties of some rows of a step, as tensors: ``counts`` of each
    token in the request's output so far and ``seen`` (prompt or output) [P, vocab]."""

    rows: torch.Tensor  # [P] logits rows they apply to
    counts: torch.Tensor  # [P, vocab] float32
    seen: torch.Tensor  # [P, vocab] bool
    presence: torch.Tensor  # [P, 1] float32
    frequency: torch.Tensor  # [P, 1]
    repetition: torch.Tensor  # [P, 1]


class TokenCounts:
    """Per-request token counts on the device for the penalties: one row per
    penalised request in a shared buffer, updated for a whole step in one
    scatter, so a step's cost does not grow with the requests' lengths."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._slot: dict[int, int] = {}
        self._free: list[int] = []
        self._counts = torch.zeros(0, vocab_size, device=device)
        self._seen = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._slot

    def admit(self, request_id: int, prompt: list[int]) -> None:
        """Start counting for a request; its prompt tokens count as seen."""
        if not self._free:
            self._grow()
        slot = self._free.pop()
        self._slot[request_id] = slot
        self._counts[slot].zero_()
        self._seen[slot].zero_()
        if prompt:
            self._seen[slot, to_device(torch.tensor(prompt, dtype=torch.int64), self.device)] = True

    def _grow(self) -> None:
        old = self._counts.shape[0]
        new = max(8, 2 * old)
        self._counts = torch.cat((self._counts, self._counts.new_zeros(new - old, self.vocab_size)))
        self._seen = torch.cat((self._seen, self._seen.new_zeros(new - old, self.vocab_size)))
        self._free.extend(range(new - 1, old - 1, -1))

    def add(self, tokens: dict[int, list[int]]) -> None:
        """Count each request's new tokens (requests not counted are skipped)."""
        slots, ids = [], []
        for request_id, new in tokens.items():
            slot = self._slot.get(request_id)
            if slot is not None:
                slots += [slot] * len(new)
                ids += new
        if not ids:
            return
        index = (to_device(torch.tensor(slots), self.device), to_device(torch.tensor(ids), self.device))
        self._counts.index_put_(index, torch.ones(len(ids), device=self.device), accumulate=True)
        self._seen[index] = True

    def release(self, request_id: int) -> None:
        slot = self._slot.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def penalties(self, rows: list[int], request_ids: list[int], params: list[SamplingParams],
                  extra: list[list[int]] | None = None) -> Penalties:
        """The penalties of logits ``rows``, row i for ``request_ids[i]``;
        ``extra[i]``: tokens row i sees beyond the counted ones (drafts before it)."""
        index = to_device(torch.tensor([self._slot[r] for r in request_ids]), self.device)
        counts, seen = self._counts[index], self._seen[index]
        if extra is not None and any(extra):
            at = [(i, t) for i, tokens in enumerate(extra) for t in tokens]
            where = tuple(to_device(torch.tensor(c), self.device) for c in zip(*at))
            counts = counts.index_put(where, torch.ones(len(at), device=self.device), accumulate=True)
            seen = seen.index_put(where, torch.ones(len(at), dtype=torch.bool, device=self.device))

        def column(values: list[float]) -> torch.Tensor:
            return to_device(torch.tensor(values, dtype=torch.float32).view(-1, 1), self.device)

        return Penalties(to_device(torch.tensor(rows), self.device), counts, seen,
                         column([p.presence_penalty for p in params]), column([p.frequency_penalty for p in params]),
                         column([p.repetition_penalty for p in params]))


def apply_penalties(logits: torch.Tensor, penalties: Penalties) -> torch.Tensor:
    """``logits`` [B, vocab] with each penalised row adjusted, out of place:
    repetition first (divide positive logits of seen tokens, multiply
    negative ones), then OpenAI's ``- frequency * count - presence * (count > 0)``."""
    rows = logits[penalties.rows].float()
    r = penalties.repetition
    rows = torch.where(penalties.seen, torch.where(rows > 0, rows / r, rows * r), rows)
    counts = penalties.counts
    rows = rows - penalties.frequency * counts - penalties.presence * (counts > 0).float()
    out = logits.clone()
    out[penalties.rows] = rows.to(out.dtype)
    return out


def apply_token_mask(logits: torch.Tensor, rows: torch.Tensor, bitmask: np.ndarray) -> torch.Tensor:
    """``logits`` [B, vocab] with the tokens ``bitmask`` [M, words] (int32, bit
    t % 32 of word t // 32: token t allowed) does not allow set to -inf in
    ``rows`` [M] (ascending); out of place. The bitmask is unpacked where the logits are:
    on the host with numpy, on a device after a copy of the packed bits (32x
    smaller than a mask of bools)."""
    vocab = logits.shape[-1]
    if logits.device.type == "cpu":
        unpacked = np.unpackbits(bitmask.view(np.uint8), axis=1, count=vocab, bitorder="little")
        allowed = torch.from_numpy(unpacked).bool()
    else:
        packed = to_device(torch.from_numpy(bitmask), logits.device)
        bits = torch.arange(32, device=logits.device, dtype=torch.int32)
        allowed = ((packed[:, :, None] >> bits) & 1).view(packed.shape[0], -1)[:, :vocab].bool()
    if rows.numel() == logits.shape[0]:  # every row masked, in order: one pass
        return logits.masked_fill(~allowed, float("-inf"))
    out = logits.clone()
    out[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    return out


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor | None,
                                                                                  torch.Tensor | None]:
    """Log-softmax of ``logits`` [R, vocab] (float32) at ``tokens`` [R], and
    the ``top`` most likely (logprobs [R, top], ids [R, top]) when top > 0."""
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = logprobs.gather(1, tokens.view(-1, 1)).view(-1)
    if top <= 0:
        return chosen, None, None
    values, ids = logprobs.topk(top, dim=-1)
    return chosen, values, ids


def sample_token(logits: torch.Tensor, params: SamplingParams, seed: int, offset: int) -> int:
    """One row's next token (the batched sampler on a batch of one)."""
    plan = SamplingPlan.build([SamplingRow(params, seed, offset)], logits.shape[-1], logits.device)
    return int(sample_tokens(logits.view(1, -1), plan)[0])


# 32-bit lanes in int64 tensors: with multipliers below 2**31 no product
# overflows, so the hash is exact on every device and in every dtype path.
_MASK32 = (1 << 32) - 1
_MIX_A, _MIX_B = 0x7FEB352D, 0x2C1B3C6D


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = (x * _MIX_A) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MIX_B) & _MASK32
    return x ^ (x >> 16)


# Independent random streams of one (seed, token offset): the token drawn
# there, a draft proposed there, and the uniform that accepts or rejects it.
SAMPLE_STREAM, DRAFT_STREAM, ACCEPT_STREAM = 0, 1, 2


def _key(plan: SamplingPlan, delta: torch.Tensor | int, stream: int) -> torch.Tensor:
    """[S, 1] hash of (seed, offset + delta, stream)."""
    offset = plan.offset if isinstance(delta, int) and delta == 0 else (plan.offset + delta) & _MASK32
    key = _mix32(_mix32(_mix32(plan.seed_lo) ^ plan.seed_hi) ^ offset)
    return key if stream == SAMPLE_STREAM else _mix32(key ^ ((stream * 0x632BE5AB) & _MASK32))


def _unit(bits: torch.Tensor) -> torch.Tensor:
    # 24 bits fit float32 exactly; +0.5 keeps u inside (0, 1).
    return ((bits >> 8).to(torch.float32) + 0.5) / float(1 << 24)


def _gumbel(plan: SamplingPlan, vocab_size: int, device: torch.device, delta: torch.Tensor | int = 0,
            stream: int = SAMPLE_STREAM) -> torch.Tensor:
    """Gumbel noise [S, vocab], a pure function of (seed, offset + delta, stream, token id)."""
    key = _key(plan, delta, stream)
    token_ids = torch.arange(vocab_size, device=device, dtype=torch.int64)[None, :]
    bits = _mix32(_mix32(token_ids ^ key) ^ ((key * 0x9E37) & _MASK32))
    return -torch.log(-torch.log(_unit(bits)))


def _uniforms(plan: SamplingPlan, count: int, stream: int) -> torch.Tensor:
    """[S, count] uniforms in (0, 1), the i-th a function of (seed, offset + i, stream)."""
    delta = torch.arange(count, device=plan.offset.device)[None, :]
    key = _key(plan, delta, stream)
    return _unit(_mix32(key ^ ((key * 0x9E37) & _MASK32)))


# --------------------------------------------------------------------------------------
# Speculative decoding: drafts and their verification, batched over requests
# --------------------------------------------------------------------------------------


def draw_drafts(logits: torch.Tensor, plan: SamplingPlan, depth: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A draft token for every row of ``logits`` [B, vocab] (an MTP layer's, for
    the token ``depth`` places after the request's next one) and, for rows that
    sample, the distribution q it was drawn from ([S, vocab], the rows of
    ``plan.sampled_rows``): greedy rows draft the argmax, the others draw from
    q (temperature, top-k and top-p applied as to the target) with noise of
    their own stream, so acceptance stays independent of the draw."""
    tokens = logits.argmax(dim=-1)
    if plan.sampled_rows is None:
        return tokens, None
    kept = filter_logits(logits[plan.sampled_rows].float() / plan.temperature, plan.top_k, plan.top_p)
    tokens[plan.sampled_rows] = (kept + _gumbel(plan, kept.shape[-1], kept.device, depth, DRAFT_STREAM)).argmax(-1)
    return tokens, kept.softmax(dim=-1)


def verify_drafts(
    logits: torch.Tensor,
    drafts: torch.Tensor,
    num_drafts: torch.Tensor,
    draft_probs: torch.Tensor | None,
    plan: SamplingPlan,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept each request's drafts against the target, in one batched pass.

    logits [B, k+1, vocab]: the target's at the request's next position and at
    each draft; drafts [B, k]; num_drafts [B] (rows past it are padding);
    draft_probs [S, k, vocab]: q of the rows that sample (``plan.sampled_rows``);
    ``plan`` offsets count the tokens each request has so far. Returns tokens
    [B, k+1] and accepted [B]: the request's new tokens are tokens[b, :accepted[b] + 1].

    Greedy rows keep the longest run of drafts equal to the target's argmax,
    then the target's own next token. Sampled rows accept draft i with
    probability min(1, p/q) and, at the first rejection, draw from the
    normalised residual max(0, p - q) (after the last draft: from p), which
    leaves every token distributed as the target alone would draw it.
    """
    b, rows, _ = logits.shape
    k = rows - 1
    valid = torch.arange(k, device=logits.device)[None, :] < num_drafts[:, None]
    tokens = logits.argmax(dim=-1)
    accepted = ((drafts == tokens[:, :k]) & valid).long().cumprod(dim=1).sum(dim=1)
    if plan.sampled_rows is None:
        return tokens, accepted
    rows_s = plan.sampled_rows
    s, vocab = rows_s.shape[0], logits.shape[-1]
    scaled = logits[rows_s].float() / plan.temperature[:, :, None]
    repeat = (lambda t: None if t is None else t.repeat_interleave(rows, dim=0))  # noqa: E731
    kept = filter_logits(scaled.view(s * rows, vocab), repeat(plan.top_k), repeat(plan.top_p))
    p = kept.softmax(dim=-1).view(s, rows, vocab)
    d = drafts[rows_s]
    q = draft_probs if draft_probs is not None else p.new_zeros(s, k, vocab)
    p_d = p[:, :k].gather(2, d[:, :, None]).squeeze(2)
    q_d = q.gather(2, d[:, :, None]).squeeze(2)
    ok = (_uniforms(plan, k, ACCEPT_STREAM) * q_d < p_d) & valid[rows_s]
    a = ok.long().cumprod(dim=1).sum(dim=1)
    p_a = p.gather(1, a.view(s, 1, 1).expand(s, 1, vocab)).squeeze(1)
    q_pad = torch.cat((q, q.new_zeros(s, 1, vocab)), dim=1)
    residual = (p_a - q_pad.gather(1, a.view(s, 1, 1).expand(s, 1, vocab)).squeeze(1)).clamp_(min=0)
    # p == q leaves no residual mass: the rejection then had probability 0.
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p_a)
    final = (residual.log() + _gumbel(plan, vocab, logits.device, a[:, None], SAMPLE_STREAM)).argmax(dim=-1)
    index = torch.arange(rows, device=logits.device)[None, :]
    drafted = torch.cat((d, d[:, :1]), dim=1)
    tokens[rows_s] = torch.where(index < a[:, None], drafted, final[:, None])
    accepted[rows_s] = a
    return tokens, accepted
