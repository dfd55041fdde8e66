"""A model's generated text split into reasoning, content and tool calls (MiMo format).

MiMo writes its reasoning as ``<think>...</think>`` and each tool call as
``<tool_call>{"name": "fn", "arguments": {...}}</tool_call>``. The parsers here
are streaming: text arrives in arbitrary pieces (a tag may be cut anywhere), and
each ``feed`` returns what is already certain. Only text that may be the start
of a tag is held back, so content is never delayed by more than a tag's length.

The server chains them: the reasoning parser's ``content`` goes on to the tool
call parser. The non-streaming helpers run the same parsers over the whole text,
so a streamed answer always adds up to the non-streamed one.
"""

from __future__ import annotations

import json
import math
import secrets
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

__all__ = [
    "REASONING_PARSERS",
    "TOOL_CALL_PARSERS",
    "ParserKind",
    "ReasoningDelta",
    "ReasoningParser",
    "ToolCall",
    "ToolCallParser",
    "ToolDelta",
    "ToolEvent",
    "assemble_tool_calls",
    "default_parser_name",
    "new_call_id",
    "parse_tool_calls",
    "resolve_parser",
    "split_reasoning",
]

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
TOOL_OPEN = "<tool_call>"
TOOL_CLOSE = "</tool_call>"


def _held_prefix_length(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag``:
    what must wait for the next piece before it can be called plain text."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


# --- reasoning ---------------------------------------------------------------


@dataclass(frozen=True)
class ReasoningDelta:
    """New reasoning and new content text from one piece of output."""

    reasoning: str = ""
    content: str = ""

    @property
    def is_empty(self) -> bool:
        return not self.reasoning and not self.content


_ReasoningState = Literal["start", "reasoning", "after_close", "content"]


class ReasoningParser:
    """Splits streamed output at ``<think>...</think>``.

    ``thinking_open``: the generation prompt already opened ``<think>``, so the
    output starts inside the reasoning. Otherwise a ``<think>`` at the very start
    (after whitespace) still opens it; anywhere else it is plain content.
    """

    def __init__(self, thinking_open: bool) -> None:
        self._state: _ReasoningState = "reasoning" if thinking_open else "start"
        self._held = ""

    def feed(self, delta: str) -> ReasoningDelta:
        """What ``delta`` adds, given everything fed before it."""
        self._held += delta
        reasoning: list[str] = []
        content: list[str] = []
        while self._held:
            before = (self._state, len(self._held))
            self._step(reasoning, content)
            if (self._state, len(self._held)) == before:
                break  # waiting for more text
        return ReasoningDelta("".join(reasoning), "".join(content))

    def finish(self) -> ReasoningDelta:
        """The output has ended: what was held back, in the section it was in."""
        held, self._held = self._held, ""
        if self._state == "reasoning":
            return ReasoningDelta(reasoning=held)
        if self._state == "after_close":
            return ReasoningDelta()  # only the whitespace that follows </think>
        return ReasoningDelta(content=held)

    def _step(self, reasoning: list[str], content: list[str]) -> None:
        if self._state == "start":
            self._step_start(content)
        elif self._state == "reasoning":
            self._step_reasoning(reasoning)
        elif self._state == "after_close":
            self._step_after_close()
        else:
            content.append(self._held)
            self._held = ""

    def _step_start(self, content: list[str]) -> None:
        # Leading whitespace and a partial "<think>" may still become the opening tag.
        body = self._held.lstrip()
        if body.startswith(THINK_OPEN):
            self._held = body[len(THINK_OPEN):]
            self._state = "reasoning"
        elif not THINK_OPEN.startswith(body):
            content.append(self._held)
            self._held = ""
            self._state = "content"

    def _step_reasoning(self, reasoning: list[str]) -> None:
        end = self._held.find(THINK_CLOSE)
        if end >= 0:
            reasoning.append(self._held[:end])
            self._held = self._held[end + len(THINK_CLOSE):]
            self._state = "after_close"
            return
        keep = _held_prefix_length(self._held, THINK_CLOSE)
        reasoning.append(self._held[: len(self._held) - keep])
        self._held = self._held[len(self._held) - keep:]

    def _step_after_close(self) -> None:
        # MiMo and Qwen3 put "\n\n" between </think> and the answer: not content.
        self._held = self._held.lstrip()
        if self._held:
            self._state = "content"


def split_reasoning(text: str, thinking_open: bool) -> tuple[str | None, str]:
    """A whole output's reasoning (None when there is none) and its content."""
    parser = ReasoningParser(thinking_open)
    parts = [parser.feed(text), parser.finish()]
    reasoning = "".join(p.reasoning for p in parts)
    return (reasoning or None), "".join(p.content for p in parts)


# --- tool calls --------------------------------------------------------------


@dataclass(frozen=True)
class ToolDelta:
    """One streamed piece of a tool call, as OpenAI's ``delta.tool_calls[i]``: the
    first piece of a call has its ``id`` and ``name``, the next ones pieces of
    its ``arguments`` (a JSON text once joined)."""

    index: int
    id: str | None
    name: str | None
    arguments: str


@dataclass(frozen=True)
class ToolCall:
    """A complete tool call; ``arguments`` is a JSON object as text."""

    id: str
    name: str
    arguments: str


ToolEvent: TypeAlias = ToolDelta | str


def new_call_id() -> str:
    """A fresh call id in OpenAI's shape."""
    return "call_" + secrets.token_hex(12)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400: would go back out as Infinity
        raise ValueError(f"{text} is out of range")
    return value


def _load_json(text: str) -> Any:
    """JSON, or None where it is not (NaN and Infinity included: the client could not read them back)."""
    try:
        return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except (ValueError, RecursionError):
        return None


@dataclass(frozen=True)
class _CallBody:
    name: str
    arguments: str


def _read_call_body(body: str, known_names: frozenset[str] | None) -> _CallBody | None:
    """The call a block's text stands for, or None where it is not a valid one."""
    call = _load_json(body)
    if not isinstance(call, dict):
        return None
    name = call.get("name")
    if not isinstance(name, str) or not name or (known_names is not None and name not in known_names):
        return None
    # Functions without parameters are often called without "arguments" at all.
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        arguments = _load_json(arguments)
    if not isinstance(arguments, dict):
        return None
    return _CallBody(name, json.dumps(arguments, ensure_ascii=False))


class ToolCallParser:
    """Finds ``<tool_call>{...}</tool_call>`` blocks in streamed content.

    ``feed`` returns content text (``str``) and ``ToolDelta``s in output order.
    A block is held whole until it closes, then checked: a JSON object with a
    string ``name`` (one of ``known_names`` when given) and an object ``arguments``
    (or a JSON string holding one). A block that fails the check, or never
    closes, comes out as the content text it was. Whitespace right after a valid
    call (between calls, at the end) is dropped.
    """

    def __init__(
        self,
        known_names: Collection[str] | None = None,
        id_factory: Callable[[], str] = new_call_id,
    ) -> None:
        self._known = None if known_names is None else frozenset(known_names)
        self._new_id = id_factory
        self._held = ""  # text after the last decision: a partial tag, or an open block's body
        self._in_block = False
        self._after_call = False
        self.calls_made = 0  # valid calls so far: finish_reason "tool_calls" when any

    def feed(self, delta: str) -> list[ToolEvent]:
        """What ``delta`` adds, given everything fed before it."""
        self._held += delta
        events: list[ToolEvent] = []
        while self._held:
            before = (self._in_block, len(self._held))
            if self._in_block:
                self._step_block(events)
            else:
                self._step_text(events)
            if (self._in_block, len(self._held)) == before:
                break  # waiting for more text
        return events

    def finish(self) -> list[ToolEvent]:
        """The output has ended: an unclosed block, or a partial tag, is content."""
        held, self._held = self._held, ""
        if self._in_block:
            self._in_block = False
            return [TOOL_OPEN + held]
        if self._after_call:
            held = held.lstrip()
        return [held] if held else []

    def _step_text(self, events: list[ToolEvent]) -> None:
        if self._after_call:
            self._held = self._held.lstrip()
            if not self._held:
                return
        start = self._held.find(TOOL_OPEN)
        if start >= 0:
            self._emit_text(self._held[:start], events)
            self._held = self._held[start + len(TOOL_OPEN):]
            self._in_block = True
            return
        keep = _held_prefix_length(self._held, TOOL_OPEN)
        self._emit_text(self._held[: len(self._held) - keep], events)
        self._held = self._held[len(self._held) - keep:]

    def _emit_text(self, text: str, events: list[ToolEvent]) -> None:
        if text:
            events.append(text)
            self._after_call = False

    def _step_block(self, events: list[ToolEvent]) -> None:
        end = self._held.find(TOOL_CLOSE)
        if end < 0:
            return
        body = self._held[:end]
        self._held = self._held[end + len(TOOL_CLOSE):]
        self._in_block = False
        call = _read_call_body(body, self._known)
        if call is None:
            self._emit_text(TOOL_OPEN + body + TOOL_CLOSE, events)
            return
        index = self.calls_made
        self.calls_made += 1
        self._after_call = True
        events.append(ToolDelta(index=index, id=self._new_id(), name=call.name, arguments=""))
        events.append(ToolDelta(index=index, id=None, name=None, arguments=call.arguments))


def parse_tool_calls(
    text: str,
    known_names: Collection[str] | None = None,
    id_factory: Callable[[], str] = new_call_id,
) -> tuple[str, list[ToolCall]]:
    """A whole output's content (stripped; "" if none) and its valid tool calls."""
    parser = ToolCallParser(known_names, id_factory)
    events = parser.feed(text) + parser.finish()
    content = "".join(e for e in events if isinstance(e, str)).strip()
    return content, assemble_tool_calls(e for e in events if isinstance(e, ToolDelta))


def assemble_tool_calls(deltas: Iterable[ToolDelta]) -> list[ToolCall]:
    """Streamed ``ToolDelta``s joined back into whole calls, by index."""
    heads: dict[int, tuple[str, str]] = {}
    arguments: dict[int, list[str]] = {}
    for delta in deltas:
        if delta.id is not None and delta.name is not None:
            heads[delta.index] = (delta.id, delta.name)
        arguments.setdefault(delta.index, []).append(delta.arguments)
    return [ToolCall(heads[i][0], heads[i][1], "".join(arguments[i])) for i in sorted(heads)]


# --- registry ----------------------------------------------------------------

ParserKind = Literal["reasoning", "tool_call"]

REASONING_PARSERS: dict[str, type] = {"mimo": ReasoningParser}
TOOL_CALL_PARSERS: dict[str, type] = {"mimo": ToolCallParser}
_REGISTRIES: dict[str, dict[str, type]] = {"reasoning": REASONING_PARSERS, "tool_call": TOOL_CALL_PARSERS}


def default_parser_name(model_type: str | None) -> str | None:
    """The parser a checkpoint's ``model_type`` (config.json) calls for, if any."""
    if model_type and "mimo" in model_type.lower():
        return "mimo"
    return None


def resolve_parser(kind: str, name: str | None, model_type: str | None) -> type | None:
    """The parser class for ``kind`` ("reasoning" or "tool_call"): ``name`` as the
    operator chose it ("none" for no parsing), or the checkpoint's default when None."""
    registry = _REGISTRIES.get(kind)
    if registry is None:
        raise ValueError(f"unknown parser kind {kind!r}; known: {', '.join(sorted(_REGISTRIES))}")
    if name is None:
        name = default_parser_name(model_type)
        return None if name is None else registry.get(name)
    if name == "none":
        return None
    if name not in registry:
        known = ", ".join([*sorted(registry), "none"])
        raise ValueError(f"unknown {kind} parser {name!r}; known: {known}")
    return registry[name]
