"""OpenAI's ``response_format``, ``tools`` and ``tool_choice`` as grammars the engine enforces.

A request's fields are checked here, where a mistake can still be a 400 naming
the field, and turned into a ``GrammarSpec``: the engine compiles it with
llguidance and masks every token the grammar does not allow. Each grammar is
also compiled once here (with the server's tokenizer when given), so a schema
llguidance cannot enforce is refused up front rather than failing mid-batch.

A forced tool call is MiMo's ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
whose JSON is held to the tool's ``parameters`` schema by Lark's ``%json``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypeAlias, cast

from llguidance import LLMatcher, LLTokenizer

from api.errors import BadRequest
from llm_core.sample.grammar import JSON_LAYOUT, GrammarKind, GrammarSpec, grammar_text

__all__ = [
    "MAX_TOOLS",
    "ToolChoice",
    "grammar_for_response_format",
    "grammar_for_tool_choice",
    "parse_tool_choice",
    "parse_tools",
]

# OpenAI's own limit; a request past it is a mistake, not a need.
MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_NAME_RULE = "1 to 64 letters, digits, underscores or dashes"
_ANY_OBJECT: dict[str, Any] = {"type": "object"}
_CHOICE_WORDS = ("none", "auto", "required")
_DEFINITION_KEYS = ("$defs", "definitions")

ToolChoice: TypeAlias = Literal["none", "auto", "required"] | dict[str, Any]


def _check_compiles(spec: GrammarSpec, field: str, tokenizer: LLTokenizer | None) -> None:
    # Without a tokenizer llguidance still checks the grammar itself, which is most of what can go wrong.
    try:
        text = grammar_text(spec)
    except ValueError as exc:
        raise BadRequest(f"{field!r} cannot be enforced: {exc}") from None
    error = LLMatcher.validate_grammar(text, tokenizer)
    if error:
        raise BadRequest(f"{field!r} cannot be enforced: {error.strip()}")


def _spec(kind: GrammarKind, source: str, field: str) -> GrammarSpec:
    try:
        return GrammarSpec(kind, source)
    except ValueError as exc:  # too long
        raise BadRequest(f"{field!r}: {exc}") from None


def _require_object(value: Any, field: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise BadRequest(f"{field!r} must be an object")
    return value


def _optional_string(container: Mapping[str, Any], key: str, field: str) -> None:
    if container.get(key) is not None and not isinstance(container[key], str):
        raise BadRequest(f"'{field}.{key}' must be a string")


def _optional_bool(container: Mapping[str, Any], key: str, field: str) -> None:
    if container.get(key) is not None and not isinstance(container[key], bool):
        raise BadRequest(f"'{field}.{key}' must be a boolean")


def _require_name(container: Mapping[str, Any], field: str) -> str:
    name = container.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise BadRequest(f"'{field}.name' must be {_NAME_RULE}")
    return name


# --- response_format ---------------------------------------------------------


def grammar_for_response_format(response_format: Any, tokenizer: LLTokenizer | None = None) -> GrammarSpec | None:
    """The grammar ``response_format`` asks for; None for plain text (or no field)."""
    if response_format is None:
        return None
    fmt = _require_object(response_format, "response_format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind == "json_schema":
        return _json_schema_grammar(fmt.get("json_schema"), tokenizer)
    raise BadRequest("'response_format.type' must be 'text', 'json_object' or 'json_schema'")


def _json_schema_grammar(raw: Any, tokenizer: LLTokenizer | None) -> GrammarSpec:
    field = "response_format.json_schema"
    json_schema = _require_object(raw, field)
    _require_name(json_schema, field)
    _optional_string(json_schema, "description", field)
    _optional_bool(json_schema, "strict", field)
    schema = json_schema.get("schema")
    if schema is None:
        return GrammarSpec("json_object")  # OpenAI's schema is optional: then any JSON object
    _require_object(schema, f"{field}.schema")
    # Key order is kept: llguidance has the model write properties in the schema's order.
    spec = _spec("json_schema", json.dumps(schema), f"{field}.schema")
    _check_compiles(spec, f"{field}.schema", tokenizer)
    return spec


# --- tools and tool_choice ---------------------------------------------------


def parse_tools(raw: Any) -> list[dict[str, Any]]:
    """The request's ``tools``: function tools with valid, distinct names ([] when absent)."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise BadRequest("'tools' must be an array")
    if len(raw) > MAX_TOOLS:
        raise BadRequest(f"'tools' has {len(raw)} tools; at most {MAX_TOOLS} are allowed")
    seen: set[str] = set()
    for i, tool in enumerate(raw):
        name = _check_tool(tool, f"tools[{i}]")
        if name in seen:
            raise BadRequest(f"'tools[{i}].function.name' repeats {name!r}: tool names must be unique")
        seen.add(name)
    return list(raw)


def _check_tool(raw: Any, field: str) -> str:
    tool = _require_object(raw, field)
    if tool.get("type") != "function":
        raise BadRequest(f"'{field}.type' must be 'function'")
    function = _require_object(tool.get("function"), f"{field}.function")
    name = _require_name(function, f"{field}.function")
    _optional_string(function, "description", f"{field}.function")
    _optional_bool(function, "strict", f"{field}.function")
    if function.get("parameters") is not None:
        _require_object(function["parameters"], f"{field}.function.parameters")
    return name


def _tool_names(tools: Sequence[Mapping[str, Any]]) -> list[str]:
    return [tool["function"]["name"] for tool in tools]


def parse_tool_choice(raw: Any, tools: Sequence[Mapping[str, Any]]) -> ToolChoice:
    """The request's ``tool_choice``, given its parsed ``tools``: "auto" by default
    when there are tools, "none" when there are none."""
    if raw is None:
        return "auto" if tools else "none"
    if isinstance(raw, str) and raw in _CHOICE_WORDS:
        if raw == "required" and not tools:
            raise BadRequest("'tool_choice' is 'required' but the request has no 'tools'")
        # "auto" with nothing to call is harmless: some clients always send it.
        return cast(ToolChoice, raw) if tools else "none"
    if not isinstance(raw, Mapping):
        raise BadRequest("'tool_choice' must be 'none', 'auto', 'required' or {\"type\": \"function\", ...}")
    if raw.get("type") != "function":
        raise BadRequest("'tool_choice.type' must be 'function'")
    function = _require_object(raw.get("function"), "tool_choice.function")
    name = _require_name(function, "tool_choice.function")
    if name not in _tool_names(tools):
        raise BadRequest(f"'tool_choice.function.name' is {name!r}, which is not one of the request's 'tools'")
    return {"type": "function", "function": {"name": name}}


def grammar_for_tool_choice(
    tools: Sequence[Mapping[str, Any]],
    tool_choice: Any,
    parallel_tool_calls: bool,
    tokenizer: LLTokenizer | None = None,
) -> GrammarSpec | None:
    """A grammar forcing tool calls when ``tool_choice`` demands them ("required",
    or one named function); None when the model may answer as it likes.
    ``parallel_tool_calls``: one or more calls; otherwise exactly one."""
    if tool_choice is None or tool_choice in ("none", "auto"):
        return None
    chosen = _chosen_tools(tools, tool_choice)
    for index, tool in chosen:
        call = _spec("json_schema", json.dumps(_call_schema(tool)), f"tools[{index}].function.parameters")
        _check_compiles(call, f"tools[{index}].function.parameters", tokenizer)
    spec = _spec("lark", _tool_call_lark([tool for _, tool in chosen], parallel_tool_calls), "tools")
    _check_compiles(spec, "tools", tokenizer)
    return spec


def _chosen_tools(tools: Sequence[Mapping[str, Any]], tool_choice: Any) -> list[tuple[int, Mapping[str, Any]]]:
    """The tools a call may be made to, each with its index in ``tools`` (to name it in errors)."""
    indexed = list(enumerate(tools))
    if tool_choice == "required":
        if not indexed:
            raise BadRequest("'tool_choice' is 'required' but the request has no 'tools'")
        return indexed
    if not isinstance(tool_choice, Mapping) or not isinstance(tool_choice.get("function"), Mapping):
        raise BadRequest("'tool_choice' must be 'none', 'auto', 'required' or {\"type\": \"function\", ...}")
    name = tool_choice["function"].get("name")
    named = [(i, tool) for i, tool in indexed if tool["function"]["name"] == name]
    if not named:
        raise BadRequest(f"'tool_choice.function.name' is {name!r}, which is not one of the request's 'tools'")
    return named


def _call_schema(tool: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON inside one ``<tool_call>`` block to this tool: its name, then its arguments."""
    function = tool["function"]
    arguments = dict(function.get("parameters") or _ANY_OBJECT)
    # References such as "#/$defs/Item" (pydantic writes them) are read from the
    # root of the schema, which is now this wrapper: the definitions move up to it.
    definitions = {key: arguments.pop(key) for key in _DEFINITION_KEYS if key in arguments}
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
        "x-guidance": JSON_LAYOUT,
        **definitions,
    }


def _tool_call_lark(tools: Sequence[Mapping[str, Any]], parallel: bool) -> str:
    # MiMo writes no newline inside the block, but Qwen-style models do: allowing
    # one costs nothing and keeps such a model on its own format.
    bodies = "\n     | ".join(f"%json {json.dumps(_call_schema(tool))}" for tool in tools)
    start = 'start: call ("\\n"? call)*' if parallel else "start: call"
    return f'{start}\ncall: "<tool_call>" "\\n"? body "\\n"? "</tool_call>"\nbody: {bodies}\n'
