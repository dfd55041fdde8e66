"""Determinism contract and memory invariants of the paged continuous-batching engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llm_core import LLM, SamplingParams
from tests.conftest import REF_WINDOW, assert_pools_full, hf_greedy_outputs

MAX_NEW = 3 * REF_WINDOW
# Shorter and much longer than the window W=8.
LENGTHS = [3, 70, REF_WINDOW, 21, 1, REF_WINDOW + 1, 130, 45]
PROMPTS = [
    torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(500 + i)).tolist()
    for i, n in enumerate(LENGTHS)
]


@pytest.fixture(scope="module")
def reference(hf_model) -> list[list[int]]:
    """transformers greedy output for every prompt, computed once."""
    return hf_greedy_outputs(hf_model, PROMPTS, MAX_NEW)


@pytest.mark.parametrize("swa_mode", ["hybrid", "full"])
@pytest.mark.parametrize("chunk", [5, 1024])
def test_every_batch_size_matches_transformers(hf_checkpoint: Path, reference, swa_mode: str, chunk: int) -> None:
    llm = LLM(hf_checkpoint, swa_mode=swa_mode, chunked_prefill_size=chunk, max_num_batched_tokens=max(chunk, 64))
    for batch in range(1, 9):
        outputs = llm.generate(PROMPTS[:batch], SamplingParams(max_tokens=MAX_NEW))
        assert [o.token_ids for o in outputs] == reference[:batch], f"batch {batch}"
    assert_pools_full(llm)


def test_requests_arriving_while_others_decode(hf_checkpoint: Path, reference) -> None:
    llm = LLM(hf_checkpoint, chunked_prefill_size=16, max_num_batched_tokens=32)
    params = SamplingParams(max_tokens=MAX_NEW)
    tokens: dict[int, list[int]] = {}
    ids = {llm.add_request(PROMPTS[i], params): i for i in (0, 1)}
    pending = list(range(2, 8))
    steps = 0
    while len(tokens) < 8 or any(len(t) < MAX_NEW for t in tokens.values()):
        if pending and steps % 3 == 2:  # one new arrival every few steps, mid-decode
            i = pending.pop(0)
            ids[llm.add_request(PROMPTS[i], params)] = i
        for event in llm.step():
            tokens.setdefault(ids[event.request_id], []).append(event.token)
        steps += 1
        assert steps < 1000
    assert [tokens[i] for i in range(8)] == reference
    assert_pools_full(llm)


def test_preemption_under_memory_pressure_keeps_outputs(hf_checkpoint: Path, reference) -> None:
    # A full pool of ~200 tokens for 471 tokens of requests: decodes run out and preempt.
    probe = LLM(hf_checkpoint).stats()
    swa_tokens = 8 * (REF_WINDOW + 16) + 64  # window + page per request, one step of chunks
    budget = probe["full_pool"]["bytes_per_token"] * 200 + probe["swa_pool"]["bytes_per_token"] * swa_tokens
    llm = LLM(hf_checkpoint, kv_budget_bytes=budget, max_running_requests=8, chunked_prefill_size=32,
              max_num_batched_tokens=64)
    assert llm.stats()["full_pool"]["capacity_tokens"] < 200
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW))
    assert [o.token_ids for o in outputs] == reference
    assert llm.stats()["preemptions"] > 0
    assert_pools_full(llm)


def test_swa_slots_per_request_stay_within_window_chunk_and_page(hf_checkpoint: Path) -> None:
    chunk, page = 16, 4
    llm = LLM(hf_checkpoint, chunked_prefill_size=chunk, max_num_batched_tokens=64, page_size=page)
    engine = llm.engine
    peaks: list[int] = []
    forward = engine.runner.logits

    def spying_forward(chunks):  # sample while the step's slots are held
        peaks.extend(c.seq.view.swa_slots_held for c in chunks)
        return forward(chunks)

    engine.runner.logits = spying_forward  # type: ignore[method-assign]
    long_prompts = [p * 4 for p in PROMPTS[:4]]
    llm.generate(long_prompts, SamplingParams(max_tokens=60))
    assert max(peaks) <= REF_WINDOW + chunk + page
    assert max(peaks) > REF_WINDOW  # the bound is met while really prefilling in chunks
    assert_pools_full(llm)


def test_abort_mid_prefill_and_mid_decode_frees_every_slot(hf_checkpoint: Path) -> None:
    llm = LLM(hf_checkpoint, chunked_prefill_size=8, max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=50)
    long_id = llm.add_request(PROMPTS[6] * 3, params)  # 390 tokens: many chunks
    short_id = llm.add_request(PROMPTS[0], params)
    seen: dict[int, int] = {}
    for _ in range(6):
        for event in llm.step():
            seen[event.request_id] = seen.get(event.request_id, 0) + 1
    assert seen.get(short_id, 0) > 0 and long_id not in seen  # one decoding, one prefilling
    assert llm.stats()["full_pool"]["free_tokens"] < llm.stats()["full_pool"]["capacity_tokens"]
    assert llm.abort(long_id) and llm.abort(short_id)
    assert not llm.abort(short_id)
    assert not llm.engine.has_unfinished()
    assert_pools_full(llm)


def test_stats_report_both_pools(hf_checkpoint: Path) -> None:
    stats = LLM(hf_checkpoint, kv_budget_bytes=32 << 20).stats()
    assert stats["swa_mode"] == "hybrid"
    full, swa = stats["full_pool"], stats["swa_pool"]
    # 2 full layers x 1 KV head x (32 + 16) x 4 bytes; 3 SWA + 1 MTP layers x 2 heads,
    # and the target's hidden state (64) the MTP layer drafts from.
    assert full["bytes_per_token"] == 2 * 1 * 48 * 4
    assert swa["bytes_per_token"] == (4 * 2 * 48 + 64) * 4
    # (window + page + the one draft) per request + a step
    assert swa["capacity_tokens"] == 64 * (REF_WINDOW + 17) + 4096
    assert full["capacity_tokens"] * full["bytes_per_token"] + swa["capacity_tokens"] * swa["bytes_per_token"] <= 32 << 20


def test_request_larger_than_the_pool_is_refused(hf_checkpoint: Path) -> None:
    llm = LLM(hf_checkpoint, kv_budget_bytes=1 << 20)
    capacity = llm.stats()["full_pool"]["capacity_tokens"]
    with pytest.raises(ValueError, match="more KV memory than the pool holds"):
        llm.generate([[5] * capacity], SamplingParams(max_tokens=10))
    assert_pools_full(llm)
