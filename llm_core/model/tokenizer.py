"""Text ↔ token ids through a checkpoint's ``tokenizer.json``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

TOKENIZER_FILE = "tokenizer.json"

# What an incomplete UTF-8 sequence decodes to (and, rarely, a real character).
_REPLACEMENT = "\ufffd"

# A UTF-8 character is at most 4 bytes and a byte-level token carries at least
# one byte, so text still ending in U+FFFD after this many unreleased tokens is
# a run of invalid bytes, not one character waiting for its last bytes.
_MAX_PENDING = 4


# Markup a checkpoint may declare special that the server's output parsers
# read (MiMo's reasoning and tool-call tags): kept when special tokens are skipped.
KEPT_MARKUP = frozenset({"<think>", "</think>", "<tool_call>", "</tool_call>"})


class Tokenizer:
    def __init__(self, path: str | Path) -> None:
        self._tok = _HFTokenizer.from_file(str(path))
        added = self._tok.get_added_tokens_decoder().items()
        self._special_ids = frozenset(i for i, t in added if t.special and t.content not in KEPT_MARKUP)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> Tokenizer | None:
        path = Path(model_dir) / TOKENIZER_FILE
        return cls(path) if path.exists() else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._special_ids]
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def stream_decoder(self, skip_special_tokens: bool = True) -> StreamDecoder:
        """A decoder for tokens that arrive one at a time (a generated answer)."""
        return StreamDecoder(lambda ids: self.decode(ids, skip_special_tokens),
                             skip=self._special_ids if skip_special_tokens else frozenset())

    def token_to_id(self, token: str) -> int:
        found = self._tok.token_to_id(token)
        if found is None:
            raise KeyError(f"the tokenizer has no token {token!r}")
        return int(found)


class StreamDecoder:
    """Token ids fed one at a time -> the text each one adds, at a cost that does
    not grow with the length of the text so far.

    Only a short window is decoded per token (vLLM's and TGI's
    prefix_offset/read_offset scheme): the tokens released last, as context, plus
    the tokens not released yet. The new text is what the window decodes to past
    the context's own text; the context is there so decoders that treat a
    sequence's first token specially (a leading-space marker) decode the new
    tokens as they would mid-text. Text ending in U+FFFD is an incomplete UTF-8
    character: it is held back until a later token completes it, or ``flush``.
    For byte-level tokenizers the deltas add up to ``decode(all tokens)``.

    ``skip``: ids that decode to nothing wherever they are (special tokens the
    decode skips); they never enter the window, so a run of them costs nothing.
    """

    def __init__(self, decode: Callable[[list[int]], str], skip: frozenset[int] = frozenset()) -> None:
        self._decode = decode
        self._skip = skip
        self._window: list[int] = []  # context tokens, then the unreleased ones
        self._context = 0  # how many tokens at the head of the window are context
        self._context_text = ""  # the context decoded on its own

    def push(self, token: int) -> str:
        if token in self._skip:
            return ""
        self._window.append(token)
        text = self._decode(self._window)
        if text.endswith(_REPLACEMENT):
            return self._release_complete_head(text)
        return self._release(len(self._window), text)

    def flush(self) -> str:
        """All the text still held back (an incomplete character becomes U+FFFD):
        for the stream's last token."""
        return self._release(len(self._window), self._decode(self._window))

    def _release(self, end: int, text: str) -> str:
        """Release ``window[:end]``, which decodes to ``text``; the new text."""
        if len(text) <= len(self._context_text):
            return ""  # nothing new, or a decoder that rewrote earlier text: wait for more, as vLLM does
        delta = text[len(self._context_text) :]
        del self._window[: self._context]
        self._context = end - self._context
        self._context_text = self._decode(self._window[: self._context])
        return delta

    def _release_complete_head(self, text: str) -> str:
        """A long run of tokens ending in U+FFFD (a degenerate answer: lone UTF-8
        lead bytes over and over) would otherwise make every window longer. Its
        head is final where the window splits cleanly: head and tail decoded apart
        give the text decoded together, which UTF-8 allows only when the tail's
        first byte does not continue a character the head began."""
        if len(self._window) - self._context <= _MAX_PENDING:
            return ""
        split = len(self._window) - _MAX_PENDING + 1
        head, tail = self._decode(self._window[:split]), self._decode(self._window[split:])
        if not tail or head + tail != text:  # a tail without bytes does not end the head's character
            return ""
        return self._release(split, head)
