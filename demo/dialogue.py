"""The demo model's conversations: its chat template, and the ways a world sample
is asked (with or without the video tool, with or without thinking, before or after
the tool's result), each with the exact output the model is trained to give.

Training (``demo.train``) and evaluation (``demo.evaluate``) both build
their conversations here, so what the model learns is what the eval asks.

The template is ChatML with Qwen2-VL-style media markers (``llm_core.model.chat``'s
default) plus what Qwen3 / MiMo templates add: a tools system block, assistant
tool calls, tool results as a user-side turn, and ``<think>`` opening the answer in
thinking mode. Without tools, tool messages or thinking it renders exactly what the
default template renders, so prompts (and prefix-cache keys) stay as they were.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from demo.tasks import reasoning
from demo.tool_spec import (
    NO_TOOL_ANSWER,
    VIDEO_INFO_TOOL,
    VIDEO_TOOL_NAME,
    question_property,
    tool_exchange,
)
from demo.world import Sample

__all__ = [
    "ADDED_TOKENS",
    "DEMO_CHAT_TEMPLATE",
    "THINK_CLOSE",
    "THINK_OPEN",
    "Conversation",
    "Mode",
    "ToolCall",
    "conversation",
    "parse_tool_calls",
    "split_reasoning",
    "tool_call_message",
]

THINK_OPEN = "<think>\n"  # ends the generation prompt in thinking mode
THINK_CLOSE = "</think>\n\n"  # the model writes this between its reasoning and its answer
# Single tokens, as in Qwen3's and MiMo's tokenizers: the markers the server's parsers
# look for are then one generated token each. Not special: decoding keeps their text.
ADDED_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>",
                "<tool_response>", "</tool_response>", "<tools>", "</tools>")

# The source is one line of Jinja (the environment trims newlines after block tags, so
# every newline the prompt needs is an explicit '\n' expression).
_NL = "{{ '\\n' }}"
_CONTENT_MACRO = (
    # A message's content: a string, or parts (text and one placeholder per media item).
    "{% macro render_content(content) %}"
    "{% if content is string %}{{ content }}"
    "{% elif content %}{% for part in content %}"
    "{% if part.type == 'text' %}{{ part.text }}"
    "{% elif part.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part.type == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part.type == 'audio' %}<|audio_start|><|audio_pad|><|audio_end|>"
    "{% endif %}{% endfor %}{% endif %}"
    "{% endmacro %}"
)
_TOOLS_BLOCK = (
    # One system turn: the caller's system message (if it comes first) and the tools.
    "{% if tools %}<|im_start|>system" + _NL
    + "{% if messages and messages[0].role == 'system' %}{{ render_content(messages[0].content) }}"
    + _NL + _NL + "{% endif %}"
    + "# Tools" + _NL + _NL
    + "You may call the functions below; their signatures are between <tools></tools>:" + _NL
    + "<tools>" + _NL + "{% for tool in tools %}{{ tool | tojson }}" + _NL + "{% endfor %}</tools>" + _NL + _NL
    + 'To call a function, answer with <tool_call>{"name": <function name>, "arguments": <JSON object>}'
    + "</tool_call><|im_end|>" + _NL + "{% endif %}"
)
_TOOL_RESULT = (
    # Consecutive tool messages share one user-side turn.
    "{% if loop.first or loop.previtem.role != 'tool' %}<|im_start|>user" + _NL + "{% else %}" + _NL + "{% endif %}"
    + "<tool_response>" + _NL + "{{ render_content(message.content) }}" + _NL + "</tool_response>"
    + "{% if loop.last or loop.nextitem.role != 'tool' %}<|im_end|>" + _NL + "{% endif %}"
)
_TOOL_CALLS = (
    # After the content, one block per call. Arguments arrive as a JSON string (OpenAI)
    # and are emitted as they are (Jinja cannot parse JSON), or as an object.
    "{% if message.role == 'assistant' and message.tool_calls %}{% for call in message.tool_calls %}"
    "{% set fn = call.function if call.function is defined else call %}"
    "{% if not loop.first or message.content %}" + _NL + "{% endif %}"
    '<tool_call>{"name": {{ fn.name | tojson }}, "arguments": '
    "{% if fn.arguments is string %}{{ fn.arguments or '{}' }}{% else %}{{ fn.arguments | tojson }}{% endif %}"
    "}</tool_call>{% endfor %}{% endif %}"
)
_MESSAGE = (
    "<|im_start|>{{ message.role }}" + _NL
    # An earlier answer's reasoning is not shown again, even if the client left it in.
    + "{% if message.role == 'assistant' and message.content is string and '</think>' in message.content %}"
    + "{{ message.content.split('</think>')[-1].lstrip('\\n') }}"
    + "{% else %}{{ render_content(message.content) }}{% endif %}"
    + _TOOL_CALLS + "<|im_end|>" + _NL
)
DEMO_CHAT_TEMPLATE = (
    _CONTENT_MACRO + _TOOLS_BLOCK
    + "{% for message in messages %}"
    + "{% if loop.first and message.role == 'system' and tools %}"  # already in the tools block
    + "{% elif message.role == 'tool' %}" + _TOOL_RESULT
    + "{% else %}" + _MESSAGE + "{% endif %}"
    + "{% endfor %}"
    + "{% if add_generation_prompt %}<|im_start|>assistant" + _NL
    + "{% if enable_thinking %}<think>" + _NL + "{% endif %}{% endif %}"
)


@dataclass(frozen=True)
class Mode:
    """How a sample is asked."""

    tools: bool = False  # the request lists the video tool
    thinking: bool = False  # enable_thinking: the model reasons, then answers
    tool_result: bool = False  # video_info only: the call was made and its result follows

    def __post_init__(self) -> None:
        if self.tool_result and not self.tools:
            raise ValueError("a tool result needs the tools in the request")

    def label(self, task: str) -> str:
        """The name a task's score goes by in this mode (the plain mode: the task's)."""
        if task == "video_info":
            base = "tool_reply" if self.tool_result else "tool_call" if self.tools else "tool_absent"
        else:
            base = f"{task}+tools" if self.tools else task
        return base + "+think" if self.thinking else base


@dataclass(frozen=True)
class Conversation:
    """A sample's turns after the user's question, and the answer expected."""

    follow_up: tuple[dict[str, Any], ...]  # the assistant's call and the tool's result, or nothing
    variables: dict[str, Any]  # for ChatTemplate.render: tools, enable_thinking
    reasoning: str | None  # thinking mode's reasoning
    content: str  # the answer, or the tool call

    @property
    def output(self) -> str:
        """Everything the model writes, before its end token."""
        return self.content if self.reasoning is None else self.reasoning + THINK_CLOSE + self.content


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


def tool_call_message(call: ToolCall, call_id: str = "call_0", compact: bool = False) -> dict[str, Any]:
    """The assistant message a client sends back after a call (OpenAI's shape, the
    arguments a JSON string: spaced as ``json.dumps`` writes them, or compact)."""
    separators = (",", ":") if compact else (", ", ": ")
    arguments = json.dumps(call.arguments, separators=separators)
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": call_id, "type": "function", "function": {"name": call.name, "arguments": arguments}}]}


def conversation(sample: Sample, mode: Mode, *, call: ToolCall | None = None, compact: bool = False) -> Conversation:
    """The turns and expected answer of ``sample`` asked in ``mode``. After a tool
    result, ``call`` is the call the model made (default: the right one), answered
    with the tool's result for the property it asked for."""
    if mode.tool_result and sample.task != "video_info":
        raise ValueError("only video_info questions have a tool result")
    follow_up: tuple[dict[str, Any], ...] = ()
    if sample.task != "video_info":
        content = sample.answer
    elif mode.tool_result:
        prop = question_property(sample.question)
        call = call or ToolCall(VIDEO_TOOL_NAME, {"property": prop})
        exchange = tool_exchange(sample.scene, str(call.arguments.get("property", prop)))
        follow_up = (tool_call_message(call, compact=compact),
                     {"role": "tool", "tool_call_id": "call_0", "content": exchange.result})
        content = exchange.reply
    else:
        content = sample.answer if mode.tools else NO_TOOL_ANSWER
    variables: dict[str, Any] = {}
    if mode.tools:
        variables["tools"] = [VIDEO_INFO_TOOL]
    if mode.thinking:
        variables["enable_thinking"] = True
    thought = reasoning(sample, tools=mode.tools, tool_result=mode.tool_result) if mode.thinking else None
    return Conversation(follow_up, variables, thought, content)


def split_reasoning(text: str, thinking: bool) -> tuple[str | None, str]:
    """(reasoning, answer) of a generated text, as the server's parser splits it: in
    thinking mode everything up to ``</think>`` is reasoning (all of it, if the
    model never closed it)."""
    if not thinking:
        return None, text.strip()
    thought, closed, rest = text.partition("</think>")
    return thought.strip(), rest.strip() if closed else ""


_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_tool_calls(content: str) -> list[ToolCall]:
    """The well-formed calls in an answer: JSON objects with exactly "name" (a string)
    then "arguments" (an object). Malformed blocks are left out."""
    calls = []
    for body in _CALL.findall(content):
        try:
            parsed = json.loads(body)
        except json.JSONDecodeError:
            continue
        if (isinstance(parsed, Mapping) and list(parsed) == ["name", "arguments"]
                and isinstance(parsed["name"], str) and isinstance(parsed["arguments"], Mapping)):
            calls.append(ToolCall(parsed["name"], dict(parsed["arguments"])))
    return calls

