"""response_format, tools and tool_choice as llguidance grammars, run on the demo tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import tokenizers
from llguidance import LLMatcher, LLTokenizer

from api.errors import BadRequest
from api.structured import (
    MAX_TOOLS,
    grammar_for_response_format,
    grammar_for_tool_choice,
    parse_tool_choice,
    parse_tools,
)
from llm_core.sample.grammar import GrammarCompiler, GrammarSpec, grammar_text

TOKENIZER_JSON = Path(__file__).resolve().parents[2] / "models" / "demo" / "tokenizer.json"
EOS = 4  # <|im_end|>
HF_TOKENIZER = tokenizers.Tokenizer.from_file(str(TOKENIZER_JSON))
# The engine's own view of the tokenizer for grammars (its markup tokens are text).
LL_TOKENIZER = GrammarCompiler(TOKENIZER_JSON.read_text(), HF_TOKENIZER.get_vocab_size(), (EOS,)).tokenizer

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather now; the } and \" and %json here must not confuse the grammar",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
PING = {"type": "function", "function": {"name": "ping"}}
ORDER = {
    "type": "function",
    "function": {
        "name": "order",
        "parameters": {  # as pydantic writes it: a reference into the schema's own $defs
            "type": "object",
            "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/Item"}}},
            "required": ["items"],
            "$defs": {"Item": {"type": "object", "properties": {"sku": {"type": "string"}}, "required": ["sku"]}},
        },
    },
}
TOOLS = [WEATHER, PING, ORDER]


def matcher(spec: GrammarSpec) -> LLMatcher:
    return LLMatcher(LL_TOKENIZER, grammar_text(spec), log_level=0)


def consumes(m: LLMatcher, text: str) -> bool:
    return all(m.consume_token(token) for token in HF_TOKENIZER.encode(text).ids)


def accepts(spec: GrammarSpec, text: str) -> bool:
    """Whether the grammar lets the model write exactly ``text`` and stop."""
    m = matcher(spec)
    return consumes(m, text) and m.is_accepting() and m.consume_token(EOS)


def call(name: str, arguments: dict[str, Any]) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}</tool_call>"


def schema_format(schema: Any, **extra: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, **extra}}


# --- response_format ---------------------------------------------------------


@pytest.mark.parametrize("response_format", [None, {"type": "text"}])
def test_plain_text_needs_no_grammar(response_format: Any) -> None:
    assert grammar_for_response_format(response_format) is None


def test_json_schema_grammar_accepts_only_matching_json() -> None:
    spec = grammar_for_response_format(schema_format(PERSON, strict=True), LL_TOKENIZER)
    assert spec == GrammarSpec("json_schema", json.dumps(PERSON))
    assert accepts(spec, '{"name": "小明 🐼", "age": 7}')
    # The layout is json.dumps': free whitespace would let a sampled model wander.
    assert not accepts(spec, '{\n  "name": "a",\n  "age": 0\n}')
    assert not accepts(spec, '{"name": "a", "age": -1}')
    assert not accepts(spec, '{"name": "a"}')
    assert not accepts(spec, '{"name": "a", "age": 1, "x": 2}')
    assert not accepts(spec, '{"age": 1, "name": "a"}')  # llguidance keeps the schema's property order
    assert not accepts(spec, 'Sure! {"name": "a", "age": 1}')


def test_a_finished_json_value_allows_only_eos() -> None:
    m = matcher(GrammarSpec("json_object"))
    assert consumes(m, '{"a": 1}')
    assert m.is_accepting() and m.is_stopped()  # nothing may follow but EOS, not even a newline
    assert not m.consume_token(HF_TOKENIZER.encode("\n").ids[0])
    m = matcher(GrammarSpec("json_object"))
    assert consumes(m, '{"a": 1}') and m.consume_token(EOS) and not m.is_error()


def test_json_object_grammar_accepts_any_object_only() -> None:
    spec = grammar_for_response_format({"type": "json_object"})
    assert spec == GrammarSpec("json_object")
    assert accepts(spec, '{"a": [1, {"b": null}], "ü": "🎉"}')
    assert accepts(spec, "{}")
    for not_an_object in ("[1]", '"x"', "1", "{", ' {"a": 1}'):
        assert not accepts(spec, not_an_object), not_an_object


def test_a_json_schema_without_schema_is_any_object() -> None:
    assert grammar_for_response_format({"type": "json_schema", "json_schema": {"name": "x"}}) == GrammarSpec(
        "json_object"
    )


@pytest.mark.parametrize(
    ("response_format", "field"),
    [
        ("json", "'response_format' must be an object"),
        ({"type": "yaml"}, "'response_format.type'"),
        ({}, "'response_format.type'"),
        ({"type": "json_schema"}, "'response_format.json_schema' must be an object"),
        ({"type": "json_schema", "json_schema": {"schema": PERSON}}, "'response_format.json_schema.name'"),
        (schema_format(PERSON) | {"json_schema": {"name": "a b", "schema": PERSON}}, "json_schema.name"),
        (schema_format([PERSON]), "'response_format.json_schema.schema' must be an object"),
        (schema_format(True), "'response_format.json_schema.schema' must be an object"),
        (schema_format(PERSON, strict="yes"), "'response_format.json_schema.strict' must be a boolean"),
        (schema_format(PERSON, description=3), "'response_format.json_schema.description' must be a string"),
    ],
)
def test_malformed_response_format_is_a_bad_request(response_format: Any, field: str) -> None:
    with pytest.raises(BadRequest, match=field.replace(".", r"\.")):
        grammar_for_response_format(response_format)


@pytest.mark.parametrize(
    ("schema", "error"),
    [
        ({"type": "foo"}, "Invalid type"),
        ({"$ref": "#/$defs/missing"}, "does not exist"),
        ({"type": "string", "pattern": "(?=a)b"}, "look-around"),
    ],
)
@pytest.mark.parametrize("tokenizer", [None, LL_TOKENIZER])
def test_a_schema_llguidance_cannot_enforce_is_a_bad_request(
    schema: dict[str, Any], error: str, tokenizer: LLTokenizer | None
) -> None:
    with pytest.raises(BadRequest, match=rf"(?s)'response_format\.json_schema\.schema' cannot be enforced: .*{error}"):
        grammar_for_response_format(schema_format(schema), tokenizer)


def test_a_huge_schema_is_a_bad_request() -> None:
    schema = {"type": "object", "description": "x" * (1 << 20)}
    with pytest.raises(BadRequest, match="too long"):
        grammar_for_response_format(schema_format(schema))


# --- tools -------------------------------------------------------------------


def test_parse_tools_keeps_valid_tools() -> None:
    assert parse_tools(None) == []
    assert parse_tools(TOOLS) == TOOLS


@pytest.mark.parametrize(
    ("tools", "message"),
    [
        ({"type": "function"}, "'tools' must be an array"),
        (["f"], "'tools[0]' must be an object"),
        ([{"type": "retrieval"}], "'tools[0].type' must be 'function'"),
        ([{"type": "function"}], "'tools[0].function' must be an object"),
        ([{"type": "function", "function": {}}], "'tools[0].function.name' must be 1 to 64"),
        ([{"type": "function", "function": {"name": "a.b"}}], "'tools[0].function.name'"),
        ([{"type": "function", "function": {"name": "x" * 65}}], "'tools[0].function.name'"),
        ([{"type": "function", "function": {"name": "f\n"}}], "'tools[0].function.name'"),
        ([PING, PING], "'tools[1].function.name' repeats 'ping'"),
        ([PING, {"type": "function", "function": {"name": "g", "parameters": "{}"}}], "'tools[1].function.parameters'"),
        ([{"type": "function", "function": {"name": "g", "description": 1}}], "'tools[0].function.description'"),
        ([{"type": "function", "function": {"name": f"f{i}"}} for i in range(MAX_TOOLS + 1)], "at most 128"),
    ],
)
def test_malformed_tools_are_a_bad_request(tools: Any, message: str) -> None:
    with pytest.raises(BadRequest, match=message.replace(".", r"\.").replace("[", r"\[")):
        parse_tools(tools)


def test_parse_tool_choice() -> None:
    assert parse_tool_choice(None, TOOLS) == "auto"
    assert parse_tool_choice(None, []) == "none"
    assert parse_tool_choice("auto", []) == "none"
    assert parse_tool_choice("none", TOOLS) == "none"
    assert parse_tool_choice("required", TOOLS) == "required"
    named = {"type": "function", "function": {"name": "ping", "extra": 1}}
    assert parse_tool_choice(named, TOOLS) == {"type": "function", "function": {"name": "ping"}}


@pytest.mark.parametrize(
    ("choice", "tools", "message"),
    [
        ("always", TOOLS, "'tool_choice' must be"),
        (3, TOOLS, "'tool_choice' must be"),
        ("required", [], "no 'tools'"),
        ({"type": "tool", "function": {"name": "ping"}}, TOOLS, r"'tool_choice\.type'"),
        ({"type": "function"}, TOOLS, r"'tool_choice\.function' must be an object"),
        ({"type": "function", "function": {}}, TOOLS, r"'tool_choice\.function\.name'"),
        ({"type": "function", "function": {"name": "nope"}}, TOOLS, "'nope', which is not one of"),
    ],
)
def test_malformed_tool_choice_is_a_bad_request(choice: Any, tools: list[dict[str, Any]], message: str) -> None:
    with pytest.raises(BadRequest, match=message):
        parse_tool_choice(choice, tools)


# --- tool grammars -----------------------------------------------------------


@pytest.mark.parametrize("choice", [None, "none", "auto"])
def test_optional_tools_need_no_grammar(choice: Any) -> None:
    assert grammar_for_tool_choice(TOOLS, choice, parallel_tool_calls=True) is None


@pytest.fixture(scope="module")
def required_parallel() -> GrammarSpec:
    spec = grammar_for_tool_choice(TOOLS, "required", parallel_tool_calls=True, tokenizer=LL_TOKENIZER)
    assert spec is not None and spec.kind == "lark"
    return spec


def test_required_accepts_a_call_to_any_tool(required_parallel: GrammarSpec) -> None:
    assert accepts(required_parallel, call("get_weather", {"city": "東京 🗼", "unit": "c"}))
    assert accepts(required_parallel, call("ping", {}))
    assert accepts(required_parallel, call("ping", {"anything": [1, 2]}))
    assert accepts(required_parallel, call("order", {"items": [{"sku": "a-1"}]}))
    assert accepts(required_parallel, '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>')


def test_required_rejects_what_is_not_a_valid_call(required_parallel: GrammarSpec) -> None:
    assert not accepts(required_parallel, "")
    assert not accepts(required_parallel, "Sure. " + call("ping", {}))
    assert not accepts(required_parallel, call("pong", {}))
    assert not accepts(required_parallel, call("get_weather", {"city": 3}))
    assert not accepts(required_parallel, call("get_weather", {"unit": "c"}))
    assert not accepts(required_parallel, call("get_weather", {"city": "x", "wind": True}))
    assert not accepts(required_parallel, call("order", {"items": [{"id": 1}]}))
    assert not accepts(required_parallel, '<tool_call>{"name": "ping"}</tool_call>')
    assert not accepts(required_parallel, '<tool_call>{"arguments": {}, "name": "ping"}</tool_call>')
    assert not accepts(required_parallel, '<tool_call>{"name": "ping", "arguments": {}}')


def test_parallel_calls_are_one_or_more(required_parallel: GrammarSpec) -> None:
    two = [call("ping", {}), call("get_weather", {"city": "Oslo"})]
    assert accepts(required_parallel, "\n".join(two))
    assert accepts(required_parallel, "".join(two))
    assert not accepts(required_parallel, "\n\n".join(two))


def test_without_parallel_calls_only_one_call() -> None:
    spec = grammar_for_tool_choice(TOOLS, "required", parallel_tool_calls=False)
    assert spec is not None
    assert accepts(spec, call("ping", {}))
    assert not accepts(spec, call("ping", {}) + "\n" + call("ping", {}))
    assert not accepts(spec, call("ping", {}) + call("ping", {}))


def test_a_named_choice_accepts_only_that_tool() -> None:
    choice = parse_tool_choice({"type": "function", "function": {"name": "get_weather"}}, TOOLS)
    spec = grammar_for_tool_choice(TOOLS, choice, parallel_tool_calls=False, tokenizer=LL_TOKENIZER)
    assert spec is not None
    assert accepts(spec, call("get_weather", {"city": "Lima"}))
    assert not accepts(spec, call("ping", {}))
    assert not accepts(spec, call("order", {"items": []}))


def test_a_named_choice_must_be_one_of_the_tools() -> None:
    with pytest.raises(BadRequest, match="'tool_choice.function.name' is 'nope'"):
        grammar_for_tool_choice(TOOLS, {"type": "function", "function": {"name": "nope"}}, True)
    with pytest.raises(BadRequest, match="no 'tools'"):
        grammar_for_tool_choice([], "required", True)


def test_tool_parameters_llguidance_cannot_enforce_are_a_bad_request() -> None:
    parameters = {"type": "object", "properties": {"a": {"type": "nope"}}}
    bad = {"type": "function", "function": {"name": "bad", "parameters": parameters}}
    with pytest.raises(BadRequest, match=r"'tools\[1\]\.function\.parameters' cannot be enforced"):
        grammar_for_tool_choice([PING, bad], "required", True)
    # Not forced, the bad tool is only passed on to the model.
    assert grammar_for_tool_choice([PING, bad], "auto", True) is None
    assert grammar_for_tool_choice([PING, bad], {"type": "function", "function": {"name": "ping"}}, True)
