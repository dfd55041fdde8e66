"""A prompt's token ids, checked against the model before it reaches an
engine: what both the engine and the API process (which imports no torch)
refuse a prompt for."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from llm_core.model.tokenizer import Tokenizer

__all__ = ["Prompt", "check_context_length", "check_prompt_ids", "encode_prompt"]

Prompt = str | Sequence[int]


def encode_prompt(prompt: Prompt, tokenizer: Tokenizer | None, vocab_size: int, model_dir: Path) -> list[int]:
    """Token ids of a prompt (text, or ids checked against the vocabulary)."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(f"text prompts need a tokenizer.json in {model_dir}; pass token ids instead")
        ids = tokenizer.encode(prompt)
    else:
        ids = [int(t) for t in prompt]
    if not ids:
        raise ValueError("prompt is empty")
    check_prompt_ids(ids, vocab_size)
    return ids


def check_context_length(num_prompt_tokens: int, max_tokens: int, context_length: int) -> None:
    if num_prompt_tokens + max_tokens > context_length:
        raise ValueError(
            f"prompt of {num_prompt_tokens} tokens plus max_tokens={max_tokens} exceeds "
            f"the model's context length of {context_length} tokens"
        )


def check_prompt_ids(ids: list[int], vocab_size: int) -> None:
    """Refuse a prompt naming ids the model has no embedding for: caught
    here, it is a clear error at admission, not a failed step. It runs on the
    engine's thread between steps, so the common case is two C-speed scans."""
    if not ids or (min(ids) >= 0 and max(ids) < vocab_size):
        return
    bad = [t for t in ids if not 0 <= t < vocab_size]
    raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")

