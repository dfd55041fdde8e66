"""``swallow eval-demo`` and ``swallow demo video-qa``: the demo model through the
server's own path (file parts -> media decode -> embedding cache -> batched
encoders -> chat template -> engine thread), in-process, without HTTP.

The eval writes a held-out world (a seed training never used) to real files,
asks every question greedily under several engine settings, and checks the
answers are identical across them (determinism), then scores them per task.
It also measures how often the MTP layer's one-token draft would be accepted
on the long "Describe the video." answers.
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

import torch

from api.chat import ChatRequest, parse_chat_request
from api.demo.world import TASKS, Sample, answer_matches, make_eval_set, write_media
from api.metrics import ServerMetrics
from api.runtime import ServingModel
from api.server import ChatService
from api.uploads import StoredFile, sniff_media_kind
from llm_core import MultimodalSpan

__all__ = ["ask", "eval_demo"]

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


async def _run_config(
    model_dir: Path, items: list[tuple[Sample, list[Path]]], concurrency: int, prefix_caching: bool
) -> list[_Run]:
    model = ServingModel(model_dir, enable_prefix_caching=prefix_caching, max_running_requests=max(concurrency, 1))
    chat = ChatService(model, ServerMetrics())
    gate = asyncio.Semaphore(concurrency)

    async def one(sample: Sample, files: list[Path]) -> _Run:
        async with gate:
            return await _answer(chat, _request(sample.question, files, 64))

    try:
        return list(await asyncio.gather(*(one(s, f) for s, f in items)))
    finally:
        await model.aclose()


@torch.inference_mode()
def _mtp_acceptance(model_dir: Path, runs: list[_Run]) -> dict[str, float]:
    """Fraction of answer tokens the MTP layer drafts right: from the main model's
    hidden state at t and the input at t+1, is its argmax the token at t+2? The
    inputs are the engine's: token embeddings with the media rows spliced in."""
    from api.demo.train import PackedCausalAttention
    from llm_core.weights import load_model

    llm = load_model(model_dir, torch.device("cpu"), torch.float32)
    hits = total = 0
    for run in runs:
        ids = torch.tensor(run.prompt_ids + run.tokens)
        n = ids.numel()
        embeds = llm.model.embed_tokens(ids)
        for span in run.spans:
            embeds[span.offset : span.end] = span.embeddings.to(embeds.dtype)
        positions = torch.arange(n)
        hidden = llm.model(ids, positions, PackedCausalAttention([n]), inputs_embeds=embeds)
        nxt = torch.cat((embeds[1:], torch.zeros_like(embeds[:1])))
        mtp = llm.model.mtp.layers[0](nxt, hidden, positions, PackedCausalAttention([n]))
        first = len(run.prompt_ids)
        drafts = llm.compute_logits(mtp[first - 1 : n - 2]).argmax(-1)
        hits += int((drafts == ids[first + 1 : n]).sum())
        total += drafts.numel()
    return {"acceptance_rate": round(hits / max(total, 1), 4), "drafts": total}


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
        configs = [(c, p) for p in prefix_caching for c in concurrencies]
        results = {cfg: asyncio.run(_run_config(model_dir, items, *cfg)) for cfg in configs}
    reference = results[configs[0]]
    answers = [r.answer for r in reference]
    identical = {f"concurrency={c},prefix_caching={p}": [r.answer for r in results[(c, p)]] == answers
                 for c, p in configs}
    per_task: dict[str, list[bool]] = defaultdict(list)
    for sample, answer in zip(samples, answers):
        per_task[sample.task].append(answer_matches(answer, sample.answer))
    accuracy = {t: round(sum(v) / len(v), 4) for t, v in sorted(per_task.items())}
    overall = sum(sum(v) for v in per_task.values()) / len(samples)
    describe = [r for s, r in zip(samples, reference) if s.task == "describe"]
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
        "mtp_describe": _mtp_acceptance(model_dir, describe),
        "seconds": round(time.monotonic() - started, 1),
        "examples_wrong": mistakes,
    }
