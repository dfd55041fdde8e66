"""demo.dialogue: the demo model's chat template (tools, tool calls and results,
thinking) and the conversations training and evaluation build from world samples."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from api.models import DEMO_MODEL_DIR
from demo.dialogue import (
    ADDED_TOKENS,
    DEMO_CHAT_TEMPLATE,
    THINK_CLOSE,
    Mode,
    ToolCall,
    conversation,
    parse_tool_calls,
    split_reasoning,
    tool_call_message,
)
from demo.tasks import REASONING, make_sample
from demo.tool_spec import NO_TOOL_ANSWER, VIDEO_INFO_TOOL, VIDEO_PROPERTIES, tool_call_text
from demo.world import TASKS
from llm_core.model.chat import DEFAULT_CHAT_TEMPLATE, ChatTemplate
from llm_core.model.tokenizer import Tokenizer

DEMO = ChatTemplate(DEMO_CHAT_TEMPLATE)
OLD = ChatTemplate(DEFAULT_CHAT_TEMPLATE)
PAGE = Path(__file__).resolve().parents[2] / "demo" / "static" / "index.html"

TEXT = {"type": "text", "text": "What colour is the square?"}
PLAIN_CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "hello"}],
    [{"role": "user", "content": [{"type": "video"}, {"type": "audio"}, {"type": "text", "text": "Describe the video."}]}],
    [{"role": "user", "content": [TEXT, {"type": "image"}]}],
    [{"role": "system", "content": "Be brief."},
     {"role": "user", "content": [{"type": "image"}, TEXT]},
     {"role": "assistant", "content": "red"},
     {"role": "user", "content": [{"type": "text", "text": "And "}, {"type": "audio"}, {"type": "text", "text": "?"}]}],
    [{"role": "user", "content": []}, {"role": "assistant", "content": ""}],
    [{"role": "user", "content": "a\nb {{ not jinja }} <think>"}],
]


def _video_info(prop: str = "frame_rate"):
    rng = np.random.default_rng(0)
    while True:
        sample = make_sample(rng, "video_info")
        if prop in sample.answer:
            return sample


@pytest.mark.parametrize("messages", PLAIN_CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_without_tools_or_thinking_the_prompt_is_the_default_templates(
    messages: list[dict[str, Any]], add_generation_prompt: bool
) -> None:
    """Byte for byte: prompts, prefix-cache keys and existing answers stay as they were."""
    old = OLD.render(messages, add_generation_prompt)
    assert DEMO.render(messages, add_generation_prompt) == old
    assert DEMO.render(messages, add_generation_prompt, tools=None, enable_thinking=False) == old
    assert DEMO.render(messages, add_generation_prompt, tools=[]) == old


def test_tools_make_one_system_turn_with_the_callers_system_message() -> None:
    user = {"role": "user", "content": [{"type": "video"}, TEXT]}
    text = DEMO.render([user], tools=[VIDEO_INFO_TOOL])
    system, rest = text.split("<|im_end|>\n", 1)
    assert system.startswith("<|im_start|>system\n# Tools\n")
    listed = re.search(r"<tools>\n(.*)\n</tools>", system, re.DOTALL)
    assert listed is not None
    assert [json.loads(line) for line in listed.group(1).split("\n")] == [VIDEO_INFO_TOOL]
    assert '<tool_call>{"name": <function name>, "arguments": <JSON object>}</tool_call>' in system
    assert rest == OLD.render([user])

    merged = DEMO.render([{"role": "system", "content": "Be brief."}, user], tools=[VIDEO_INFO_TOOL])
    assert merged.count("<|im_start|>system") == 1
    assert merged.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    two = DEMO.render([user], tools=[VIDEO_INFO_TOOL, {**VIDEO_INFO_TOOL, "function": {"name": "other"}}])
    assert len(re.search(r"<tools>\n(.*)\n</tools>", two, re.DOTALL).group(1).split("\n")) == 2


def test_assistant_tool_calls_render_as_the_model_writes_them() -> None:
    call = ToolCall("get_video_info", {"property": "width"})
    expected = tool_call_text(call.name, call.arguments)
    assert expected == '<tool_call>{"name": "get_video_info", "arguments": {"property": "width"}}</tool_call>'
    for message in (tool_call_message(call), tool_call_message(call, compact=False)):
        assert DEMO.render([message], add_generation_prompt=False) == f"<|im_start|>assistant\n{expected}<|im_end|>\n"
    # The server hands the template parsed arguments (an object): the same text.
    parsed = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]}
    assert DEMO.render([parsed], add_generation_prompt=False) == f"<|im_start|>assistant\n{expected}<|im_end|>\n"
    # Content first, then one block per call, a newline apart.
    two = {**parsed, "content": "Let me check.", "tool_calls": parsed["tool_calls"] * 2}
    assert DEMO.render([two], add_generation_prompt=False) == (
        f"<|im_start|>assistant\nLet me check.\n{expected}\n{expected}<|im_end|>\n")


def test_tool_results_share_one_user_side_turn() -> None:
    messages = [
        {"role": "user", "content": "q"},
        tool_call_message(ToolCall("get_video_info", {"property": "width"})),
        {"role": "tool", "tool_call_id": "call_0", "content": '{"width": 640}'},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"height": 360}'},
        {"role": "assistant", "content": "ok"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "3"}]},
    ]
    text = DEMO.render(messages, add_generation_prompt=False)
    assert ('<|im_start|>user\n<tool_response>\n{"width": 640}\n</tool_response>\n'
            '<tool_response>\n{"height": 360}\n</tool_response><|im_end|>\n') in text
    assert text.endswith("<|im_start|>assistant\nok<|im_end|>\n"
                         "<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n")


def test_thinking_opens_the_answer_and_earlier_reasoning_is_dropped() -> None:
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "I look.</think>\n\nred"},
                {"role": "user", "content": "again"}]
    text = DEMO.render(messages, enable_thinking=True)
    assert text.endswith("<|im_start|>assistant\n<think>\n")
    assert "<|im_start|>assistant\nred<|im_end|>" in text and "I look." not in text
    assert DEMO.render(messages[:1], enable_thinking=False) == OLD.render(messages[:1])


@pytest.mark.parametrize("task", TASKS)
def test_conversations_of_every_task_and_mode(task: str) -> None:
    sample = make_sample(np.random.default_rng(1), task)
    plain = conversation(sample, Mode())
    assert plain.follow_up == () and plain.variables == {} and plain.reasoning is None
    assert plain.output == (NO_TOOL_ANSWER if task == "video_info" else sample.answer)
    listed = conversation(sample, Mode(tools=True))
    assert listed.variables == {"tools": [VIDEO_INFO_TOOL]} and listed.output == sample.answer
    thinking = conversation(sample, Mode(tools=True, thinking=True))
    assert thinking.variables == {"tools": [VIDEO_INFO_TOOL], "enable_thinking": True}
    assert thinking.output == thinking.reasoning + THINK_CLOSE + sample.answer
    assert split_reasoning(thinking.output, True) == (thinking.reasoning, sample.answer)
    if task != "video_info":
        assert thinking.reasoning == REASONING[task]
        assert parse_tool_calls(sample.answer) == []
        with pytest.raises(ValueError):
            conversation(sample, Mode(tools=True, tool_result=True))


@pytest.mark.parametrize("prop", VIDEO_PROPERTIES)
def test_the_tool_round_trip(prop: str) -> None:
    sample = _video_info(prop)
    call = conversation(sample, Mode(tools=True))
    assert parse_tool_calls(call.output) == [ToolCall("get_video_info", {"property": prop})]
    trip = conversation(sample, Mode(tools=True, tool_result=True))
    assistant, result = trip.follow_up
    # The call as the client sends it back renders to what the model wrote.
    assert DEMO.render([assistant], add_generation_prompt=False) == f"<|im_start|>assistant\n{call.output}<|im_end|>\n"
    assert json.loads(result["content"]) == {prop: json.loads(result["content"])[prop]}
    assert str(json.loads(result["content"])[prop]) in trip.output
    assert trip.output.startswith("The video ") and trip.output.endswith(".")
    prompt = DEMO.render([{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": sample.question}]},
                          *trip.follow_up], **trip.variables)
    assert prompt.endswith(f"<tool_response>\n{result['content']}\n</tool_response><|im_end|>\n"
                           "<|im_start|>assistant\n")
    # The result of the property the model asked for, whichever it was.
    other = next(p for p in VIDEO_PROPERTIES if p != prop)
    wrong = conversation(sample, Mode(tools=True, tool_result=True), call=ToolCall("get_video_info", {"property": other}))
    assert other in wrong.follow_up[1]["content"]


def test_mode_labels_and_validation() -> None:
    assert Mode().label("describe") == "describe"
    assert Mode(tools=True, thinking=True).label("describe") == "describe+tools+think"
    assert Mode(tools=True).label("video_info") == "tool_call"
    assert Mode(tools=True, tool_result=True, thinking=True).label("video_info") == "tool_reply+think"
    assert Mode().label("video_info") == "tool_absent"
    with pytest.raises(ValueError):
        Mode(tool_result=True)


def test_parse_tool_calls_keeps_only_well_formed_calls() -> None:
    good = tool_call_text("get_video_info", {"property": "height"})
    assert parse_tool_calls(f"x {good}\n{good}") == [ToolCall("get_video_info", {"property": "height"})] * 2
    for bad in ('<tool_call>{"arguments": {}, "name": "f"}</tool_call>', "<tool_call>{not json}</tool_call>",
                '<tool_call>{"name": "f", "arguments": "{}"}</tool_call>', '<tool_call>{"name": "f"}</tool_call>',
                '{"name": "f", "arguments": {}}'):
        assert parse_tool_calls(bad) == []
    assert split_reasoning("still thinking", True) == ("still thinking", "")
    assert split_reasoning(" red ", False) == (None, "red")


def test_the_page_offers_the_tool_the_model_knows() -> None:
    page = PAGE.read_text()
    function = VIDEO_INFO_TOOL["function"]
    assert f'name: "{function["name"]}"' in page
    assert f'description: "{function["description"]}"' in page
    assert "enum: " + json.dumps(list(VIDEO_PROPERTIES)).replace('","', '", "') in page
    assert 'body.thinking = { type: "enabled" }' in page


@pytest.mark.skipif(not (DEMO_MODEL_DIR / "config.json").exists(), reason="the demo model is not in this checkout")
def test_committed_checkpoint_has_the_template_and_the_marker_tokens() -> None:
    config = json.loads((DEMO_MODEL_DIR / "tokenizer_config.json").read_text())
    assert config["chat_template"] == DEMO_CHAT_TEMPLATE
    tokenizer = Tokenizer(DEMO_MODEL_DIR / "tokenizer.json")
    ids = [tokenizer.token_to_id(t) for t in ADDED_TOKENS]
    # Appended after the BPE vocabulary: every other text keeps its token ids.
    assert sorted(ids) == list(range(tokenizer.vocab_size - len(ADDED_TOKENS), tokenizer.vocab_size))
    assert json.loads((DEMO_MODEL_DIR / "config.json").read_text())["vocab_size"] == tokenizer.vocab_size
    text = "<think>\nx</think>\n\n" + tool_call_text("get_video_info", {"property": "width"})
    assert tokenizer.decode(tokenizer.encode(text)) == text  # not special: the parsers see them
    for marker in ADDED_TOKENS:
        assert tokenizer.encode(marker) == [tokenizer.token_to_id(marker)]
