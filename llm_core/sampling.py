"""Sampling parameters and the per-request sampler.

Each request samples with its own ``torch.Generator``, so a seeded request
draws the same tokens whatever else is in its batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


# Temperatures in (0, MIN_TEMPERATURE) are refused: dividing logits by them
# overflows to inf (1e-38) and softmax turns that into NaN, which cannot be
# sampled. Above MAX_TEMPERATURE the distribution is indistinguishable from
# uniform, so a larger value is a client mistake, not a wish.
MIN_TEMPERATURE = 1e-2
MAX_TEMPERATURE = 100.0
# torch.Generator seeds are 64-bit; OpenAI clients also send negative seeds.
MIN_SEED, MAX_SEED = -(1 << 63), (1 << 64) - 1
MAX_TOP_K = (1 << 31) - 1  # vocabularies are indexed by int32; the engine also checks its own size


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

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
        stops = tuple(self.stop_token_ids)
        if not all(_is_int(t) and t >= 0 for t in stops):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {list(stops)[:8]!r}")
        # Accept any iterable of ids but keep the dataclass hashable and frozen.
        object.__setattr__(self, "temperature", temperature)
        object.__setattr__(self, "top_p", float(self.top_p))
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


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finite(value: object, name: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def make_generator(params: SamplingParams, device: torch.device | str) -> torch.Generator | None:
    if params.greedy:
        return None
    generator = torch.Generator(device=device)
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(params.seed)
    return generator


def sample_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> int:
    """Next token id from one row of float32 logits [vocab]."""
    if params.greedy:
        return int(torch.argmax(logits))
    logits = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (always >= 1 token).
        drop = (probs.cumsum(dim=-1) - probs) >= params.top_p
        drop[0] = False  # a top_p that rounds to 0 in float32 must still leave the top token
        logits = logits.scatter(0, order[drop], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
