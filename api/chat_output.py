"""One choice's generated tokens as OpenAI's chat message or stream deltas.

Text goes through the reasoning parser (``<think>`` ... ``</think>`` to
``reasoning_content``), what is left through the tool-call parser (``<tool_call>``
blocks to ``tool_calls``); the rest is ``content``. Streaming and non-streaming
answers come from the same pass, so they always agree. Log-probabilities are
formatted as OpenAI's ``logprobs.content`` entries.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from api.streams import StreamEvent
from api.output_parsers import ReasoningDelta, ToolDelta

__all__ = ["ChoiceOutput", "OutputOptions", "TokenText"]

TokenText = Callable[[int], str]  # a token id's own text, special tokens included


@dataclass(frozen=True)
class OutputOptions:
    reasoning_parser: type | None = None  # a ReasoningParser class, or None: no reasoning split
    thinking_open: bool = False  # the prompt opened <think>: output starts inside reasoning
    tool_parser: type | None = None  # a ToolCallParser class, or None: tool calls are content
    tool_names: frozenset[str] = frozenset()
    top_logprobs: int | None = None  # None: no logprobs; k: each token's and its top k


@dataclass
class ChoiceDelta:
    """What one step adds to a choice: OpenAI's ``delta`` fields and logprob entries."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.reasoning or self.content or self.tool_calls or self.logprobs)

    def as_delta(self) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if self.reasoning:
            delta["reasoning_content"] = self.reasoning
        if self.content:
            delta["content"] = self.content
        if self.tool_calls:
            delta["tool_calls"] = self.tool_calls
        return delta


class ChoiceOutput:
    """Feed a choice's stream events in order, then ``finish``; ``message()``
    is the whole answer, each feed's return what a stream sends for it."""

    def __init__(self, options: OutputOptions, token_text: TokenText) -> None:
        self.options = options
        self._token_text = token_text
        self._reasoning_parser = options.reasoning_parser(options.thinking_open) if options.reasoning_parser else None
        self._tool_parser = options.tool_parser(options.tool_names) if options.tool_parser else None
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._calls: dict[int, dict[str, Any]] = {}
        self._logprobs: list[dict[str, Any]] = []
        self.num_tokens = 0
        self.cached_tokens: int | None = None

    def feed(self, event: StreamEvent) -> ChoiceDelta:
        self.num_tokens += 1
        if event.cached_tokens is not None:
            self.cached_tokens = event.cached_tokens
        out = self._text(event.text, final=event.finish_reason is not None)
        if self.options.top_logprobs is not None and event.logprob is not None:
            out.logprobs.append(self._logprob_entry(event))
        self._keep(out)
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's: a stop that made tool calls is "tool_calls"."""
        if reason == "stop" and self._tool_parser is not None and self._tool_parser.calls_made:
            return "tool_calls"
        return reason

    def message(self) -> dict[str, Any]:
        content = "".join(self._content)
        calls = [self._calls[i] for i in sorted(self._calls)]
        message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
        if self._reasoning_parser is not None:
            message["reasoning_content"] = "".join(self._reasoning) or None
        if calls:
            message["tool_calls"] = calls
        return message

    def logprobs(self) -> dict[str, Any] | None:
        return {"content": self._logprobs} if self.options.top_logprobs is not None else None

    # -- text -------------------------------------------------------------------

    def _text(self, text: str, final: bool) -> ChoiceDelta:
        out = ChoiceDelta()
        parsed = self._reasoning_parser.feed(text) if self._reasoning_parser else ReasoningDelta(content=text)
        if final and self._reasoning_parser is not None:
            rest = self._reasoning_parser.finish()
            parsed = ReasoningDelta(parsed.reasoning + rest.reasoning, parsed.content + rest.content)
        out.reasoning = parsed.reasoning
        if self._tool_parser is None:
            out.content = parsed.content
            return out
        events = self._tool_parser.feed(parsed.content) if parsed.content else []
        if final:
            events += self._tool_parser.finish()
        for item in events:
            if isinstance(item, str):
                out.content += item
            else:
                out.tool_calls.append(_tool_delta(item))
        return out

    def _keep(self, out: ChoiceDelta) -> None:
        self._reasoning.append(out.reasoning)
        self._content.append(out.content)
        for delta in out.tool_calls:
            call = self._calls.setdefault(delta["index"], {"id": "", "type": "function",
                                                          "function": {"name": "", "arguments": ""}})
            if "id" in delta:
                call["id"] = delta["id"]
            function = delta.get("function", {})
            call["function"]["name"] += function.get("name", "")
            call["function"]["arguments"] += function.get("arguments", "")
        self._logprobs += out.logprobs

    # -- logprobs ---------------------------------------------------------------

    def _logprob_entry(self, event: StreamEvent) -> dict[str, Any]:
        entry = self._token_entry(event.token, event.logprob)
        entry["top_logprobs"] = [self._token_entry(t, lp) for t, lp in event.top_logprobs[: self.options.top_logprobs]]
        return entry

    def _token_entry(self, token: int, logprob: float | None) -> dict[str, Any]:
        text = self._token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def _tool_delta(delta: ToolDelta) -> dict[str, Any]:
    """OpenAI's streamed ``tool_calls`` item: the first of a call names it."""
    if delta.id is not None:
        return {"index": delta.index, "id": delta.id, "type": "function",
                "function": {"name": delta.name or "", "arguments": delta.arguments}}
    return {"index": delta.index, "function": {"arguments": delta.arguments}}
