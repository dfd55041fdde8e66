"""A request's sampling parameters, checked when made: what the API builds
from a request body, so it imports no torch (the sampler is
``llm_core.sample.sampling``)."""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

from llm_core.sample.grammar import GrammarSpec

# Temperatures in (0, MIN_TEMPERATURE) are refused: dividing logits by them
# overflows to inf (1e-38) and softmax turns that into NaN, which cannot be
# sampled. Above MAX_TEMPERATURE the distribution is indistinguishable from
# uniform, so a larger value is a client mistake, not a wish.
MIN_TEMPERATURE = 1e-2
MAX_TEMPERATURE = 100.0
# torch.Generator seeds are 64-bit; OpenAI clients also send negative seeds.
MIN_SEED, MAX_SEED = -(1 << 63), (1 << 64) - 1
MAX_TOP_K = (1 << 31) - 1  # vocabularies are indexed by int32; the engine also checks its own size
MAX_PENALTY = 2.0  # presence / frequency, as OpenAI bounds them
# Beyond these every seen token is simply banned (or boosted past all others);
# a penalty that rounds to 0 in float32 would divide logits by zero.
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 1e-2, 10.0
MAX_TOP_LOGPROBS = 20  # as OpenAI


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # OpenAI's: subtracted from the logits of tokens already generated, once
    # (presence) and per occurrence (frequency).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's / transformers': logits of tokens in the prompt or the output are
    # divided by it where positive and multiplied where negative.
    repetition_penalty: float = 1.0
    # None: no log-probabilities; k >= 0: each token's, and the k most likely.
    logprobs: int | None = None
    grammar: GrammarSpec | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        temperature = _finite(self.temperature, "temperature")
        if temperature != 0.0 and not MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE:
            raise ValueError(
                f"temperature must be 0 (greedy) or between {MIN_TEMPERATURE} and {MAX_TEMPERATURE}, "
                f"got {self.temperature!r}"
            )
        if not 0.0 < _finite(self.top_p, "top_p") <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or not (self.top_k == -1 or 1 <= self.top_k <= MAX_TOP_K):
            raise ValueError(f"top_k must be -1 (off) or an integer from 1 to {MAX_TOP_K}, got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not MIN_SEED <= self.seed <= MAX_SEED):
            raise ValueError(f"seed must be an integer from {MIN_SEED} to {MAX_SEED}, got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -MAX_PENALTY <= _finite(value, name) <= MAX_PENALTY:
                raise ValueError(f"{name} must be between -{MAX_PENALTY} and {MAX_PENALTY}, got {value!r}")
        if not MIN_REPETITION_PENALTY <= _finite(self.repetition_penalty, "repetition_penalty") \
                <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be from {MIN_REPETITION_PENALTY} to {MAX_REPETITION_PENALTY}, "
                             f"got {self.repetition_penalty!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise ValueError(f"logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {self.logprobs!r}")
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            raise ValueError("grammar must be a GrammarSpec")
        stops = tuple(self.stop_token_ids)
        if not all(_is_int(t) and t >= 0 for t in stops):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {list(stops)[:8]!r}")
        # Accept any iterable of ids but keep the dataclass hashable and frozen.
        object.__setattr__(self, "temperature", temperature)
        object.__setattr__(self, "top_p", float(self.top_p))
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
            object.__setattr__(self, name, float(getattr(self, name)))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stops))

    def check_vocabulary(self, vocab_size: int) -> None:
        """Refuse token-id parameters that name ids the model does not have."""
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
        if self.top_k > vocab_size:
            raise ValueError(f"top_k must be at most the vocabulary size ({vocab_size}), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def penalised(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finite(value: object, name: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def request_seed(params: SamplingParams) -> int:
    """The seed a request samples with: its own, or a fresh random one."""
    return params.seed if params.seed is not None else secrets.randbits(64)
