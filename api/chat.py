"""OpenAI chat-completions requests: validation and media references.

Content parts accepted in user messages:

- ``{"type": "text", "text": ...}``
- ``{"type": "image_url", "image_url": {"url": U}}`` and ``{"type": "video_url", "video_url": {"url": U}}``
  where ``U`` is a ``data:`` URL, an uploaded file's id (``POST /v1/files``) or,
  in a multipart request, the form field name of one of its file parts;
- ``{"type": "input_audio", "input_audio": {"data": BASE64, "format": "wav"}}``;
- ``{"type": "file", "file": {"file_id": ID}}`` or ``{"file": {"file_data": BASE64 or data: URL}}``,
  whose media type is sniffed from the content.

Remote ``http(s)`` URLs are refused: the server downloads nothing on a user's behalf.
Bytes that are not the media the client declared (by the data: URL's type, the part
type, a multipart part's Content-Type or file name) are a 400, as at OpenAI; a
recognisable file of a kind we do not take (PDF, ZIP, text...) is a 415.
"""

from __future__ import annotations

import base64
import binascii
import json
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NoReturn

from api.errors import BadRequest, UnsupportedMedia
from api.media_sniff import SNIFF_BYTES, DeclaredType, declared_type, refusal_for_unrecognised, sniff_media_kind
from api.uploads import StoredFile
from llm_core import SamplingParams
from llm_core.sample.params import MAX_TOP_LOGPROBS

__all__ = [
    "BadRequest",
    "ChatRequest",
    "MediaRef",
    "UnsupportedMedia",
    "parse_bool",
    "parse_chat_request",
    "parse_include_usage",
    "parse_json_body",
    "parse_sampling",
    "parse_stop",
    "require_unicode",
]

_ROLES = ("system", "developer", "user", "assistant", "tool")

# Choices per request: each is a decode of its own (the prompt is computed once).
MAX_CHOICES = 16

# Far beyond any count, id or seed (2**64 has 20 digits), and under Python's own 4300-digit
# limit, whose message would speak to the server's operator rather than to the client.
_MAX_INT_DIGITS = 1000

# Every generated token searches the new text plus the longest stop string's
# length for every stop string, on the engine thread: both must stay small
# (OpenAI takes 4 strings).
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256

# The media kind each media part type stands for, and back.
_PART_KINDS = {"image_url": "image", "video_url": "video", "input_audio": "audio"}
_KIND_PARTS = {kind: part for part, kind in _PART_KINDS.items()}


def parse_json_body(raw: bytes | str, what: str = "request body") -> Any:
    """JSON from a client: bad syntax, bad UTF-8, NaN/Infinity (not JSON, though Python
    reads them), absurdly long integers and nesting too deep for the parser are all a BadRequest."""
    try:
        return json.loads(raw, parse_constant=_refuse_constant, parse_int=_bounded_int)
    except RecursionError:
        raise BadRequest(f"{what} is not valid JSON: it nests too deeply") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, and the two refusals below
        raise BadRequest(f"{what} is not valid JSON: {exc}") from None


def _refuse_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a JSON value")


def _bounded_int(digits: str) -> int:
    if len(digits) > _MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(digits)} digits is too long (at most {_MAX_INT_DIGITS})")
    return int(digits)


@dataclass(frozen=True)
class MediaRef:
    """One media item of a request: where its bytes are and what it is."""

    kind: str  # "image" | "video" | "audio"
    data: bytes | None = None
    path: Path | None = None
    # The file's ``file_digest`` when it is known already: a clip with a sound
    # track is two items of one file, hashed once.
    digest: bytes | None = None

    def read(self) -> bytes:
        if self.data is not None:
            return self.data
        assert self.path is not None
        return self.path.read_bytes()


@dataclass(frozen=True)
class ChatRequest:
    # Messages for the chat template: content is a string or a list of
    # {"type": "text", "text"} / {"type": kind} parts; media parts in order of `media`.
    messages: list[dict[str, Any]]
    media: list[MediaRef]
    params: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    tools: list[dict[str, Any]] = field(default_factory=list)  # offered to the model (by the chat template)
    tool_choice: Any = "none"  # "none" | "auto" | "required" | {"type": "function", "function": {"name"}}
    thinking: bool = False  # the chat template opens a reasoning section
    n: int = 1
    top_logprobs: int | None = None  # None: no logprobs
    # The one id of this request: its response's ``id`` and ``X-Request-Id``,
    # and what the engine's logs and a stack's messages call it.
    request_id: str = field(default_factory=lambda: new_request_id("chatcmpl"))

    @property
    def template_variables(self) -> dict[str, Any]:
        """What the chat template reads besides the messages."""
        return {"tools": self.tools or None, "enable_thinking": self.thinking}


FileLookup = Callable[[str], StoredFile | None]


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def choice_request_id(request_id: str, index: int) -> str:
    """The engine request of a response's choice ``index``: the response's id, then ``-1``, ``-2``..."""
    return request_id if index == 0 else f"{request_id}-{index}"


def parse_chat_request(body: Any, lookup_file: FileLookup) -> ChatRequest:
    """Validate an OpenAI chat body; ``lookup_file(id)`` resolves file references
    (multipart parts of this request first, then uploaded files)."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise BadRequest("'messages' must be a non-empty list")
    # api.structured reports its errors as this module's BadRequest.
    from api.structured import grammar_for_response_format, grammar_for_tool_choice, parse_tool_choice, parse_tools

    media: list[MediaRef] = []
    messages = [_parse_message(i, m, media, lookup_file) for i, m in enumerate(raw_messages)]
    tools = parse_tools(body.get("tools"))
    tool_choice = parse_tool_choice(body.get("tool_choice"), tools)
    thinking = parse_thinking(body)
    grammar = grammar_for_tool_choice(tools, tool_choice, parse_bool(body, "parallel_tool_calls", True))
    response_grammar = grammar_for_response_format(body.get("response_format"))
    if grammar is not None and response_grammar is not None:
        raise BadRequest("'response_format' cannot be combined with a 'tool_choice' that forces a tool call")
    grammar = grammar or response_grammar
    if grammar is not None and thinking:
        grammar = replace(grammar, after=THINK_END)  # the reasoning runs free; the answer follows the grammar
    top_logprobs = _chat_logprobs(body)
    params = parse_sampling(body, max_tokens_keys=("max_completion_tokens", "max_tokens"))
    return ChatRequest(
        messages=messages,
        media=media,
        params=replace(params, grammar=grammar, logprobs=top_logprobs),
        stop=parse_stop(body.get("stop")),
        stream=parse_bool(body, "stream"),
        include_usage=parse_include_usage(body, default=True),
        tools=tools if tool_choice != "none" else [],
        tool_choice=tool_choice,
        thinking=thinking,
        n=parse_choices(body),
        top_logprobs=top_logprobs,
    )


THINK_END = "</think>"


def parse_choices(body: Mapping[str, Any]) -> int:
    n = _int(body.get("n", 1) if body.get("n") is not None else 1, "n")
    if not 1 <= n <= MAX_CHOICES:
        raise BadRequest(f"'n' must be from 1 to {MAX_CHOICES}, got {n}")
    return n


def parse_thinking(body: Mapping[str, Any]) -> bool:
    """Reasoning on or off: Xiaomi's ``"thinking": {"type": "enabled" | "disabled"}``,
    or vLLM's ``"chat_template_kwargs": {"enable_thinking": bool}``; off by default."""
    thinking = body.get("thinking")
    if thinking is not None:
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind not in ("enabled", "disabled"):
            raise BadRequest("'thinking' must be {\"type\": \"enabled\"} or {\"type\": \"disabled\"}")
        return kind == "enabled"
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return False
    if not isinstance(kwargs, dict):
        raise BadRequest("'chat_template_kwargs' must be an object")
    return parse_bool(kwargs, "enable_thinking", where="'chat_template_kwargs.enable_thinking'")


def _chat_logprobs(body: Mapping[str, Any]) -> int | None:
    """Chat's ``logprobs`` (true/false) and ``top_logprobs`` (0-20, needs logprobs)."""
    top = body.get("top_logprobs")
    if not parse_bool(body, "logprobs"):
        if top is not None:
            raise BadRequest("'top_logprobs' needs 'logprobs': true")
        return None
    top = 0 if top is None else _int(top, "top_logprobs")
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise BadRequest(f"'top_logprobs' must be from 0 to {MAX_TOP_LOGPROBS}, got {top}")
    return top


def parse_include_usage(body: Mapping[str, Any], default: bool) -> bool:
    """'stream_options.include_usage', where 'stream_options' must be an object if given."""
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise BadRequest("'stream_options' must be an object")
    return parse_bool(stream_options, "include_usage", default, where="'stream_options.include_usage'")


def parse_bool(body: Mapping[str, Any], key: str, default: bool = False, where: str | None = None) -> bool:
    """A true/false field (null means the default): "false" or 0 is a mistake to report, not a truth value."""
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"{where or repr(key)} must be true or false, got {value!r}")
    return value


def require_unicode(text: str, where: str) -> str:
    """`text`, refused when it holds a lone surrogate: JSON can spell one ("\\ud800"),
    but it is not Unicode text and the tokenizer cannot take it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BadRequest(f"{where} is not valid Unicode: a lone surrogate at character {exc.start}") from None
    return text


def parse_sampling(body: Mapping[str, Any], max_tokens_keys: tuple[str, ...] = ("max_tokens",)) -> SamplingParams:
    key = next((k for k in max_tokens_keys if body.get(k) is not None), None)
    try:
        return SamplingParams(
            max_tokens=256 if key is None else _int(body[key], key),
            temperature=_float(body.get("temperature", 1.0), "temperature"),
            top_p=_float(body.get("top_p", 1.0), "top_p"),
            top_k=_int(body.get("top_k", -1), "top_k"),
            seed=None if body.get("seed") is None else _int(body["seed"], "seed"),
            stop_token_ids=tuple(_int_list(body.get("stop_token_ids") or [], "stop_token_ids")),
            ignore_eos=parse_bool(body, "ignore_eos"),
            presence_penalty=_float(_or(body.get("presence_penalty"), 0.0), "presence_penalty"),
            frequency_penalty=_float(_or(body.get("frequency_penalty"), 0.0), "frequency_penalty"),
            repetition_penalty=_float(_or(body.get("repetition_penalty"), 1.0), "repetition_penalty"),
        )
    except (TypeError, ValueError) as exc:
        raise BadRequest(str(exc)) from exc


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def parse_stop(stop: Any) -> tuple[str, ...]:
    """OpenAI's 'stop': a string or a list of non-empty strings."""
    stops = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise BadRequest("'stop' must be a non-empty string or a list of them")
    if len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise BadRequest(f"'stop' takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters")
    return tuple(require_unicode(s, "'stop'") for s in stops)


def parse_int(value: Any, name: str) -> int:
    """An integer field; 4.0 counts, as JSON Schema has it."""
    return _int(value, name)


def _int(value: Any, name: str) -> int:
    # 4.0 is an integer to JSON Schema, OpenAI's and vLLM's parsers alike.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise BadRequest(f"'{name}' must be an integer, got {value!r}")
    return value


def _float(value: Any, name: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise BadRequest(f"'{name}' must be a number, got {value!r}")
    try:
        return float(value)
    except OverflowError:  # an integer literal beyond any float, e.g. 10**400
        raise BadRequest(f"'{name}' is out of range") from None


def _int_list(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise BadRequest(f"'{name}' must be a list of integers")
    return value


def _parse_message(i: int, message: Any, media: list[MediaRef], lookup: FileLookup) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise BadRequest(f"messages[{i}] must be an object")
    role = message.get("role")
    if role not in _ROLES:
        raise BadRequest(f"messages[{i}].role must be one of {', '.join(_ROLES)}, got {role!r}")
    if role == "developer":  # OpenAI's newer name for the system role
        role = "system"
    content = message.get("content")
    out: dict[str, Any] = {"role": role}
    if role == "assistant" and message.get("tool_calls") is not None:
        out["tool_calls"] = _parse_tool_calls(i, message["tool_calls"])
        if content is None:
            content = ""
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise BadRequest(f"messages[{i}].tool_call_id must be the id of the tool call it answers")
        out["tool_call_id"] = call_id
    if isinstance(content, str):
        return out | {"content": require_unicode(content, f"messages[{i}].content")}
    if not isinstance(content, list):
        raise BadRequest(f"messages[{i}].content must be a string or a list of content parts")
    parts = [_parse_part(f"messages[{i}].content[{j}]", p, role, media, lookup) for j, p in enumerate(content)]
    if role == "tool":  # a tool's result is text: its parts are joined
        return out | {"content": "".join(p["text"] for p in parts)}
    return out | {"content": parts}


def _parse_tool_calls(i: int, raw: Any) -> list[dict[str, Any]]:
    """An assistant message's earlier tool calls, for the chat template: OpenAI's
    shape, with ``arguments`` parsed into an object (as Hugging Face templates expect)."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(raw, list):
        raise BadRequest(f"{where} must be an array")
    calls = []
    for j, call in enumerate(raw):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise BadRequest(f"{where}[{j}] must be a function call with a 'function.name'")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            arguments = parse_json_body(arguments or "{}", f"{where}[{j}].function.arguments")
        if not isinstance(arguments, dict):
            raise BadRequest(f"{where}[{j}].function.arguments must be a JSON object")
        call_id = call.get("id")
        calls.append({"id": call_id if isinstance(call_id, str) else "", "type": "function",
                      "function": {"name": require_unicode(function["name"], f"{where}[{j}].function.name"),
                                   "arguments": arguments}})
    return calls


def _parse_part(
    where: str, part: Any, role: str, media: list[MediaRef], lookup: FileLookup
) -> dict[str, Any]:
    if not isinstance(part, dict) or not isinstance(part.get("type"), str):
        raise BadRequest(f"{where} must be an object with a 'type'")
    kind = part["type"]
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise BadRequest(f"{where}.text must be a string")
        return {"type": "text", "text": require_unicode(part["text"], f"{where}.text")}
    if role != "user":
        raise BadRequest(f"{where}: only user messages may carry {kind} parts")
    ref = _media_ref(where, kind, part, lookup)
    media.append(ref)
    return {"type": ref.kind}


def _media_ref(where: str, kind: str, part: dict[str, Any], lookup: FileLookup) -> MediaRef:
    if kind in ("image_url", "video_url"):
        field = part.get(kind)
        url = field.get("url") if isinstance(field, dict) else field
        if not isinstance(url, str) or not url:
            raise BadRequest(f"{where}.{kind}.url must be a string")
        return _from_url(where, url, _PART_KINDS[kind], lookup)
    if kind == "input_audio":
        field = part.get("input_audio")
        if not isinstance(field, dict) or not isinstance(field.get("data"), str):
            raise BadRequest(f"{where}.input_audio.data must be a base64 string")
        return _sniffed(where, _b64(where, field["data"]), "audio", _declared_by_part("audio"))
    if kind == "file":
        field = part.get("file")
        if not isinstance(field, dict):
            raise BadRequest(f"{where}.file must be an object with 'file_id' or 'file_data'")
        if isinstance(field.get("file_id"), str):
            return _from_file(where, field["file_id"], None, lookup)
        if isinstance(field.get("file_data"), str):
            data = field["file_data"]
            if not data.startswith("data:"):
                return _sniffed(where, _b64(where, data), None, None)
            mime, raw = _data_url(where, data)
            return _sniffed(where, raw, None, declared_type(mime))
        raise BadRequest(f"{where}.file must hold 'file_id' or 'file_data'")
    raise BadRequest(f"{where}: unsupported content part type {kind!r}")


def _from_url(where: str, url: str, expected: str, lookup: FileLookup) -> MediaRef:
    if url.startswith("data:"):
        mime, raw = _data_url(where, url)
        return _sniffed(where, raw, expected, declared_type(mime) or _declared_by_part(expected))
    if url.startswith(("http://", "https://", "ftp://", "file:")):
        raise BadRequest(
            f"{where}: remote URLs are not fetched; send the media as a data: URL, "
            "a multipart file part, or a file uploaded with POST /v1/files"
        )
    return _from_file(where, url, expected, lookup)


def _from_file(where: str, file_id: str, expected: str | None, lookup: FileLookup) -> MediaRef:
    stored = lookup(file_id)
    if stored is None:
        raise BadRequest(f"{where}: no uploaded file or multipart part named {file_id!r}")
    if stored.media_kind is None:
        declared = stored.declared or _declared_by_part(expected)
        _refuse_unrecognised(f"{where}: file {file_id!r} ({stored.filename})", stored.head, declared)
    _check_kind(where, stored.media_kind, expected)
    return MediaRef(stored.media_kind, path=stored.path)


def _sniffed(where: str, data: bytes, expected: str | None, declared: DeclaredType | None) -> MediaRef:
    found = sniff_media_kind(data[:SNIFF_BYTES])
    if found is None:
        _refuse_unrecognised(f"{where}: the data", data[:SNIFF_BYTES], declared)
    _check_kind(where, found, expected)
    return MediaRef(found, data=data)


def _declared_by_part(kind: str | None) -> DeclaredType | None:
    return None if kind is None else DeclaredType(kind, f"by its part type {_KIND_PARTS[kind]!r}")


def _refuse_unrecognised(subject: str, head: bytes, declared: DeclaredType | None) -> NoReturn:
    status, message = refusal_for_unrecognised(subject, head, declared)
    raise BadRequest(message) if status == 400 else UnsupportedMedia(message)


def _check_kind(where: str, found: str, expected: str | None) -> None:
    # An image_url holding a video (or the reverse) is a client mistake worth naming.
    if expected is not None and found != expected:
        raise BadRequest(f"{where}: expected {expected} data, got {found}")


def _data_url(where: str, url: str) -> tuple[str, bytes]:
    """(the declared media type, the bytes) of a base64 data: URL."""
    header, sep, payload = url.partition(",")
    if not sep or ";base64" not in header:
        raise BadRequest(f"{where}: data URLs must be base64 ('data:<type>;base64,<data>')")
    return header.removeprefix("data:").split(";", 1)[0], _b64(where, payload)


def _b64(where: str, text: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise BadRequest(f"{where}: invalid base64 data ({exc})") from None
