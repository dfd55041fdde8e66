"""Constrained decoding: a request's grammar as token masks, with llguidance.

A ``GrammarSpec`` names what the output must be (a JSON schema, any JSON
object, a Lark grammar, a regular expression); it is plain data, so it
travels between processes and is checked again where it is compiled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["GRAMMAR_KINDS", "GrammarKind", "GrammarSpec", "MAX_GRAMMAR_CHARS"]

GrammarKind = Literal["json_schema", "json_object", "lark", "regex"]
GRAMMAR_KINDS: tuple[str, ...] = ("json_schema", "json_object", "lark", "regex")
# A schema or grammar far beyond any real one would only cost the compiler time.
MAX_GRAMMAR_CHARS = 1 << 20


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match. ``source``: the JSON schema as JSON
    text (``json_schema``), the Lark grammar (``lark``, llguidance's dialect,
    ``%json {...}`` allowed), the regular expression (``regex``); ignored for
    ``json_object``."""

    kind: GrammarKind
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}, got {self.kind!r}")
        if not isinstance(self.source, str):
            raise ValueError("a grammar's source must be a string")
        if len(self.source) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"a grammar of {len(self.source)} characters is too long (at most {MAX_GRAMMAR_CHARS})")
        if self.kind != "json_object" and not self.source:
            raise ValueError(f"a {self.kind} grammar needs its source")
