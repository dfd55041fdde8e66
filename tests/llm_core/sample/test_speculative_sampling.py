"""Speculative rejection sampling keeps the target's distribution.

A two-token world on a tiny vocabulary: the target's p(x1) and p(x2 | x1), a
deliberately different draft q. Over many seeds (one batched pass, a row
per seed, as the engine samples), the first two tokens produced with drafts
must be distributed as p(x1) p(x2 | x1): a chi-square test at a fixed
significance. The same test must reject a broken acceptance rule.
"""

from __future__ import annotations

import pytest
import torch

import llm_core.sample.sampling as sampling
from llm_core.sample.params import SamplingParams
from llm_core.sample.sampling import SamplingPlan, SamplingRow, draw_drafts, sample_tokens, verify_drafts

VOCAB = 4
SEEDS = 12_000
Z_0_001 = 3.0902  # the standard normal's upper 0.001 quantile: the test's significance


def chi2_critical(dof: int) -> float:
    """The chi-square critical value at significance 0.001 (Wilson-Hilferty:
    37.7 for 15 degrees of freedom, within 0.2 of the table)."""
    c = 2.0 / (9.0 * dof)
    return dof * (1.0 - c + Z_0_001 * c**0.5) ** 3


_gen = torch.Generator().manual_seed(3)
TARGET_FIRST = torch.randn(VOCAB, generator=_gen) * 1.5
TARGET_NEXT = torch.randn(VOCAB, VOCAB, generator=_gen) * 1.5  # row x1: logits of x2
TARGET_THIRD = torch.randn(VOCAB, VOCAB, generator=_gen)  # row x2: logits of x3 (only verified past)
DRAFT_FIRST = torch.randn(VOCAB, generator=_gen) * 1.5
DRAFT_NEXT = torch.randn(VOCAB, VOCAB, generator=_gen) * 1.5


def _first_two_tokens(params: SamplingParams) -> torch.Tensor:
    """[SEEDS, 2]: each seed's first two tokens through draft, verify and (when
    the verify stopped after one token) the next step's plain sampling."""
    rows = [SamplingRow(params, seed, 0) for seed in range(SEEDS)]
    plan = SamplingPlan.build(rows, VOCAB, "cpu")
    d1, q1 = draw_drafts(DRAFT_FIRST.expand(SEEDS, VOCAB).clone(), plan, 0)
    d2, q2 = draw_drafts(DRAFT_NEXT[d1], plan, 1)
    logits = torch.stack((TARGET_FIRST.expand(SEEDS, VOCAB), TARGET_NEXT[d1], TARGET_THIRD[d2]), dim=1)
    assert q1 is not None and q2 is not None
    tokens, accepted = verify_drafts(logits, torch.stack((d1, d2), dim=1), torch.full((SEEDS,), 2),
                                     torch.stack((q1, q2), dim=1), plan)
    x1 = tokens[:, 0]
    # One token only: the second comes from the next step, sampled at offset 1.
    later = SamplingPlan.build([SamplingRow(params, seed, 1) for seed in range(SEEDS)], VOCAB, "cpu")
    x2 = torch.where(accepted >= 1, tokens[:, 1], sample_tokens(TARGET_NEXT[x1], later))
    return torch.stack((x1, x2), dim=1)


def _expected(params: SamplingParams) -> torch.Tensor:
    """[VOCAB, VOCAB]: p(x1) p(x2 | x1) under the request's temperature and filters."""
    def dist(logits: torch.Tensor) -> torch.Tensor:
        plan = SamplingPlan.build([SamplingRow(params, 0, 0)] * logits.shape[0], VOCAB, "cpu")
        return sampling.filter_logits(logits / params.temperature, plan.top_k, plan.top_p).softmax(-1)

    return dist(TARGET_FIRST[None])[0][:, None] * dist(TARGET_NEXT)


def _chi_square(pairs: torch.Tensor, expected: torch.Tensor) -> float:
    counts = torch.bincount(pairs[:, 0] * VOCAB + pairs[:, 1], minlength=VOCAB * VOCAB).double()
    want = expected.flatten().double() * pairs.shape[0]
    cells = want > 0
    assert counts[~cells].sum() == 0, "a token outside the filtered set was produced"
    return float(((counts[cells] - want[cells]) ** 2 / want[cells]).sum())


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=3),
    SamplingParams(temperature=1.3, top_p=0.8),
], ids=["plain", "top_k", "top_p"])
def test_speculative_sampling_keeps_the_target_distribution(params: SamplingParams) -> None:
    pairs = _first_two_tokens(params)
    expected = _expected(params)
    dof = int((expected > 0).sum()) - 1
    statistic = _chi_square(pairs, expected)
    assert statistic < chi2_critical(dof), (statistic, dof)


def test_a_broken_acceptance_rule_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    params = SamplingParams(temperature=1.0)
    # Accepting every draft (a uniform of 0 always passes u * q < p): the output is the draft's.
    monkeypatch.setattr(sampling, "_uniforms", lambda plan, count, stream: torch.zeros(plan.offset.shape[0], count))
    assert _chi_square(_first_two_tokens(params), _expected(params)) > 10 * chi2_critical(15)


def test_the_draft_distribution_and_acceptance_are_independent_streams() -> None:
    params = SamplingParams(temperature=1.0)
    rows = [SamplingRow(params, seed, 0) for seed in range(SEEDS)]
    plan = SamplingPlan.build(rows, VOCAB, "cpu")
    drafts, _ = draw_drafts(DRAFT_FIRST.expand(SEEDS, VOCAB).clone(), plan, 0)
    plain = sample_tokens(DRAFT_FIRST.expand(SEEDS, VOCAB).clone(), plan)
    # Same logits, same seed and offset: a draft is not the token plain sampling draws.
    assert (drafts != plain).float().mean() > 0.3


def test_greedy_rows_accept_the_longest_agreeing_run() -> None:
    logits = torch.full((3, 4, VOCAB), -5.0)
    target = torch.tensor([[1, 2, 3, 0], [1, 2, 3, 0], [1, 2, 3, 0]])
    logits.scatter_(2, target[:, :, None], 5.0)
    drafts = torch.tensor([[1, 2, 3], [1, 0, 3], [1, 2, 3]])
    plan = SamplingPlan.build([SamplingRow(SamplingParams(), 0, 0)] * 3, VOCAB, "cpu")
    tokens, accepted = verify_drafts(logits, drafts, torch.tensor([3, 3, 1]), None, plan)
    assert accepted.tolist() == [3, 1, 1]
    assert [tokens[b, : a + 1].tolist() for b, a in enumerate(accepted.tolist())] == [[1, 2, 3, 0], [1, 2], [1, 2]]
