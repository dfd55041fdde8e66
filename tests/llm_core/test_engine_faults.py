"""Fault isolation in the engine: a failure that belongs to one request ends that
request alone; every other request gets exactly the tokens it gets without it,
and every pool is back at capacity afterwards."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from llm_core import LLM, MultimodalSpan, SamplingParams
from llm_core import step_sampler as sampler_module
from llm_core.engine import EngineFault
from llm_core.sample.sampling import SamplingPlan

PROMPTS = [list(range(10, 10 + n)) for n in (6, 45, 17, 90, 3, 30)]
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


class UnreadableRows(torch.Tensor):
    """Embeddings that pass admission (shape, dtype, finite) but raise when the
    forward reads their rows: a fault injected into one request's step."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.Tensor.__getitem__:
            raise RuntimeError("injected fault: span rows unreadable")
        return super().__torch_function__(func, types, args, kwargs or {})


def _bad_span(llm: LLM, offset: int, length: int) -> MultimodalSpan:
    rows = torch.zeros(length, llm.config.hidden_size).as_subclass(UnreadableRows)
    return MultimodalSpan(offset, rows, b"unreadable")


def _at_capacity(llm: LLM) -> bool:
    s = llm.stats()
    return (s["full_pool"]["free_tokens"] == s["full_pool"]["capacity_tokens"]
            and s["swa_pool"]["free_tokens"] == s["swa_pool"]["capacity_tokens"])


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("chunked_prefill_size", [1024, 16])
def test_a_span_that_fails_in_the_forward_fails_only_its_request(
    tiny_checkpoint: Path, caching: bool, chunked_prefill_size: int
) -> None:
    llm = LLM(tiny_checkpoint, enable_prefix_caching=caching, chunked_prefill_size=chunked_prefill_size)
    expected = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    bad_prompt = list(range(50, 90))
    prompts = PROMPTS[:3] + [bad_prompt] + PROMPTS[3:]
    spans = [[]] * 3 + [[_bad_span(llm, 5, 20)]] + [[]] * 3
    outputs = llm.generate(prompts, GREEDY, mm_spans=spans)
    bad = outputs.pop(3)
    assert bad.finish_reason == "error" and "injected fault" in (bad.error or "") and bad.token_ids == []
    assert [o.token_ids for o in outputs] == expected
    assert all(o.error is None for o in outputs)
    llm.flush_cache()
    assert _at_capacity(llm)
    # The engine goes on serving, and nothing of the failed request was cached.
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected


def test_a_row_that_cannot_be_sampled_fails_only_its_request(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = LLM(tiny_checkpoint, enable_prefix_caching=False)
    expected = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    doomed_seed = 666
    real_sample = sampler_module.sample_tokens

    def sample_tokens(logits: torch.Tensor, plan: SamplingPlan) -> torch.Tensor:
        if bool((plan.seed_lo == doomed_seed).any()):  # as if that row's logits were NaN
            raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
        return real_sample(logits, plan)

    monkeypatch.setattr(sampler_module, "sample_tokens", sample_tokens)
    doomed = SamplingParams(max_tokens=12, temperature=1.0, seed=doomed_seed)
    outputs = llm.generate(PROMPTS + [[5] * 12], [GREEDY] * len(PROMPTS) + [doomed])
    bad = outputs.pop()
    assert bad.finish_reason == "error" and "probability tensor" in (bad.error or "")
    assert [o.token_ids for o in outputs] == expected
    assert _at_capacity(llm)


def test_a_failure_no_request_explains_raises_engine_fault(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = LLM(tiny_checkpoint)
    llm.add_request(PROMPTS[0], GREEDY)

    def broken_schedule() -> None:
        raise RuntimeError("scheduler bookkeeping broke")

    monkeypatch.setattr(llm.engine.scheduler, "schedule", broken_schedule)
    with pytest.raises(RuntimeError, match="bookkeeping"):
        llm.step()
    llm.reset_engine()
    assert not llm.engine.has_unfinished() and _at_capacity(llm)
    assert llm.generate([PROMPTS[1]], GREEDY)[0].token_ids == LLM(tiny_checkpoint).generate([PROMPTS[1]], GREEDY)[0].token_ids


def test_engine_fault_is_a_runtime_error() -> None:
    assert issubclass(EngineFault, RuntimeError)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"stop_token_ids": [10**6]}, "outside the vocabulary"),
        ({"top_k": 10**6}, "vocabulary size"),
    ],
)
def test_token_parameters_are_checked_against_the_vocabulary(tiny_checkpoint: Path, kwargs: dict, match: str) -> None:
    llm = LLM(tiny_checkpoint)
    with pytest.raises(ValueError, match=match):
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4, **kwargs))
    with pytest.raises(ValueError, match=match):
        llm.add_request(PROMPTS[0], SamplingParams(max_tokens=4, **kwargs))
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("bad_id", [-1, 10**6])
def test_prompt_ids_outside_the_vocabulary_are_refused_at_admission(tiny_checkpoint: Path, bad_id: int) -> None:
    """Not a step that fails later on an embedding lookup: the add itself is refused."""
    llm = LLM(tiny_checkpoint)
    with pytest.raises(ValueError, match=rf"prompt token ids \[{bad_id}\] are outside the vocabulary"):
        llm.add_request([*PROMPTS[0], bad_id], SamplingParams(max_tokens=4))
    assert not llm.engine.has_unfinished() and _at_capacity(llm)
