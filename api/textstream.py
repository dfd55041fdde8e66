"""Tokens to text deltas for streaming, with stop strings.

Each token costs the same however long the answer already is: the decoder
decodes a short window of tokens (``llm_core.model.tokenizer.StreamDecoder``) and stop
strings are searched only in the new text plus what was held back before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class TokenDecoder(Protocol):
    def push(self, token: int) -> str:
        """The text this token completes ("" while a character is incomplete)."""

    def flush(self) -> str:
        """Whatever is still held back, the stream having ended."""


def truncate_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """Text up to the first stop string, and whether one was found."""
    cut = min((i for s in stops if (i := text.find(s)) >= 0), default=-1)
    return (text, False) if cut < 0 else (text[:cut], True)


class TextStream:
    """Feed tokens; get the new text since the last call. ``stopped`` turns true
    when a stop string appears; the text is cut before the earliest one, as
    ``truncate_at_stop`` cuts the whole text.

    Text that a stop string begins with is held back until it is known not to be
    that stop (OpenAI never sends any of the stop sequence; vLLM holds back the
    last ``max(len(stop)) - 1`` characters for the same reason). Holding only an
    end that really starts a stop sends the rest at once. So the deltas always add
    up to the text a non-streamed answer gets, even when a stop spans two tokens.
    """

    def __init__(self, decoder: TokenDecoder, stops: Sequence[str] = ()) -> None:
        self._decoder = decoder
        self._stops = tuple(stops)
        self._starts = frozenset(s[0] for s in self._stops if s)
        self._longest = max(map(len, self._stops), default=0)
        self._held = ""  # decoded, not sent: it may be the start of a stop string
        self.stopped = False

    def push(self, token: int, final: bool = False) -> str:
        """The text to send for this token; ``final`` for the answer's last token."""
        if self.stopped:
            return ""
        text = self._decoder.push(token)
        if final:
            text += self._decoder.flush()
        return self._cut(text, final) if self._stops else text

    def _cut(self, new: str, final: bool) -> str:
        # No stop was complete before this token, so a stop that is complete now
        # ends in ``new`` and starts in the held text or in ``new``: searching both
        # finds the earliest one of the whole text.
        text = self._held + new
        sent, self.stopped = truncate_at_stop(text, self._stops)
        keep = 0 if self.stopped or final else self._stop_prefix_length(text)
        self._held = text[len(text) - keep :]
        return sent[: len(sent) - keep]

    def _stop_prefix_length(self, text: str) -> int:
        """The length of the longest end of ``text`` that some stop string starts with."""
        for start in range(max(0, len(text) - self._longest + 1), len(text)):
            if text[start] in self._starts and any(s.startswith(text[start:]) for s in self._stops):
                return len(text) - start
        return 0
