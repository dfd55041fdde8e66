"""A compiled engine compiles every graph at construction (the warm-up), and
then no workload compiles another: mixed lengths on both sides of the dense
threshold, one-token prompts and full prefix hits, staggered arrivals,
media spans, sampling with drafts -- and generates what the eager engine does."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from llm_core.loading.checkpoint import write_random_checkpoint
from llm_core.llm import LLM
from llm_core.model.multimodal import MultimodalSpan
from llm_core.model.presets import tiny
from llm_core.sample.params import SamplingParams
from llm_core.warmup import CompileCounter


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = replace(tiny(), num_hidden_layers=2, layer_types=("full", "sliding"), mlp_layer_types=("dense", "sparse"))
    return write_random_checkpoint(tmp_path_factory.mktemp("warmup") / "model", config, seed=5)


def _workload(vocab: int, hidden: int, seed: int) -> list[tuple[list[int], SamplingParams, list[MultimodalSpan]]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(40)]
    out = []
    for i in range(14):
        length = rng.choice([1, 2, 3, 15, 16, 17, 40, 200, 257, 300, 600])
        prompt = [rng.randrange(3, vocab) for _ in range(length)]
        if i % 5 == 4:
            prompt = list(shared)  # the same prompt again: a full prefix hit, one token computed
        temperature = 0.0 if i % 3 else 0.8
        params = SamplingParams(max_tokens=rng.randint(1, 24), temperature=temperature, seed=i, ignore_eos=True)
        spans = []
        if i % 4 == 1 and length >= 3:
            rows = torch.randn(length // 2, hidden, generator=torch.Generator().manual_seed(i))
            spans = [MultimodalSpan(1, rows, f"media-{i}".encode())]
        out.append((prompt, params, spans))
    return out


def _run_staggered(llm: LLM, workload: list) -> dict[int, list[int]]:  # noqa: ANN401
    tokens: dict[int, list[int]] = {}
    pending = list(enumerate(workload))
    live: dict[int, int] = {}
    steps = 0
    while pending or live:
        if pending and steps % 3 == 0:
            index, (prompt, params, spans) = pending.pop(0)
            live[llm.add_request(prompt, params, spans)] = index
        for event in llm.step():
            index = live[event.request_id]
            tokens.setdefault(index, []).append(event.token)
            if event.finish_reason is not None:
                del live[event.request_id]
        steps += 1
    return tokens


def test_nothing_compiles_after_the_warm_up(small_checkpoint: Path) -> None:
    llm = LLM(small_checkpoint, compile=True)
    assert llm.warmup is not None and llm.warmup.graphs > 0
    stats = llm.stats()
    # The warm-up's requests are gone: nothing cached, nothing counted, every slot free.
    assert stats["prefix_cache"]["computed_prompt_tokens"] == 0
    assert stats["full_pool"]["free_tokens"] == stats["full_pool"]["capacity_tokens"]
    workload = _workload(llm.config.vocab_size, llm.config.hidden_size, seed=1)
    before = CompileCounter.compiled()
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = _run_staggered(llm, workload)
    assert CompileCounter.compiled() == before
    assert llm.stats()["compile"]["recompiles_after_ready"] == 0
    eager = _run_staggered(LLM(small_checkpoint), workload)
    greedy = [i for i, (_, params, _) in enumerate(workload) if params.temperature == 0.0]
    assert [compiled[i] for i in greedy] == [eager[i] for i in greedy]
