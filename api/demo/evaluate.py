"""``swallow eval-demo`` and ``swallow demo video-qa``: the demo model through the
server's own path (file parts -> media decode -> embedding cache -> batched
encoders -> chat template -> engine thread), in-process, without HTTP.

The eval writes a held-out world (a seed training never used) to real files,
asks every question greedily under several engine settings, and checks the
answers are identical across them (determinism), then scores them per task.
Speculative decoding is on in most settings and off in two: the answers
must not change, and the engine's draft acceptance per position is reported.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


from api.chat import ChatRequest, parse_chat_request
from api.demo.world import TASKS, Sample, answer_matches, make_eval_set, write_media
from api.metrics import ServerMetrics
from api.runtime import ServingModel
from api.server import ChatService
from api.uploads import StoredFile, sniff_media_kind
from llm_core import MultimodalSpan

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


async def _answer(chat: ChatService, request: ChatRequest) -> _Run:
    prompt_ids, spans = await chat.prompt(request)
    text, tokens = "", []
    gen = await chat.open(prompt_ids, request.params, spans, request.stop)
    async for delta, _, tokens in chat.tokens(gen):
        text += delta
    return _Run(text.strip(), prompt_ids, list(tokens), spans)


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


async def _run_config(model_dir: Path, items: list[tuple[Sample, list[Path]]],
                      setting: _Setting) -> tuple[list[_Run], dict[str, Any]]:
    """Every item's answer under one engine setting, and the engine's MTP
    draft statistics over them."""
    model = ServingModel(model_dir, enable_prefix_caching=setting.prefix_caching,
                         max_running_requests=max(setting.concurrency, 1),
                         speculative_tokens=None if setting.speculative else 0)
    chat = ChatService(model, ServerMetrics())
    gate = asyncio.Semaphore(setting.concurrency)

    async def one(sample: Sample, files: list[Path]) -> _Run:
        async with gate:
            return await _answer(chat, _request(sample.question, files, 64))

    try:
        runs = list(await asyncio.gather(*(one(s, f) for s, f in items)))
        return runs, model.llm.stats()["speculative"]
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


def eval_demo(
    model_dir: str | Path,
    *,
    seed: int = EVAL_SEED,
    per_task: int = 34,
    concurrencies: Sequence[int] = (1, 16),
    prefix_caching: Sequence[bool] = (True, False),
) -> dict[str, Any]:
    model_dir = Path(model_dir)
    samples = make_eval_set(seed, per_task)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="swallow-eval-") as tmp:
        items = [(s, write_media(s, Path(tmp), f"item{i:04d}")) for i, s in enumerate(samples)]
        settings = _settings(concurrencies, prefix_caching)
        outcomes = {setting: asyncio.run(_run_config(model_dir, items, setting)) for setting in settings}
    results = {setting: runs for setting, (runs, _) in outcomes.items()}
    reference = results[settings[0]]
    answers = [r.answer for r in reference]
    identical = {setting.label: [r.answer for r in runs] == answers for setting, runs in results.items()}
    spec = outcomes[settings[0]][1]
    per_task: dict[str, list[bool]] = defaultdict(list)
    for sample, answer in zip(samples, answers):
        per_task[sample.task].append(answer_matches(answer, sample.answer))
    accuracy = {t: round(sum(v) / len(v), 4) for t, v in sorted(per_task.items())}
    overall = sum(sum(v) for v in per_task.values()) / len(samples)
    mistakes = [{"task": s.task, "question": s.question, "expected": s.answer, "got": a}
                for s, a in zip(samples, answers) if not answer_matches(a, s.answer)][:10]
    return {
        "eval_seed": seed,
        "items": len(samples),
        "tasks": list(TASKS),
        "accuracy": accuracy,
        "overall_accuracy": round(overall, 4),
        "worst_task_accuracy": min(accuracy.values()),
        "identical_answers_across_settings": identical,
        # Measured by the engine while answering (speculation on, first setting).
        "mtp": {key: spec[key] for key in ("num_speculative_tokens", "acceptance_rate_per_position",
                                           "mean_acceptance_length", "drafts_proposed", "drafts_accepted")},
        "seconds": round(time.monotonic() - started, 1),
        "examples_wrong": mistakes,
    }
