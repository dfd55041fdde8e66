"""``swallow eval-demo`` and ``swallow demo video-qa``: the demo model through the
server's own path (file parts -> media decode -> embedding cache -> batched
encoders -> chat template -> engine thread), in-process, without HTTP.

The eval writes a held-out world (a seed training never used) to real files,
asks every question greedily under several engine settings, and checks the
answers are identical across them (determinism), then scores them per task.
Speculative decoding is on in most settings and off in two: the answers
must not change, and the engine's draft acceptance per position is reported.

Besides the plain questions (the per-task ``accuracy``), every question is asked
in thinking mode (``thinking``: the reasoning exact and the answer right) and
with the video tool listed (``tools``): the file questions must be answered by
the exact call, the call's result (the model's own call, run on the written
file's scene) by the right sentence, and, without the tool, never by a call;
the other questions must keep their answers with the tool listed.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from api.chat import ChatRequest, parse_chat_request
from demo.dialogue import (
    Conversation,
    Mode,
    ToolCall,
    conversation,
    parse_tool_calls,
    split_reasoning,
)
from demo.render import write_media
from demo.tasks import answer_matches, make_eval_set
from demo.tool_spec import VIDEO_PROPERTIES, VIDEO_TOOL_NAME
from demo.world import TASKS, Sample
from api.metrics import ServerMetrics
from api.runtime import ServingModel
from api.chat_service import ChatService
from api.media_sniff import sniff_media_kind
from api.uploads import StoredFile
from llm_core import MultimodalSpan
from llm_core.model.chat import expand_placeholders
from llm_core.model.multimodal import SpanRef

__all__ = ["ask", "ask_many", "eval_demo"]

EVAL_SEED = 1_000_003  # training streams use small seeds; this world is never seen in training


def _stored(path: Path) -> StoredFile:
    with open(path, "rb") as f:
        head = f.read(512)
    return StoredFile(path.name, path, path.name, path.stat().st_size, sniff_media_kind(head), int(time.time()))


def _request(question: str, files: Sequence[Path], max_tokens: int) -> ChatRequest:
    parts = [{"type": "file", "file": {"file_id": p.name}} for p in files]
    body = {
        "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": question}]}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    stored = {p.name: _stored(p) for p in files}
    return parse_chat_request(body, stored.get)


@dataclass(frozen=True)
class _Run:
    answer: str
    prompt_ids: list[int]
    tokens: list[int]
    spans: list[MultimodalSpan]


async def _answer(chat: ChatService, request: ChatRequest, conv: Conversation | None = None) -> _Run:
    if conv is None or not (conv.follow_up or conv.variables):
        prompt_ids, spans = await chat.prompt(request)
    else:
        prompt_ids, spans = await _dialogue_prompt(chat, request, conv)
    text, tokens = "", []
    gen = await chat.open(prompt_ids, request.params, spans, request.stop)
    async for delta, _, tokens in chat.tokens(gen):
        text += delta
    return _Run(text.strip(), prompt_ids, list(tokens), spans)


async def _dialogue_prompt(
    chat: ChatService, request: ChatRequest, conv: Conversation
) -> tuple[list[int], list[MultimodalSpan | SpanRef]]:
    """``ChatService.prompt`` for the user's turn plus the conversation's follow-up
    turns and template variables (tools, thinking): the same media path and
    template, with what the request parser does not carry here."""
    messages, media = await chat.embedded_media(request.messages, request.media)
    text = chat.model.chat_template.render([*messages, *conv.follow_up], **conv.variables)
    tokenizer = chat.model.tokenizer
    assert tokenizer is not None
    ids, offsets = expand_placeholders(tokenizer.encode(text), [(emb.kind, emb.rows) for emb in media],
                                       chat.model.placeholder_ids)
    chat.model.check_length(len(ids), request.params.max_tokens)
    return ids, [emb.span(offset) for offset, emb in zip(offsets, media)]


def ask(model_dir: str | Path, question: str, files: Sequence[str | Path], max_tokens: int = 64) -> str:
    """One question about some media files, answered as the server would."""

    async def run() -> str:
        model = ServingModel(model_dir)
        try:
            chat = ChatService(model, ServerMetrics())
            return (await _answer(chat, _request(question, [Path(f) for f in files], max_tokens))).answer
        finally:
            await model.aclose()

    return asyncio.run(run())


def ask_many(
    model_dir: str | Path, questions: Sequence[tuple[str, Sequence[str | Path]]], max_tokens: int = 64,
    concurrency: int = 16,
) -> list[str]:
    """Several (question, media files) pairs answered as the server would, by one
    model instance, ``concurrency`` at a time (greedy answers don't depend on it)."""

    async def run() -> list[str]:
        model = ServingModel(model_dir, max_running_requests=max(concurrency, 1))
        chat = ChatService(model, ServerMetrics())
        gate = asyncio.Semaphore(concurrency)

        async def one(question: str, files: Sequence[str | Path]) -> str:
            async with gate:
                return (await _answer(chat, _request(question, [Path(f) for f in files], max_tokens))).answer

        try:
            return list(await asyncio.gather(*(one(q, f) for q, f in questions)))
        finally:
            await model.aclose()

    return asyncio.run(run())


@dataclass(frozen=True)
class _Setting:
    concurrency: int
    prefix_caching: bool
    speculative: bool

    @property
    def label(self) -> str:
        return (f"concurrency={self.concurrency},prefix_caching={self.prefix_caching},"
                f"speculative={self.speculative}")


# The other tasks are asked three ways; the file questions with the tool, with it
# and thinking, and without it. The first two are then answered with the result of
# the model's own call (``_round_trip``).
_ASKED = (Mode(), Mode(thinking=True), Mode(tools=True))
_ASKED_ABOUT_THE_FILE = (Mode(tools=True), Mode(tools=True, thinking=True), Mode())
THINKING_MAX_TOKENS = 160  # the longest reasoning and answer (describe) take ~100


@dataclass(frozen=True)
class _Item:
    sample: Sample
    files: list[Path]
    mode: Mode
    call: ToolCall | None = None  # after a tool result: the call the model made

    @property
    def conversation(self) -> Conversation:
        return conversation(self.sample, self.mode, call=self.call)

    @property
    def label(self) -> str:
        return self.mode.label(self.sample.task)


def _first_turns(written: Sequence[tuple[Sample, list[Path]]]) -> list[_Item]:
    return [_Item(sample, files, mode) for sample, files in written
            for mode in (_ASKED_ABOUT_THE_FILE if sample.task == "video_info" else _ASKED)]


def _usable_call(item: _Item, answer: str) -> ToolCall | None:
    """The model's call, if it made exactly one that the client could run."""
    _, content = split_reasoning(answer, item.mode.thinking)
    calls = parse_tool_calls(content)
    if len(calls) != 1 or calls[0].name != VIDEO_TOOL_NAME:
        return None
    call = calls[0]
    return call if list(call.arguments) == ["property"] and call.arguments["property"] in VIDEO_PROPERTIES else None


def _round_trip(item: _Item, answer: str) -> _Item | None:
    """The follow-up of a file question asked with the tool: the model's own call
    and its result (None where there is no usable call: the round trip fails)."""
    if item.sample.task != "video_info" or not item.mode.tools:
        return None
    call = _usable_call(item, answer)
    mode = Mode(tools=True, thinking=item.mode.thinking, tool_result=True)
    return None if call is None else _Item(item.sample, item.files, mode, call)


def is_right(item: _Item, answer: str) -> bool:
    """A call must be exact; an answer in words right as ``answer_matches`` has it,
    with no call in it; a reasoning exact."""
    expected = item.conversation
    thought, content = split_reasoning(answer, item.mode.thinking)
    if thought != expected.reasoning:
        return False
    if item.sample.task == "video_info" and item.mode.tools and not item.mode.tool_result:
        return content == expected.content
    return "<tool_call>" not in answer and answer_matches(content, expected.content)


@dataclass(frozen=True)
class _Asked:
    """Every first turn's answer, and each round trip's (None: no usable call)."""

    first: list[tuple[_Item, str]]
    follow_ups: list[tuple[_Item, _Item | None, str | None]]  # (first turn, round trip, answer)

    def answers(self) -> list[str | None]:
        return [a for _, a in self.first] + [a for _, _, a in self.follow_ups]


async def _run_config(model_dir: Path, items: list[_Item], setting: _Setting,
                      engine_options: Mapping[str, Any]) -> tuple[_Asked, dict[str, Any]]:
    """Every item's answer under one engine setting, then the round trips, and the
    engine's MTP draft statistics over them."""
    model = ServingModel(model_dir, enable_prefix_caching=setting.prefix_caching,
                         max_running_requests=max(setting.concurrency, 1),
                         speculative_tokens=None if setting.speculative else 0, **engine_options)
    chat = ChatService(model, ServerMetrics())
    gate = asyncio.Semaphore(setting.concurrency)

    async def one(item: _Item) -> str:
        max_tokens = THINKING_MAX_TOKENS if item.mode.thinking else 64
        async with gate:
            run = await _answer(chat, _request(item.sample.question, item.files, max_tokens), item.conversation)
            return run.answer

    async def follow(item: _Item | None) -> str | None:
        return None if item is None else await one(item)

    try:
        first = list(zip(items, await asyncio.gather(*(one(i) for i in items))))
        trips = [(item, _round_trip(item, answer)) for item, answer in first if item.sample.task == "video_info"
                 and item.mode.tools]
        answers = await asyncio.gather(*(follow(trip) for _, trip in trips))
        follow_ups = [(item, trip, answer) for (item, trip), answer in zip(trips, answers)]
        return _Asked(first, follow_ups), model.llm.stats()["speculative"]
    finally:
        await model.aclose()


def _settings(concurrencies: Sequence[int], prefix_caching: Sequence[bool]) -> list[_Setting]:
    """Speculation on under every (concurrency, prefix caching) pair, off under
    the first and the last: the answers must be the same under all."""
    on = [_Setting(c, p, True) for p in prefix_caching for c in concurrencies]
    off = [_Setting(on[0].concurrency, on[0].prefix_caching, False)]
    if len(on) > 1:
        off.append(_Setting(on[-1].concurrency, on[-1].prefix_caching, False))
    return on + off


def _rate(flags: Sequence[bool]) -> float:
    return round(sum(flags) / len(flags), 4) if flags else 0.0


def _scores(asked: _Asked) -> dict[str, list[bool]]:
    """Right or wrong per item, by label (``Mode.label``): round trips whose call was
    unusable count as wrong."""
    scores: dict[str, list[bool]] = defaultdict(list)
    for item, answer in asked.first:
        scores[item.label].append(is_right(item, answer))
    for item, trip, answer in asked.follow_ups:
        mode = Mode(tools=True, thinking=item.mode.thinking, tool_result=True)
        scores[mode.label("video_info")].append(trip is not None and answer is not None and is_right(trip, answer))
    return scores


def _report(asked: _Asked) -> dict[str, Any]:
    scores = _scores(asked)
    plain = {t: scores[Mode().label(t)] for t in TASKS if t != "video_info"}
    # A file question's plain score is the call it is asked for, with the tool listed.
    accuracy = {t: _rate(v) for t, v in sorted({**plain, "video_info": scores["tool_call"]}.items())}
    thinking = {t: _rate(scores[Mode(tools=t == "video_info", thinking=True).label(t)]) for t in sorted(TASKS)}
    without_tools = [answer for item, answer in asked.first if not item.mode.tools]
    return {
        "accuracy": accuracy,
        "overall_accuracy": _rate([ok for v in [*plain.values(), scores["tool_call"]] for ok in v]),
        "worst_task_accuracy": min(accuracy.values()),
        "tools": {
            "call_exact": accuracy["video_info"],
            "round_trip": _rate(scores["tool_reply"]),
            "call_exact_thinking": _rate(scores["tool_call+think"]),
            "round_trip_thinking": _rate(scores["tool_reply+think"]),
            "without_tool_no_call": _rate(scores["tool_absent"]),  # and says it cannot tell
            "other_tasks_with_tool_listed": _rate([ok for t in plain for ok in scores[f"{t}+tools"]]),
            "no_call_in_any_answer_without_tools": _rate(["<tool_call>" not in a for a in without_tools]),
        },
        "thinking": {
            "accuracy": thinking,
            "overall_accuracy": _rate([ok for label, v in scores.items() if label.endswith("+think") for ok in v]),
            "worst_task_accuracy": min(thinking.values()),
        },
    }


def _mistakes(asked: _Asked, limit: int = 10) -> list[dict[str, str]]:
    wrong = [(item, answer) for item, answer in asked.first if not is_right(item, answer)]
    wrong += [(trip or item, answer or "(no usable call)") for item, trip, answer in asked.follow_ups
              if trip is None or answer is None or not is_right(trip, answer)]
    return [{"task": item.sample.task, "asked": item.label, "question": item.sample.question,
             "expected": item.conversation.output,
             "got": answer} for item, answer in wrong[:limit]]


def eval_demo(
    model_dir: str | Path,
    *,
    seed: int = EVAL_SEED,
    per_task: int = 34,
    concurrencies: Sequence[int] = (1, 16),
    prefix_caching: Sequence[bool] = (True, False),
    engine_options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """``engine_options``: more ``LLM`` options for every setting (e.g. ``kv_cache_dtype``)."""
    model_dir = Path(model_dir)
    samples = make_eval_set(seed, per_task)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="swallow-eval-") as tmp:
        items = _first_turns([(s, write_media(s, Path(tmp), f"item{i:04d}")) for i, s in enumerate(samples)])
        settings = _settings(concurrencies, prefix_caching)
        outcomes = {setting: asyncio.run(_run_config(model_dir, items, setting, engine_options or {}))
                    for setting in settings}
    reference = outcomes[settings[0]][0]
    identical = {setting.label: asked.answers() == reference.answers() for setting, (asked, _) in outcomes.items()}
    spec = outcomes[settings[0]][1]
    return {
        "eval_seed": seed,
        "items": len(samples),
        "questions_asked": len(reference.answers()),
        "tasks": list(TASKS),
        **_report(reference),
        "identical_answers_across_settings": identical,
        # Measured by the engine while answering (speculation on, first setting).
        "mtp": {key: spec[key] for key in ("num_speculative_tokens", "acceptance_rate_per_position",
                                           "mean_acceptance_length", "drafts_proposed", "drafts_accepted")},
        "seconds": round(time.monotonic() - started, 1),
        "examples_wrong": _mistakes(reference),
    }
