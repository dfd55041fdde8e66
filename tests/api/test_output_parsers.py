"""Reasoning and tool call parsing of MiMo output, streamed in every possible way."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator, Sequence

import pytest

from api.output_parsers import (
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    ReasoningDelta,
    ReasoningParser,
    ToolCall,
    ToolCallParser,
    ToolDelta,
    ToolEvent,
    assemble_tool_calls,
    default_parser_name,
    new_call_id,
    parse_tool_calls,
    resolve_parser,
    split_reasoning,
)

REALISTIC = (
    "<think>\nThe user wants the weather in 東京 and a pun 🌧️.\nI should call get_weather.\n</think>\n\n"
    "Let me check that for you.\n\n"
    '<tool_call>{"name": "get_weather", "arguments": {"city": "東京", "note": "☔ 雨"}}</tool_call>\n'
    '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"Asia/Tokyo\\"}"}</tool_call>'
)
KNOWN = ("get_weather", "get_time")


def counting_ids() -> Callable[[], str]:
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def splits(text: str) -> Iterator[list[str]]:
    """The text cut in two at every point, then in three at every pair of points."""
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    for i in range(0, len(text) + 1, 7):
        for j in range(i, len(text) + 1, 3):
            yield [text[:i], text[i:j], text[j:]]


def stream_reasoning(pieces: Sequence[str], thinking_open: bool) -> tuple[str | None, str]:
    parser = ReasoningParser(thinking_open)
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    reasoning = "".join(d.reasoning for d in deltas)
    return reasoning or None, "".join(d.content for d in deltas)


def stream_tools(pieces: Sequence[str], known: Sequence[str] | None = None) -> tuple[str, list[ToolCall]]:
    parser = ToolCallParser(known, counting_ids())
    events: list[ToolEvent] = []
    for piece in pieces:
        events += parser.feed(piece)
    events += parser.finish()
    content = "".join(e for e in events if isinstance(e, str))
    return content, assemble_tool_calls(e for e in events if isinstance(e, ToolDelta))


# --- reasoning ---------------------------------------------------------------


def test_split_reasoning_of_a_realistic_output() -> None:
    reasoning, content = split_reasoning(REALISTIC, thinking_open=False)
    assert reasoning == "\nThe user wants the weather in 東京 and a pun 🌧️.\nI should call get_weather.\n"
    assert content.startswith("Let me check that for you.\n\n<tool_call>")
    assert content.endswith("</tool_call>")


@pytest.mark.parametrize("thinking_open", [False, True])
def test_reasoning_streamed_at_every_split_equals_the_whole(thinking_open: bool) -> None:
    text = REALISTIC[len("<think>"):] if thinking_open else REALISTIC
    expected = split_reasoning(text, thinking_open)
    for pieces in splits(text):
        assert stream_reasoning(pieces, thinking_open) == expected, pieces


def test_think_tag_split_across_chunks() -> None:
    parser = ReasoningParser(thinking_open=False)
    assert parser.feed("<th") == ReasoningDelta()
    assert parser.feed("ink>hmm") == ReasoningDelta(reasoning="hmm")
    assert parser.feed("</thi") == ReasoningDelta()
    assert parser.feed("nk>\n\nAnswer") == ReasoningDelta(content="Answer")
    assert parser.finish() == ReasoningDelta()


def test_only_a_possible_closing_tag_is_held_back() -> None:
    parser = ReasoningParser(thinking_open=True)
    assert parser.feed("a < b and </") == ReasoningDelta(reasoning="a < b and ")
    assert parser.feed("div>") == ReasoningDelta(reasoning="</div>")


def test_thinking_open_starts_inside_the_reasoning() -> None:
    assert split_reasoning("plan</think>\n\nhi", thinking_open=True) == ("plan", "hi")
    # Without an opened <think>, a closing tag is plain content.
    assert split_reasoning("plan</think>\n\nhi", thinking_open=False) == (None, "plan</think>\n\nhi")


def test_think_opens_only_at_the_start_after_whitespace() -> None:
    assert split_reasoning(" \n<think>x</think>y", thinking_open=False) == ("x", "y")
    assert split_reasoning("so <think>x</think>y", thinking_open=False) == (None, "so <think>x</think>y")


def test_reasoning_never_closed_is_reasoning() -> None:
    assert split_reasoning("<think>still going", thinking_open=False) == ("still going", "")
    parser = ReasoningParser(thinking_open=True)
    assert parser.feed("still going </thi") == ReasoningDelta(reasoning="still going ")
    assert parser.finish() == ReasoningDelta(reasoning="</thi")


def test_look_alike_tags_pass_through_as_content() -> None:
    parser = ReasoningParser(thinking_open=False)
    assert parser.feed("<thi") == ReasoningDelta()
    assert parser.feed("nking is fun") == ReasoningDelta(content="<thinking is fun")
    assert split_reasoning("<thinking is fun", thinking_open=False) == (None, "<thinking is fun")


def test_a_partial_tag_at_the_end_is_content() -> None:
    assert split_reasoning("  <thin", thinking_open=False) == (None, "  <thin")
    assert split_reasoning("", thinking_open=False) == (None, "")


def test_only_whitespace_after_think_close_is_dropped() -> None:
    assert split_reasoning("<think>r</think>\n\n  a\n\nb\n", thinking_open=False) == ("r", "a\n\nb\n")
    assert split_reasoning("<think>r</think>\n\n", thinking_open=False) == ("r", "")


# --- tool calls --------------------------------------------------------------


def test_several_calls_after_content() -> None:
    _, after_think = split_reasoning(REALISTIC, thinking_open=False)
    content, calls = parse_tool_calls(after_think, KNOWN, counting_ids())
    assert content == "Let me check that for you."
    assert calls == [
        ToolCall("call_0", "get_weather", '{"city": "東京", "note": "☔ 雨"}'),
        ToolCall("call_1", "get_time", '{"tz": "Asia/Tokyo"}'),
    ]


def test_tool_calls_streamed_at_every_split_equal_the_whole() -> None:
    _, text = split_reasoning(REALISTIC, thinking_open=False)
    text += "\nDone 🎉 <tool_call>{broken</tool_call> <tool"
    expected = parse_tool_calls(text, KNOWN, counting_ids())
    assert len(expected[1]) == 2
    for pieces in splits(text):
        content, calls = stream_tools(pieces, KNOWN)
        assert (content.strip(), calls) == expected, pieces


def test_whole_pipeline_streamed_character_by_character() -> None:
    reasoning_parser = ReasoningParser(thinking_open=False)
    tool_parser = ToolCallParser(KNOWN, counting_ids())
    reasoning: list[str] = []
    events: list[ToolEvent] = []
    for char in REALISTIC:
        delta = reasoning_parser.feed(char)
        reasoning.append(delta.reasoning)
        events += tool_parser.feed(delta.content)
    last = reasoning_parser.finish()
    events += tool_parser.feed(last.content) + tool_parser.finish()
    assert "".join(reasoning) == split_reasoning(REALISTIC, False)[0]
    assert [e for e in events if isinstance(e, str)] == list("Let me check that for you.\n\n")
    deltas = [e for e in events if isinstance(e, ToolDelta)]
    assert deltas[0] == ToolDelta(0, "call_0", "get_weather", "")
    assert all(d.id is None and d.name is None for d in deltas[1:2])
    assert [c.name for c in assemble_tool_calls(deltas)] == ["get_weather", "get_time"]


def test_the_first_delta_of_a_call_has_id_and_name_then_arguments() -> None:
    parser = ToolCallParser(id_factory=counting_ids())
    events = parser.feed('<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>')
    assert events == [ToolDelta(0, "call_0", "f", ""), ToolDelta(0, None, None, '{"a": 1}')]


def test_malformed_json_is_content() -> None:
    text = 'Hi <tool_call>{"name": "get_time", "arguments": {</tool_call>'
    assert parse_tool_calls(text, KNOWN) == (text, [])


@pytest.mark.parametrize(
    "body",
    [
        '{"arguments": {}}',
        '{"name": 3, "arguments": {}}',
        '{"name": "", "arguments": {}}',
        '{"name": "f", "arguments": [1]}',
        '{"name": "f", "arguments": "not json"}',
        '{"name": "f", "arguments": "[1]"}',
        '{"name": "f", "arguments": {"x": NaN}}',
        '{"name": "f", "arguments": {"x": 1e400}}',
        '["f"]',
        "",
    ],
)
def test_invalid_calls_are_content(body: str) -> None:
    text = f"<tool_call>{body}</tool_call>"
    assert parse_tool_calls(text) == (text, [])


def test_unknown_function_is_content() -> None:
    text = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    assert parse_tool_calls(text, KNOWN) == (text, [])
    # Without a list of known names, any name goes.
    assert parse_tool_calls(text, None, counting_ids())[1] == [ToolCall("call_0", "rm_rf", "{}")]


def test_missing_arguments_mean_none() -> None:
    assert parse_tool_calls('<tool_call>{"name": "f"}</tool_call>', None, counting_ids()) == (
        "",
        [ToolCall("call_0", "f", "{}")],
    )


def test_whitespace_inside_the_block_is_allowed() -> None:
    text = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    assert parse_tool_calls(text, None, counting_ids())[1] == [ToolCall("call_0", "f", "{}")]


def test_unclosed_block_is_content() -> None:
    parser = ToolCallParser()
    assert parser.feed('ok <tool_call>{"name": "f", "argu') == ["ok "]
    assert parser.finish() == ['<tool_call>{"name": "f", "argu']


def test_unicode_is_kept_as_is() -> None:
    text = '天気 🌤️ <tool_call>{"name": "f", "arguments": {"q": "\\u6771\\u4eac 🍣"}}</tool_call>'
    content, calls = parse_tool_calls(text, None, counting_ids())
    assert content == "天気 🌤️"
    assert calls[0].arguments == '{"q": "東京 🍣"}'
    assert json.loads(calls[0].arguments) == {"q": "東京 🍣"}


def test_look_alike_tags_pass_through() -> None:
    parser = ToolCallParser()
    assert parser.feed("a <tool") == ["a "]
    assert parser.feed("box> b") == ["<toolbox> b"]
    assert parser.feed("<tool_cal") == []
    assert parser.finish() == ["<tool_cal"]


def test_whitespace_after_a_call_is_dropped_but_text_is_not() -> None:
    parser = ToolCallParser(id_factory=counting_ids())
    events = parser.feed('<tool_call>{"name": "f", "arguments": {}}</tool_call>\n')
    assert [e for e in events if isinstance(e, str)] == []
    assert parser.feed("\n  ") == []
    assert parser.feed("\nafter") == ["after"]
    assert parser.finish() == []


def test_call_ids_are_unique_and_shaped_like_openai() -> None:
    ids = {new_call_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(i.startswith("call_") and len(i) == 29 and i[5:].isalnum() for i in ids)


def test_indexes_count_valid_calls_only() -> None:
    text = (
        '<tool_call>{"name": "a", "arguments": {}}</tool_call>'
        "<tool_call>oops</tool_call>"
        '<tool_call>{"name": "b", "arguments": {}}</tool_call>'
    )
    parser = ToolCallParser(id_factory=counting_ids())
    events = parser.feed(text) + parser.finish()
    assert [e.index for e in events if isinstance(e, ToolDelta)] == [0, 0, 1, 1]
    assert [e for e in events if isinstance(e, str)] == ["<tool_call>oops</tool_call>"]


# --- registry ----------------------------------------------------------------


def test_default_parser_for_mimo_checkpoints_only() -> None:
    assert default_parser_name("mimo_v2_flash") == "mimo"
    assert default_parser_name("MiMoV2") == "mimo"
    assert default_parser_name("qwen2") is None
    assert default_parser_name(None) is None


def test_resolve_parser() -> None:
    assert resolve_parser("reasoning", None, "mimo_v2_flash") is REASONING_PARSERS["mimo"] is ReasoningParser
    assert resolve_parser("tool_call", None, "mimo") is TOOL_CALL_PARSERS["mimo"] is ToolCallParser
    assert resolve_parser("tool_call", None, "llama") is None
    assert resolve_parser("reasoning", "none", "mimo") is None
    assert resolve_parser("reasoning", "mimo", "llama") is ReasoningParser
    with pytest.raises(ValueError, match="known: mimo, none"):
        resolve_parser("tool_call", "hermes", "mimo")
    with pytest.raises(ValueError, match="parser kind"):
        resolve_parser("vision", None, "mimo")
