"""Tokens to text deltas for streaming, with stop strings."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

# Incomplete UTF-8 sequences decode to this; such text is held back while streaming.
_REPLACEMENT = "\ufffd"


def truncate_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """Text up to the first stop string, and whether one was found."""
    cut = min((i for s in stops if (i := text.find(s)) >= 0), default=-1)
    return (text, False) if cut < 0 else (text[:cut], True)


@dataclass
class TextStream:
    """Feed tokens; get the new text since the last call (empty while a multi-byte
    character is incomplete). ``stopped`` turns true when a stop string appears;
    the text is cut before it."""

    decode: Callable[[list[int]], str]
    stops: Sequence[str] = ()
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    stopped: bool = False

    def push(self, token: int, final: bool = False) -> str:
        self.tokens.append(token)
        text, self.stopped = truncate_at_stop(self.decode(self.tokens), self.stops)
        if not self.stopped and not final and text.endswith(_REPLACEMENT):
            return ""
        delta, self.text = text[len(self.text) :], text
        return delta
