"""Constrained decoding: a request's grammar as token masks, with llguidance.

A ``GrammarSpec`` names what the output must be (a JSON schema, any JSON
object, a Lark grammar, a regular expression); it is plain data, so it
travels between processes and is checked again where it is compiled.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

__all__ = [
    "GRAMMAR_KINDS", "JSON_LAYOUT", "GrammarCompiler", "GrammarKind", "GrammarMatcher", "GrammarSpec",
    "MAX_GRAMMAR_CHARS", "allows", "grammar_text",
]

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
    # Non-empty: the output first runs free up to and including this text (a
    # reasoning section's end, "</think>"), and the grammar holds after it.
    after: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}, got {self.kind!r}")
        if not isinstance(self.source, str):
            raise ValueError("a grammar's source must be a string")
        if len(self.source) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"a grammar of {len(self.source)} characters is too long (at most {MAX_GRAMMAR_CHARS})")
        if self.kind != "json_object" and not self.source:
            raise ValueError(f"a {self.kind} grammar needs its source")
        if not isinstance(self.after, str) or len(self.after) > 64:
            raise ValueError("a grammar's 'after' text must be a string of at most 64 characters")


def _byte_level_bytes() -> dict[str, int]:
    """GPT-2's byte-level alphabet, read backwards: the byte each character of a
    byte-level BPE vocabulary stands for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


def _uses_byte_level(component: Any) -> bool:
    if not isinstance(component, dict):
        return False
    return component.get("type") == "ByteLevel" or any(_uses_byte_level(c) for c in component.get("decoders", []))


_TOKENIZED_CACHE = 1 << 16  # texts kept tokenized per tokenizer: a schema's forced strings are few


class _GrammarTokenizer:
    """What llguidance needs of the tokenizer: each token's bytes, which are
    special, and the tokenization of a text (``__call__``). Built here rather
    than by llguidance from tokenizer.json, which reads every added token as
    special: a non-special one (Qwen's and MiMo's ``<tool_call>``, ``<think>``)
    is text the model writes, which a grammar's literal "<tool_call>" must
    accept, as one token or spelled out."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: tuple[int, ...]) -> None:
        from tokenizers import Tokenizer

        data = json.loads(tokenizer_json)
        self._hf = Tokenizer.from_str(tokenizer_json)
        self._tokenized: dict[bytes | str, list[int]] = {}
        self.eos_token_id = eos_ids[0]
        self.bos_token_id = None
        added = {t["id"]: t for t in data.get("added_tokens", [])}
        self.special_token_ids = sorted(i for i, t in added.items() if t.get("special", True))
        byte_level = _uses_byte_level(data.get("decoder"))
        to_byte = _byte_level_bytes() if byte_level else {}
        self.tokens: list[bytes] = []
        for i in range(vocab_size):
            piece = self._hf.id_to_token(i)
            if i in added:
                self.tokens.append(added[i]["content"].encode())
            elif piece is None:
                self.tokens.append(b"")  # an id the model has and the tokenizer never makes
            elif byte_level and all(c in to_byte for c in piece):
                self.tokens.append(bytes(to_byte[c] for c in piece))
            else:
                self.tokens.append(self._hf.decode([i], skip_special_tokens=False).encode())

    def __call__(self, text: bytes | str) -> list[int]:
        # llguidance asks for the same forced texts (a schema's keys, separators)
        # at every step of every request: tokenize each once.
        ids = self._tokenized.get(text)
        if ids is None:
            decoded = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
            ids = self._hf.encode(decoded, add_special_tokens=False).ids
            if len(self._tokenized) < _TOKENIZED_CACHE:
                self._tokenized[text] = ids
        return list(ids)


class GrammarCompiler:
    """Grammars for one tokenizer: checks and compiles ``GrammarSpec``s and
    makes a matcher per request. The llguidance tokenizer (a pass over the
    vocabulary) is built on first use, so servers that never see a grammar do
    not pay for it."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: tuple[int, ...]) -> None:
        if not eos_ids:
            raise ValueError("constrained decoding needs the model's end-of-sequence token")
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self._tokenizer: Any = None
        self._texts: dict[GrammarSpec, str] = {}

    @classmethod
    def from_file(cls, path: str | Path, vocab_size: int, eos_ids: tuple[int, ...]) -> GrammarCompiler:
        return cls(Path(path).read_text(), vocab_size, eos_ids)

    @property
    def words(self) -> int:
        """int32 words of one row of a token bitmask."""
        return (self.vocab_size + 31) // 32

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            import llguidance

            wrapped = llguidance.TokenizerWrapper(_GrammarTokenizer(self._tokenizer_json, self.vocab_size,
                                                                     self.eos_ids))
            self._tokenizer = llguidance.LLTokenizer(wrapped, n_vocab=self.vocab_size, eos_token=list(self.eos_ids))
        return self._tokenizer

    def compile(self, spec: GrammarSpec) -> str:
        """llguidance's grammar text for ``spec``; ValueError, with the
        library's reason, when it is not a grammar this tokenizer can follow."""
        text = self._texts.get(spec)
        if text is not None:
            return text
        import llguidance

        try:
            text = grammar_text(spec)
        except (ValueError, TypeError, RuntimeError) as exc:
            raise ValueError(f"the {spec.kind} grammar is invalid: {exc}") from None
        error = llguidance.LLMatcher.validate_grammar(text, self.tokenizer)
        if error:
            raise ValueError(f"the {spec.kind} grammar is invalid: {error}")
        if len(self._texts) >= _MAX_CACHED_GRAMMARS:
            self._texts.pop(next(iter(self._texts)))
        self._texts[spec] = text
        return text

    def matcher(self, spec: GrammarSpec) -> GrammarMatcher:
        import llguidance

        # log_level 0: a refused token is reported through is_error(), not printed.
        matcher = llguidance.LLMatcher(self.tokenizer, self.compile(spec), log_level=0)
        if matcher.is_error():
            raise ValueError(f"the {spec.kind} grammar is invalid: {matcher.get_error()}")
        return GrammarMatcher(matcher)


_MAX_CACHED_GRAMMARS = 256


# JSON as json.dumps writes it ({"a": 1, "b": [2, 3]}): free whitespace lets a
# sampled model wander through tabs and newlines the schema never meant.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_text(spec: GrammarSpec) -> str:
    """The grammar llguidance compiles for ``spec`` (ValueError where the source is not one)."""
    import llguidance

    if spec.after:
        return llguidance.LLMatcher.grammar_from_lark(_after_free_text(spec))

    if spec.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
    if spec.kind == "json_schema":
        try:
            schema = json.loads(spec.source)
        except json.JSONDecodeError as exc:
            raise ValueError(f"the schema is not JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError("a JSON schema must be an object")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
    if spec.kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(spec.source)
    return llguidance.LLMatcher.grammar_from_regex(spec.source)


def _after_free_text(spec: GrammarSpec) -> str:
    """A Lark grammar: free text up to ``spec.after`` (taken too), optional
    newlines, then ``spec``'s own grammar."""
    import llguidance

    if spec.kind == "json_object":
        body = f"swallow_body: %json {json.dumps({'type': 'object', 'x-guidance': JSON_LAYOUT})}\n"
    elif spec.kind == "json_schema":
        schema = json.loads(spec.source)
        if isinstance(schema, dict):
            schema = {**schema, "x-guidance": {**JSON_LAYOUT, **schema.get("x-guidance", {})}}
        body = f"swallow_body: %json {json.dumps(schema)}\n"
    elif spec.kind == "regex":
        body = f"swallow_body: /{llguidance.regex_to_lark(spec.source)}/\n"
    else:  # its start rule becomes ours to follow the free text
        body = re.sub(r"^(\s*)start(?=\s*(\[[^\]]*\])?\s*:)", r"\1swallow_body", spec.source, flags=re.MULTILINE)
    return (f'start: swallow_free "\\n"* swallow_body\n'
            f"swallow_free[suffix={json.dumps(spec.after)}]: /(.|\\n)*/\n{body}")


class GrammarMatcher:
    """One request's position in its grammar: the tokens it may take next, as
    a bitmask row (bit t of word t // 32 set: token t allowed)."""

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def fill_mask(self, row: np.ndarray) -> None:
        """Write the allowed-next-token bitmask into ``row`` (int32, contiguous)."""
        self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def consume(self, token: int) -> bool:
        """Advance by ``token``; False (and the matcher in error) if the grammar refuses it."""
        return bool(self._matcher.consume_token(token))

    def take_draft(self, row: np.ndarray, token: int, ends: Collection[int]) -> tuple[bool, bool]:
        """A draft token against ``row``, the mask filled just before it:
        (allowed, taken). An allowed end-of-sequence token is not taken (it
        leaves no token to roll back); a taken one may complete the grammar."""
        if not allows(row, token):
            return False, False
        if token in ends:
            return True, False
        return True, self.consume(token)

    def rollback(self, count: int) -> None:
        """Undo the last ``count`` tokens taken (an end-of-sequence token that
        stopped the grammar is not one of them: it leaves no token behind)."""
        if count:
            self._matcher.rollback(count)

    @property
    def stopped(self) -> bool:
        """The grammar is complete and its end was taken: the output is whole."""
        return bool(self._matcher.is_stopped())

    @property
    def error(self) -> str:
        return str(self._matcher.get_error())


def allows(row: np.ndarray, token: int) -> bool:
    """Whether a bitmask row lets ``token`` through."""
    return bool((int(row[token >> 5]) >> (token & 31)) & 1)
