from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llm_core import LLM, SamplingParams
from llm_core.sample.sampling import SamplingPlan, SamplingRow, sample_token, sample_tokens


@pytest.fixture(scope="module")
def llm(tiny_checkpoint: Path) -> LLM:
    return LLM(tiny_checkpoint)


PROMPTS = [[5, 6, 7, 8], list(range(10, 90)), [300] * 3]


def test_seeded_sampling_is_reproducible_and_batch_invariant(llm: LLM) -> None:
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=1234)
    alone = llm.generate([PROMPTS[1]], params)[0].token_ids
    batched = llm.generate(PROMPTS, [SamplingParams(max_tokens=7), params, SamplingParams(max_tokens=30)])
    assert batched[1].token_ids == alone
    assert llm.generate([PROMPTS[1]], params)[0].token_ids == alone
    other_seed = SamplingParams(max_tokens=20, temperature=1.0, seed=99)
    assert llm.generate([PROMPTS[1]], other_seed)[0].token_ids != alone


def test_top_k_one_and_tiny_top_p_are_greedy(llm: LLM) -> None:
    greedy = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=12))]
    top_k = SamplingParams(max_tokens=12, temperature=0.8, top_k=1, seed=0)
    top_p = SamplingParams(max_tokens=12, temperature=0.8, top_p=1e-6, seed=0)
    assert [o.token_ids for o in llm.generate(PROMPTS, top_k)] == greedy
    assert [o.token_ids for o in llm.generate(PROMPTS, top_p)] == greedy


def test_top_k_and_top_p_restrict_the_support() -> None:
    logits = torch.tensor([5.0, 4.0, 3.0, -1.0, -2.0])
    top_k = SamplingParams(temperature=5.0, top_k=2)
    assert {sample_token(logits, top_k, 0, i) for i in range(200)} == {0, 1}
    # p ~ [.664, .244, .090, .002, .001]: the first two reach 0.9, three reach 0.95.
    top_p = SamplingParams(temperature=1.0, top_p=0.9)
    assert {sample_token(logits, top_p, 0, i) for i in range(400)} == {0, 1}
    top_p = SamplingParams(temperature=1.0, top_p=0.95)
    assert {sample_token(logits, top_p, 0, i) for i in range(400)} == {0, 1, 2}


def test_stop_tokens_and_eos(llm: LLM) -> None:
    free = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    stop_at = free.token_ids[3]
    first = free.token_ids.index(stop_at)
    stopped = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=10, stop_token_ids=[stop_at]))[0]
    assert stopped.token_ids == free.token_ids[: first + 1]
    assert stopped.finish_reason == "stop"
    assert free.finish_reason == "length" and len(free.token_ids) == 10


def test_text_prompts_and_decoded_text(llm: LLM) -> None:
    out = llm.generate("the red circle moves", SamplingParams(max_tokens=5))[0]
    assert out.prompt_token_ids == llm.tokenizer.encode("the red circle moves")
    assert out.text == llm.tokenizer.decode(out.token_ids)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 0}, {"max_tokens": 2.0}, {"max_tokens": True},
        {"temperature": -1.0}, {"temperature": float("nan")}, {"temperature": float("inf")},
        {"temperature": 1e-300}, {"temperature": 1e-38}, {"temperature": 1e-3}, {"temperature": 1e6},
        {"temperature": "1"},
        {"top_p": 0.0}, {"top_p": 1.5}, {"top_p": float("nan")},
        {"top_k": 0}, {"top_k": -5}, {"top_k": 10**12}, {"top_k": 2.0},
        {"seed": 2**70}, {"seed": -(2**63) - 1}, {"seed": 1.5},
        {"stop_token_ids": [-1]}, {"stop_token_ids": [1.0]}, {"stop_token_ids": [True]},
    ],
)
def test_invalid_sampling_params(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_edge_values_that_are_valid() -> None:
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=0.01, seed=-(2**63)).seed == -(2**63)
    assert SamplingParams(temperature=100, seed=2**64 - 1, top_k=2**31 - 1).temperature == 100.0


def test_the_smallest_temperature_samples_finite_probabilities() -> None:
    logits = torch.tensor([80.0, 79.0, -50.0])
    params = SamplingParams(temperature=0.01)
    assert {sample_token(logits, params, 0, i) for i in range(50)} == {0}
    assert sample_token(logits.half(), params, 0, 0) == 0  # low-precision logits are sampled in float32


def test_bad_prompts_are_rejected_with_reasons(llm: LLM) -> None:
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[1, 2, 100000]])
    with pytest.raises(ValueError, match="context length of 8192"):
        llm.generate([[5] * 8000], SamplingParams(max_tokens=500))
    with pytest.raises(ValueError, match="2 sampling params for 3 prompts"):
        llm.generate(PROMPTS, [SamplingParams(), SamplingParams()])


def test_a_top_p_below_float32_resolution_keeps_the_top_token() -> None:
    logits = torch.tensor([1.0, 3.0, 2.0])
    assert sample_token(logits, SamplingParams(temperature=1.0, top_p=5e-324), 0, 0) == 1


def test_draws_follow_the_distribution() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, -3.0])
    params = SamplingParams(temperature=1.0)
    draws = torch.tensor([sample_token(logits, params, 7, i) for i in range(4000)])
    freq = torch.bincount(draws, minlength=5).float() / len(draws)
    assert torch.allclose(freq, logits.softmax(-1), atol=0.025), freq
    hot = torch.tensor([sample_token(logits, SamplingParams(temperature=2.0), 7, i) for i in range(4000)])
    assert torch.allclose(torch.bincount(hot, minlength=5).float() / 4000, (logits / 2).softmax(-1), atol=0.025)


def test_a_row_draws_the_same_whatever_its_batch() -> None:
    vocab = 50
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(0)) * 3
    rows = [
        SamplingRow(SamplingParams(temperature=0.0), 1, 0),
        SamplingRow(SamplingParams(temperature=0.7, seed=5), 5, 3),
        SamplingRow(SamplingParams(temperature=1.3, top_k=4), 9, 0),
        SamplingRow(SamplingParams(temperature=1.0, top_p=0.5), 11, 8),
        SamplingRow(SamplingParams(temperature=1.0, top_k=10, top_p=0.9), 2**64 - 1, 1),
        SamplingRow(SamplingParams(temperature=0.5, top_k=1), -5, 2),
    ]
    together = sample_tokens(logits.clone(), SamplingPlan.build(rows, vocab, "cpu")).tolist()
    alone = [int(sample_tokens(logits[i : i + 1].clone(), SamplingPlan.build([row], vocab, "cpu"))[0])
             for i, row in enumerate(rows)]
    assert together == alone
    assert together[0] == int(logits[0].argmax()) and together[5] == int(logits[5].argmax())
    assert together[2] in logits[2].topk(4).indices.tolist()
    # Another offset or seed is another draw (over many rows, not all equal).
    many = SamplingRow(SamplingParams(temperature=5.0), 3, 0)
    flat = torch.zeros(64, vocab)
    base = sample_tokens(flat.clone(), SamplingPlan.build([many] * 64, vocab, "cpu"))
    assert len(set(base.tolist())) == 1  # same seed and offset: same draw in every row
    shifted = [SamplingRow(many.params, 3, i) for i in range(64)]
    assert len(set(sample_tokens(flat.clone(), SamplingPlan.build(shifted, vocab, "cpu")).tolist())) > 20
