"""One request as the engine holds it, and the token events it gives out.

``Request`` is the single record of a live request: the scheduler's
``Sequence`` (tokens, KV view, progress) and everything the engine adds to
it (sampling, stop ids, grammar, media spans, pending drafts, a prefill
worker's export). The engine keeps one map of them and ends a request in
one place, so nothing of a request can outlive it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llm_core.sample.grammar import GrammarMatcher
from llm_core.model.multimodal import MultimodalSpan
from llm_core.sample.params import SamplingParams
from llm_core.sample.sampling import SamplingRow
from llm_core.sched.scheduler import Sequence

__all__ = ["Request", "TokenEvent"]


@dataclass(frozen=True)
class TokenEvent:
    request_id: int
    token: int  # -1 on an "error" event
    finish_reason: str | None  # set on the request's last event: "stop", "length" or "error"
    error: str | None = None  # why the request failed, with finish_reason "error"
    # With SamplingParams.logprobs: the token's log-probability under the model
    # (log-softmax of the raw logits) and the most likely (token, logprob) pairs.
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    cached_tokens: int | None = None  # on a request's first event: prompt tokens the prefix cache served


@dataclass(eq=False)
class Request:
    seq: Sequence
    params: SamplingParams
    stop_ids: frozenset[int]
    seed: int
    matcher: GrammarMatcher | None = None  # with a grammar (structured outputs)
    # Media spans, their embeddings already on the engine's device and dtype.
    spans: tuple[MultimodalSpan, ...] = ()
    # Drafts waiting for the next step's verification: tokens [k] and, when the
    # request samples, the distributions they were drawn from [k, vocab].
    drafts: tuple[torch.Tensor, torch.Tensor | None] | None = None
    # A prefill worker's request: it ends after its first token with its KV packed.
    exports_kv: bool = False
    first_event: TokenEvent | None = None  # an exporting request's first token, until its KV is packed

    @property
    def id(self) -> int:
        return self.seq.request_id

    def sampling_row(self) -> SamplingRow:
        # The token count, not a step count: preemption and recompute draw the same.
        return SamplingRow(self.params, self.seed, len(self.seq.output))

    def kept(self, tokens: list[int]) -> tuple[list[int], str | None]:
        """The tokens it keeps of those it drew (up to a stop token or
        max_tokens), and why it ends, if it does."""
        seq = self.seq
        room = seq.max_tokens - len(seq.output)
        for i, token in enumerate(tokens[:room]):
            if token in self.stop_ids:
                return tokens[: i + 1], "stop"
        tokens = tokens[:room]
        return tokens, "length" if tokens and len(seq.output) + len(tokens) >= seq.max_tokens else None

    def follow_grammar(self, tokens: list[int], reason: str | None) -> tuple[list[int], str | None]:
        """Advance its grammar by its new tokens; the output ends ("stop")
        where the grammar does. ValueError if it refuses a token."""
        if self.matcher is None:
            return tokens, reason
        for i, token in enumerate(tokens):
            if not self.matcher.consume(token):
                raise ValueError(f"token {token} breaks the request's grammar: {self.matcher.error}")
            if self.matcher.stopped:
                return tokens[: i + 1], "stop"
        return tokens, reason

    def touches_span(self, start: int, end: int) -> bool:
        return any(span.offset < end and start < span.end for span in self.spans)
