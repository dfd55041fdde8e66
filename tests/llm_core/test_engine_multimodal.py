"""Multimodal spans in the engine: embedding rows replace placeholder tokens.

Reference: the whole sequence through the model on the contiguous backend,
with span rows written over the token embeddings, then greedy decoding. The
engine must give identical tokens whatever the chunking, batching, prefix-cache
hits or preemptions — and the prefix cache must never hit past a span whose
content differs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llm_core import LLM, MultimodalSpan, SamplingParams
from llm_core.kv.kv_cache import ContiguousAttention, RequestKVCache, Segment
from llm_core.model.model import MiMoV2ForCausalLM
from llm_core.model.multimodal import cache_token, check_spans, with_cache_tokens
from tests.conftest import REF_WINDOW

HIDDEN = 64  # hf_reference_config().hidden_size
PLACEHOLDER = 7  # a real vocabulary id standing for one embedding row
MAX_NEW = 10
SPAN_LEN = REF_WINDOW + 4  # longer than the window: SWA layers attend across it


def _ids(seed: int, n: int) -> list[int]:
    return torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _span(offset: int, length: int, seed: int, key: bytes | None = None) -> MultimodalSpan:
    # Same scale as the token embeddings (std ~0.1), so spans are ordinary inputs.
    rows = torch.randn(length, HIDDEN, generator=torch.Generator().manual_seed(seed)) * 0.1
    return MultimodalSpan(offset, rows, key if key is not None else f"content-{seed}".encode())


def _prompt(text: list[int], spans: list[MultimodalSpan]) -> list[int]:
    """``text`` with placeholder tokens inserted where the spans go (spans sorted by offset)."""
    out, rest = [], list(text)
    for span in spans:
        take = span.offset - len(out)
        out += rest[:take] + [PLACEHOLDER] * span.length
        rest = rest[take:]
    return out + rest


def _reference(model: MiMoV2ForCausalLM, prompt: list[int], spans: list[MultimodalSpan], n: int) -> list[int]:
    cache = RequestKVCache()
    ids = torch.tensor(prompt)
    with torch.inference_mode():
        embeds = model.model.embed_tokens(ids).clone()
        for span in spans:
            embeds[span.offset : span.end] = span.embeddings
        backend = ContiguousAttention([Segment(cache, 0, len(prompt))], "cpu")
        hidden = model(ids, torch.arange(len(prompt)), backend, inputs_embeds=embeds)
        out: list[int] = []
        for pos in range(len(prompt), len(prompt) + n):
            out.append(int(model.compute_logits(hidden[-1:]).argmax(-1)))
            backend = ContiguousAttention([Segment(cache, pos, 1)], "cpu")
            hidden = model(torch.tensor(out[-1:]), torch.tensor([pos]), backend)
    return out


@pytest.fixture(scope="module")
def ref_llm(hf_checkpoint: Path) -> LLM:
    return LLM(hf_checkpoint, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def reference(ref_llm: LLM):
    def run(prompt: list[int], spans: list[MultimodalSpan], n: int = MAX_NEW) -> list[int]:
        return _reference(ref_llm.model, prompt, spans, n)

    return run


def _assert_clean(llm: LLM) -> None:
    """No request, span or KV slot left behind."""
    assert not llm.engine.has_unfinished()
    assert llm.engine.requests == {}
    llm.flush_cache()
    stats = llm.stats()
    for pool in ("full_pool", "swa_pool"):
        assert stats[pool]["free_tokens"] == stats[pool]["capacity_tokens"], stats


def _cached(llm: LLM) -> int:
    return llm.stats()["prefix_cache"]["cached_prompt_tokens"]


ONE_SPAN = [_span(15, SPAN_LEN, seed=1)]
TWO_SPANS = [_span(4, SPAN_LEN, seed=2), _span(4 + SPAN_LEN + 9, 5, seed=3)]
CASES = {"one span": (_ids(10, 30), ONE_SPAN), "two spans": (_ids(11, 20), TWO_SPANS)}


# ------------------------------------------------------------------- spans
def test_cache_token_is_negative_and_names_the_content() -> None:
    assert cache_token(b"a") == cache_token(b"a") < 0
    assert cache_token(b"a") != cache_token(b"b")
    span = _span(1, 2, seed=0, key=b"k")
    assert with_cache_tokens([5, 6, 7, 8], [span]) == [5, cache_token(b"k"), cache_token(b"k"), 8]
    assert (span.length, span.end) == (2, 3)


@pytest.mark.parametrize("case", CASES)
def test_spans_match_reference_and_transformers(hf_checkpoint: Path, hf_model, reference, case: str) -> None:
    text, spans = CASES[case]
    prompt = _prompt(text, spans)
    expected = reference(prompt, spans)
    # The reference itself agrees with transformers fed the same embeddings.
    embeds = hf_model.model.embed_tokens(torch.tensor(prompt)).detach().clone()
    for span in spans:
        embeds[span.offset : span.end] = span.embeddings
    with torch.no_grad():
        hf = hf_model.generate(inputs_embeds=embeds[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                               max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)
    assert hf[0, -MAX_NEW:].tolist() == expected
    assert expected != reference(prompt, [])  # the spans really change the output

    llm = LLM(hf_checkpoint)
    out = llm.generate([prompt], SamplingParams(max_tokens=MAX_NEW), mm_spans=[spans])[0]
    assert out.token_ids == expected
    assert out.prompt_token_ids == prompt  # placeholders, not cache tokens
    _assert_clean(llm)


@pytest.mark.parametrize("swa_mode", ["hybrid", "full"])
def test_chunked_prefill_splits_spans_in_a_mixed_batch(hf_checkpoint: Path, reference, swa_mode: str) -> None:
    requests = [
        (_prompt(*CASES["one span"]), ONE_SPAN),
        (_ids(12, 23), []),
        (_prompt(*CASES["two spans"]), TWO_SPANS),
        (_prompt(_ids(13, 3), [_span(0, 6, seed=4)]), [_span(0, 6, seed=4)]),  # starts with a span
        (_prompt(_ids(14, 9), [_span(9, 7, seed=5)]), [_span(9, 7, seed=5)]),  # ends with one
    ]
    llm = LLM(hf_checkpoint, swa_mode=swa_mode, chunked_prefill_size=5, max_num_batched_tokens=16, page_size=4)
    outs = llm.generate([p for p, _ in requests], SamplingParams(max_tokens=MAX_NEW), mm_spans=[s for _, s in requests])
    assert [o.token_ids for o in outs] == [reference(p, s) for p, s in requests]
    _assert_clean(llm)


def test_preemption_recomputes_spans(hf_checkpoint: Path, reference) -> None:
    requests = [(_prompt(_ids(20 + i, 25), [_span(5 + i, SPAN_LEN, seed=20 + i)]), [_span(5 + i, SPAN_LEN, seed=20 + i)])
                for i in range(4)]
    probe = LLM(hf_checkpoint).stats()
    swa_tokens = 4 * (REF_WINDOW + 16) + 32
    budget = probe["full_pool"]["bytes_per_token"] * 100 + probe["swa_pool"]["bytes_per_token"] * swa_tokens
    llm = LLM(hf_checkpoint, kv_budget_bytes=budget, max_running_requests=4, chunked_prefill_size=16,
              max_num_batched_tokens=32, enable_prefix_caching=False)
    outs = llm.generate([p for p, _ in requests], SamplingParams(max_tokens=3 * MAX_NEW),
                        mm_spans=[s for _, s in requests])
    assert llm.stats()["preemptions"] > 0
    assert [o.token_ids for o in outs] == [reference(p, s, 3 * MAX_NEW) for p, s in requests]
    _assert_clean(llm)


# ------------------------------------------------------------ prefix cache
OFFSET = 18
TEXT = _ids(30, 30)
PROMPT = _prompt(TEXT, [_span(OFFSET, SPAN_LEN, seed=30)])  # span at [18, 30) of 42 tokens


def _cache_llm(hf_checkpoint: Path) -> LLM:
    # Checkpoints every 8 tokens: a hit is possible right before the span and inside it.
    return LLM(hf_checkpoint, chunked_prefill_size=16, page_size=4, checkpoint_interval=8)


def _run_twice(llm: LLM, first: MultimodalSpan, second: MultimodalSpan, prompt2: list[int] = PROMPT) -> tuple[int, list[int]]:
    """Cached tokens of the second request, and its output."""
    llm.generate([PROMPT], SamplingParams(max_tokens=MAX_NEW), mm_spans=[[first]])
    before = _cached(llm)
    out = llm.generate([prompt2], SamplingParams(max_tokens=MAX_NEW), mm_spans=[[second]])[0].token_ids
    return _cached(llm) - before, out


def test_different_image_never_hits_past_its_offset(hf_checkpoint: Path, reference, ref_llm: LLM) -> None:
    llm = _cache_llm(hf_checkpoint)
    span_b = _span(OFFSET, SPAN_LEN, seed=31)
    cached, out = _run_twice(llm, _span(OFFSET, SPAN_LEN, seed=30), span_b)
    assert 0 < cached <= OFFSET  # the shared text before the image hits, nothing after
    assert out == reference(PROMPT, [span_b])
    assert out == ref_llm.generate([PROMPT], SamplingParams(max_tokens=MAX_NEW), mm_spans=[[span_b]])[0].token_ids
    _assert_clean(llm)


def test_same_image_hits_past_the_span(hf_checkpoint: Path, reference) -> None:
    llm = _cache_llm(hf_checkpoint)
    span = _span(OFFSET, SPAN_LEN, seed=30)
    cached, out = _run_twice(llm, span, span)
    assert cached > span.end
    assert out == reference(PROMPT, [span])
    _assert_clean(llm)


def test_same_embeddings_under_another_key_are_another_image(hf_checkpoint: Path, reference) -> None:
    llm = _cache_llm(hf_checkpoint)
    span = _span(OFFSET, SPAN_LEN, seed=30)
    renamed = MultimodalSpan(OFFSET, span.embeddings.clone(), b"another key")
    cached, out = _run_twice(llm, span, renamed)
    assert cached <= OFFSET
    assert out == reference(PROMPT, [span])
    _assert_clean(llm)


def test_hit_ending_inside_a_span_resumes_mid_span(hf_checkpoint: Path, reference) -> None:
    llm = _cache_llm(hf_checkpoint)
    span = _span(OFFSET, SPAN_LEN, seed=30)
    # Same text and image, different text right after the image: the deepest
    # window-safe point (28 here) lies inside the span, so the recompute
    # starts mid-span.
    prompt2 = PROMPT[: span.end] + _ids(32, 12)
    cached, out = _run_twice(llm, span, span, prompt2)
    assert OFFSET < cached < span.end
    assert out == reference(prompt2, [span])
    _assert_clean(llm)


def test_a_follow_up_question_about_the_same_image_hits_up_to_the_image(hf_checkpoint: Path, reference) -> None:
    # No interval checkpoints: only the prompt's own (its last full page, and the
    # end of its image) keep SWA for later requests.
    llm = LLM(hf_checkpoint, page_size=4, checkpoint_interval=None)
    span = _span(OFFSET, SPAN_LEN, seed=30)
    prompt2 = PROMPT[: span.end] + _ids(33, 9)  # another question after the same image
    cached, out = _run_twice(llm, span, span, prompt2)
    assert cached == span.end // 4 * 4
    assert out == reference(prompt2, [span])
    _assert_clean(llm)


# -------------------------------------------------------- lifecycle, errors
def test_abort_mid_prefill_frees_kv_and_spans(hf_checkpoint: Path) -> None:
    llm = LLM(hf_checkpoint, chunked_prefill_size=8, max_num_batched_tokens=16)
    spans = [_span(10, 40, seed=40), _span(60, 30, seed=41)]
    rid = llm.add_request(_prompt(_ids(40, 50), spans), SamplingParams(max_tokens=20), spans)
    for _ in range(4):
        assert llm.step() == []  # still prefilling: 32 of 120 tokens
    assert llm.stats()["full_pool"]["free_tokens"] < llm.stats()["full_pool"]["capacity_tokens"]
    assert llm.engine.requests[rid].spans
    assert llm.abort(rid)
    _assert_clean(llm)


BAD_SPANS = {
    "overlap": ([_span(2, 6, seed=50), _span(6, 4, seed=51)], "overlap"),
    "past the end": ([_span(16, 6, seed=52)], "outside the prompt"),
    "negative offset": ([_span(-1, 3, seed=53)], "outside the prompt"),
    "empty": ([MultimodalSpan(3, torch.zeros(0, HIDDEN), b"e")], "empty"),
    "hidden size": ([MultimodalSpan(3, torch.zeros(4, HIDDEN + 1), b"h")], "hidden size 65"),
    "nan": ([MultimodalSpan(3, torch.full((4, HIDDEN), float("nan")), b"n")], "NaN"),
    "not 2-d": ([MultimodalSpan(3, torch.zeros(HIDDEN), b"d")], r"\[length, hidden_size\]"),
    "integer rows": ([MultimodalSpan(3, torch.zeros(4, HIDDEN, dtype=torch.long), b"i")], "floating point"),
    "key": ([MultimodalSpan(3, torch.zeros(4, HIDDEN), "str key")], "key"),  # type: ignore[arg-type]
}


@pytest.mark.parametrize("case", BAD_SPANS)
def test_bad_spans_are_refused_with_a_reason(hf_checkpoint: Path, case: str) -> None:
    spans, message = BAD_SPANS[case]
    prompt = [PLACEHOLDER] * 20
    with pytest.raises(ValueError, match=message):
        check_spans(spans, len(prompt), HIDDEN)
    llm = LLM(hf_checkpoint)
    params = SamplingParams(max_tokens=4)
    with pytest.raises(ValueError, match=message):
        llm.engine.add_request(prompt, params, (), spans)
    with pytest.raises(ValueError, match=message):
        llm.add_request(prompt, params, spans)
    with pytest.raises(ValueError, match=message):  # validated before any prompt runs
        llm.generate([_ids(50, 5), prompt], params, mm_spans=[[], spans])
    _assert_clean(llm)
    assert llm.generate([prompt], params)[0].finish_reason == "length"  # still serving


def test_generate_wants_one_span_list_per_prompt(hf_checkpoint: Path) -> None:
    llm = LLM(hf_checkpoint)
    with pytest.raises(ValueError, match="one list per prompt"):
        llm.generate([_ids(60, 5), _ids(61, 5)], mm_spans=[[]])
    with pytest.raises(ValueError, match="not the spans themselves"):
        llm.generate([_ids(60, 5)], mm_spans=[_span(0, 2, seed=60)])  # type: ignore[list-item]
    _assert_clean(llm)
