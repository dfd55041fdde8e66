"""Multimodal prompt spans: embedding rows that replace placeholder tokens.

Encoders (elsewhere) turn an image, a video or an audio clip into embedding
rows; the prompt holds one placeholder token per row. A span says where the
rows go and names their content with a key. The engine feeds the rows instead
of the placeholders' token embeddings, and the prefix cache sees the key (as a
negative token id) instead of the placeholder, so prompts that differ only in
their image never share KV past the image's first position.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class MultimodalSpan:
    offset: int  # first prompt position whose embedding is replaced
    embeddings: torch.Tensor  # [length, hidden_size]; any float dtype/device, the engine casts/moves
    key: bytes  # identifies the content: equal keys <=> equal embeddings

    @property
    def length(self) -> int:
        return int(self.embeddings.shape[0])

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class SpanRef:
    """A span by its content key alone, without its embedding rows: how a
    span travels between processes (the rows are in the embedding store)."""

    offset: int
    length: int
    key: bytes

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class MediaEmbedding:
    """One media item, encoded: the one record that travels from the encoders
    (through the embedding cache, and between the stack's processes) to the
    chat prompt and the engine, so no layer re-wraps the same four facts.

    ``tensor`` is None where the rows stay in an embedding store (the stack's
    API process sees only the key and the row count); the engine then reads
    them by ``key``. ``rows`` is always given, so a prompt can be laid out
    without the rows at hand.
    """

    kind: str  # "image" | "video" | "audio"
    key: bytes  # content key: equal keys <=> equal embeddings
    rows: int  # placeholder positions the item takes in the prompt
    tensor: torch.Tensor | None = None  # [rows, hidden]
    cached: bool = False  # found in the embedding cache: nothing was decoded or encoded

    def __post_init__(self) -> None:
        # A row count that disagrees with the tensor would lay the prompt out
        # for one length and feed another: refuse it here, where it is made.
        if self.tensor is not None and (self.tensor.ndim == 0 or int(self.tensor.shape[0]) != self.rows):
            raise ValueError(f"a {self.kind} embedding of {self.rows} rows was given a tensor of shape "
                             f"{tuple(self.tensor.shape)}")

    def span(self, offset: int) -> MultimodalSpan | SpanRef:
        """Where its rows go in a prompt: by value where it has them, else by key."""
        if self.tensor is None:
            return SpanRef(offset, self.rows, self.key)
        return MultimodalSpan(offset, self.tensor, self.key)


def cache_token(key: bytes) -> int:
    """The id standing for a span's positions in prefix-cache keys.

    Negative, so it can never equal a real vocabulary id (a placeholder token
    or text); 63 bits of a keyed hash, so distinct contents practically never
    collide.
    """
    digest = hashlib.blake2b(key, digest_size=8).digest()
    return -(1 + (int.from_bytes(digest, "big") >> 1))


def with_cache_tokens(prompt: Sequence[int], spans: Sequence[MultimodalSpan | SpanRef]) -> list[int]:
    """``prompt`` with every span position replaced by the span's cache token."""
    out = list(prompt)
    for span in spans:
        out[span.offset : span.end] = [cache_token(span.key)] * span.length
    return out


def check_spans(spans: Sequence[MultimodalSpan], prompt_len: int, hidden_size: int) -> None:
    """Raise ValueError, saying why, unless every span is well formed, inside
    the prompt and disjoint from the others."""
    for i, span in enumerate(spans):
        _check_span(i, span, prompt_len, hidden_size)
    ordered = sorted(range(len(spans)), key=lambda i: spans[i].offset)
    for a, b in zip(ordered, ordered[1:]):
        if spans[b].offset < spans[a].end:
            raise ValueError(
                f"multimodal spans {a} [{spans[a].offset}, {spans[a].end}) and "
                f"{b} [{spans[b].offset}, {spans[b].end}) overlap"
            )


def _check_span(index: int, span: MultimodalSpan, prompt_len: int, hidden_size: int) -> None:
    import torch  # these records travel through the API process, which imports no torch

    where = f"multimodal span {index}"
    if not isinstance(span, MultimodalSpan):
        raise ValueError(f"{where} is a {type(span).__name__}, not a MultimodalSpan")
    if not isinstance(span.key, bytes) or not span.key:
        raise ValueError(f"{where}: key must be non-empty bytes, got {type(span.key).__name__}")
    emb = span.embeddings
    if not isinstance(emb, torch.Tensor) or emb.ndim != 2:
        shape = tuple(emb.shape) if isinstance(emb, torch.Tensor) else type(emb).__name__
        raise ValueError(f"{where}: embeddings must be a [length, hidden_size] tensor, got {shape}")
    if not emb.is_floating_point():
        raise ValueError(f"{where}: embeddings must be floating point, got {emb.dtype}")
    if emb.shape[1] != hidden_size:
        raise ValueError(f"{where}: embeddings have hidden size {emb.shape[1]}, the model has {hidden_size}")
    if span.length == 0:
        raise ValueError(f"{where} is empty (0 embedding rows)")
    if isinstance(span.offset, bool) or not isinstance(span.offset, int):
        raise ValueError(f"{where}: offset must be an int, got {type(span.offset).__name__}")
    if span.offset < 0 or span.end > prompt_len:
        raise ValueError(
            f"{where} covers positions [{span.offset}, {span.end}), outside the prompt of {prompt_len} tokens"
        )
    if not bool(torch.isfinite(emb).all()):
        raise ValueError(f"{where}: embeddings contain NaN or infinite values")
