"""The client side of `swallow bench stack`: every user's conversation of the
workload against a live stack at once, each turn streamed from
/v1/chat/completions with its media file uploaded, one ``TurnResult`` per
turn sent. TTFT and latency are the client's.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.stack_workload import Conversation, Workload, WorkloadConfig, messages_for_turn

__all__ = ["TurnResult", "run_workload"]


@dataclass
class TurnResult:
    user: int
    turn: int
    status: int | None = None
    worker: str | None = None
    answer: str | None = None
    error: str | None = None
    sent_s: float = 0.0  # since the workload started
    ttft_s: float | None = None  # request sent -> first chunk carrying text
    latency_s: float | None = None  # request sent -> [DONE]
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    media: tuple[str, ...] = ()  # clip name per media item the request carries
    finish_reason: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.answer is not None


def _upload_parts(conv: Conversation) -> list[dict[str, Any]]:
    return [{"type": "file", "file": {"file_id": "m0"}}] if conv.clip is not None else []


async def run_workload(base_url: str, workload: Workload, files: Mapping[str, Path],
                       request_timeout_s: float = 180.0) -> list[TurnResult]:
    """Every user's conversation, concurrently; one result per turn sent."""
    results: list[TurnResult] = []
    limits = httpx.Limits(max_connections=len(workload.conversations) + 4)
    timeout = httpx.Timeout(request_timeout_s, connect=30.0, pool=None)
    started = time.perf_counter()
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=timeout) as client:
        await asyncio.gather(*(_converse(client, conv, workload.config, files, started, results)
                               for conv in workload.conversations))
    return sorted(results, key=lambda r: (r.user, r.turn))


async def _converse(client: httpx.AsyncClient, conv: Conversation, config: WorkloadConfig,
                    files: Mapping[str, Path], started: float, results: list[TurnResult]) -> None:
    await asyncio.sleep(max(0.0, conv.start_s - (time.perf_counter() - started)))
    data = files[conv.clip.name].read_bytes() if conv.clip is not None else None
    answers: list[str] = []
    for turn in range(len(conv.questions)):
        messages = messages_for_turn(conv, turn, answers, config.system_prompt, _upload_parts(conv))
        body = {"messages": messages, "max_tokens": config.max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        uploads: list[tuple[str, tuple[Any, ...]]] = [("request", (None, json.dumps(body), "application/json"))]
        if conv.clip is not None and data is not None:
            uploads.append(("m0", (files[conv.clip.name].name, data)))
        result = TurnResult(conv.user, turn, sent_s=round(time.perf_counter() - started, 4),
                            media=tuple(conv.clip.name for _ in conv.clip.kinds) if conv.clip is not None else ())
        results.append(result)
        try:
            await _stream_turn(client, uploads, result)
        except httpx.HTTPError as exc:
            result.error = f"{type(exc).__name__}: {exc}"
        if not result.ok:
            return  # the history would differ from here on: the conversation ends
        assert result.answer is not None
        answers.append(result.answer)
        if turn < len(conv.think_s):
            await asyncio.sleep(conv.think_s[turn])


async def _stream_turn(client: httpx.AsyncClient, uploads: list[tuple[str, tuple[Any, ...]]],
                       result: TurnResult) -> None:
    sent = time.perf_counter()
    async with client.stream("POST", "/v1/chat/completions", files=uploads) as response:
        result.status = response.status_code
        result.worker = response.headers.get("x-swallow-worker")
        if response.status_code != 200:
            result.error = (await response.aread()).decode(errors="replace")[:300]
            return
        text = ""
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                result.latency_s = time.perf_counter() - sent
                result.answer = text
                return
            payload = json.loads(data)
            if "error" in payload:
                result.error = json.dumps(payload["error"])[:300]
                return
            if payload.get("usage"):
                result.prompt_tokens = payload["usage"]["prompt_tokens"]
                result.completion_tokens = payload["usage"]["completion_tokens"]
            for choice in payload.get("choices", []):
                delta = choice.get("delta", {}).get("content") or ""
                if (delta or choice.get("finish_reason")) and result.ttft_s is None:
                    result.ttft_s = time.perf_counter() - sent
                text += delta
                result.finish_reason = choice.get("finish_reason") or result.finish_reason
    result.error = "the stream ended without [DONE]"
