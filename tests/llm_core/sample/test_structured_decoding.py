"""Grammars, penalties and log-probabilities in the engine's batched sampler."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch

from llm_core import LLM, SamplingParams
from llm_core.kv.kv_cache import ContiguousAttention, RequestKVCache, Segment
from llm_core.sample.grammar import GrammarSpec
from llm_core.sample.sampling import Penalties, TokenCounts, apply_penalties, apply_token_mask

DEMO = Path(__file__).resolve().parents[3] / "models" / "demo"
SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"type": "string", "enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
    },
    "required": ["color", "count", "tags"],
    "additionalProperties": False,
}


def _prompt(llm: LLM, question: str = "What color is the shape?") -> list[int]:
    assert llm.tokenizer is not None
    return llm.tokenizer.encode(f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")


def _run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[list]:
    """Every request's token events, the requests all in one batch."""
    ids = [llm.engine.add_request(p, s, eos_ids=llm.config.eos_token_ids) for p, s in zip(prompts, params)]
    events: dict[int, list] = {i: [] for i in ids}
    while llm.engine.has_unfinished():
        for event in llm.engine.step():
            assert event.error is None, event.error
            events[event.request_id].append(event)
    return [events[i] for i in ids]


def _text(llm: LLM, events: list) -> str:
    assert llm.tokenizer is not None
    return llm.tokenizer.decode([e.token for e in events])


@pytest.fixture(scope="module")
def demo() -> LLM:
    return LLM(DEMO)


@pytest.fixture(scope="module")
def demo_no_spec() -> LLM:
    return LLM(DEMO, speculative_tokens=0)


# ----------------------------------------------------------------------------- sampler pieces


def test_token_mask_keeps_exactly_the_allowed_tokens() -> None:
    vocab = 70
    logits = torch.randn(3, vocab)
    allowed = [[0, 31, 32, 69], [5], list(range(vocab))]
    bits = np.zeros((2, 3), np.int32)
    for r, tokens in enumerate(allowed[:2]):
        for t in tokens:
            bits[r, t >> 5] |= np.int32(np.uint32(1 << (t & 31)).view(np.int32))
    out = apply_token_mask(logits, torch.tensor([0, 1]), bits)
    everything = apply_token_mask(logits[:2], torch.tensor([0, 1]), bits)  # every row masked: the one-pass path
    assert torch.equal(everything, out[:2])
    for r in range(2):
        finite = torch.isfinite(out[r]).nonzero().view(-1).tolist()
        assert finite == allowed[r]
        assert torch.equal(out[r, allowed[r]], logits[r, allowed[r]])
    assert torch.equal(out[2], logits[2])  # rows without a mask are untouched


def test_penalties_match_a_row_by_row_reference() -> None:
    torch.manual_seed(0)
    vocab = 11
    logits = torch.randn(2, vocab) * 3
    counts = TokenCounts(vocab, torch.device("cpu"))
    counts.admit(7, [1, 2])
    counts.add({7: [2, 3, 3, 3]})
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.5)
    out = apply_penalties(logits, counts.penalties([1], [7], [params]))
    expected = logits[1].clone()
    output = [2, 3, 3, 3]
    for t in range(vocab):
        if t in (1, 2, 3):
            expected[t] = expected[t] / 1.5 if expected[t] > 0 else expected[t] * 1.5
        expected[t] -= 0.25 * output.count(t) + (0.5 if t in output else 0.0)
    assert torch.allclose(out[1], expected) and torch.equal(out[0], logits[0])
    # A draft earlier in the same step counts as output for the rows after it.
    with_draft = apply_penalties(logits, counts.penalties([1], [7], [params], [[5]]))
    assert with_draft[1, 5] < out[1, 5]
    counts.release(7)
    assert 7 not in counts


def test_penalties_are_validated() -> None:
    with pytest.raises(ValueError, match="presence_penalty"):
        SamplingParams(presence_penalty=2.5)
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=0.0)
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=5e-324)  # 0 in float32: logits divided by zero
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)


def test_penalties_struct_is_plain_tensors() -> None:
    p = Penalties(torch.tensor([0]), torch.zeros(1, 3), torch.zeros(1, 3, dtype=torch.bool),
                  torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1))
    assert torch.equal(apply_penalties(torch.ones(1, 3), p), torch.ones(1, 3))


# ----------------------------------------------------------------------------- the engine


@pytest.mark.parametrize("speculative", [True, False])
def test_sampled_json_schema_outputs_always_validate(demo: LLM, demo_no_spec: LLM, speculative: bool) -> None:
    llm = demo if speculative else demo_no_spec
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    params = [SamplingParams(max_tokens=80, temperature=1.0, seed=s, grammar=spec) for s in range(50)]
    outputs = _run(llm, [_prompt(llm)] * len(params), params)
    for events in outputs:
        assert events[-1].finish_reason == "stop"
        jsonschema.validate(json.loads(_text(llm, events)), SCHEMA)
    assert len({_text(llm, e) for e in outputs}) > 5  # sampled, not one forced answer


def test_grammar_and_drafts_agree_with_plain_decoding(demo: LLM, demo_no_spec: LLM) -> None:
    """Greedy: drafts checked against the grammar change nothing but speed."""
    # Bounded: a greedy answer ends within max_tokens (a free JSON object's strings need not).
    color_schema = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue", "yellow"]},
                                                     "count": {"type": "integer", "minimum": 0, "maximum": 9}},
                    "required": ["color", "count"], "additionalProperties": False}
    params = [SamplingParams(max_tokens=60, grammar=GrammarSpec("json_schema", json.dumps(color_schema))),
              SamplingParams(max_tokens=60, grammar=GrammarSpec("regex", r"(red|green|blue) [0-9]{1,3}")),
              SamplingParams(max_tokens=12)]
    questions = ["What color is the shape?", "How many beeps are there?", "Which way does it move?"]
    with_drafts = _run(demo, [_prompt(demo, q) for q in questions], params)
    plain = _run(demo_no_spec, [_prompt(demo_no_spec, q) for q in questions], params)
    assert [[e.token for e in x] for x in with_drafts] == [[e.token for e in x] for x in plain]
    jsonschema.validate(json.loads(_text(demo, with_drafts[0])), color_schema)
    color, number = _text(demo, with_drafts[1]).split(" ")
    assert color in ("red", "green", "blue") and number.isdigit()
    assert demo.engine.spec_stats.proposed[0] > 0


def test_penalties_with_and_without_drafts_agree(demo: LLM, demo_no_spec: LLM) -> None:
    params = [SamplingParams(max_tokens=24, ignore_eos=True, frequency_penalty=1.0, presence_penalty=0.5,
                             repetition_penalty=1.3)]
    a = _run(demo, [_prompt(demo)], params)[0]
    b = _run(demo_no_spec, [_prompt(demo_no_spec)], params)[0]
    assert [e.token for e in a] == [e.token for e in b]
    unpenalised = _run(demo_no_spec, [_prompt(demo_no_spec)], [SamplingParams(max_tokens=24, ignore_eos=True)])[0]
    assert [e.token for e in a] != [e.token for e in unpenalised]
    banned = _run(demo_no_spec, [_prompt(demo_no_spec)],
                  [SamplingParams(max_tokens=24, ignore_eos=True, repetition_penalty=10.0, presence_penalty=2.0)])[0]
    tokens = [e.token for e in banned]
    assert len(set(tokens)) > len(set(e.token for e in unpenalised))


def test_logprobs_are_the_models_log_softmax(demo: LLM) -> None:
    prompt = _prompt(demo)
    events = _run(demo, [prompt], [SamplingParams(max_tokens=8, ignore_eos=True, logprobs=3)])[0]
    tokens = [e.token for e in events]
    reference = _run(demo, [prompt], [SamplingParams(max_tokens=8, ignore_eos=True)])[0]
    assert tokens == [e.token for e in reference]  # asking for logprobs changes nothing drawn
    model = demo.model
    ids = torch.tensor(prompt + tokens)
    with torch.inference_mode():
        backend = ContiguousAttention([Segment(RequestKVCache(), 0, len(ids))], "cpu")
        hidden = model(ids, torch.arange(len(ids)), backend)
        expected = model.compute_logits(hidden[len(prompt) - 1 : -1]).float().log_softmax(-1)
    for i, event in enumerate(events):
        assert event.logprob == pytest.approx(float(expected[i, tokens[i]]), abs=1e-4)
        top_ids = [t for t, _ in event.top_logprobs]
        assert top_ids == expected[i].topk(3).indices.tolist()
        assert [v for _, v in event.top_logprobs] == pytest.approx(expected[i].topk(3).values.tolist(), abs=1e-4)
    assert events[0].cached_tokens is not None and all(e.cached_tokens is None for e in events[1:])


def test_a_grammar_without_a_tokenizer_is_refused(tiny_checkpoint: Path, tmp_path: Path) -> None:
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(tiny_checkpoint, bare)
    (bare / "tokenizer.json").unlink()
    llm = LLM(bare)
    with pytest.raises(ValueError, match="tokenizer"):
        llm.engine.add_request([1, 2, 3], SamplingParams(grammar=GrammarSpec("json_object")))
    assert not llm.engine.has_unfinished()
