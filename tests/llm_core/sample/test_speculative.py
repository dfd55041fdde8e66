"""MTP speculative decoding in the engine: greedy output identical to no
speculation and to transformers, rollback in both pools, drafts from cached
prefixes as from cold ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from llm_core import LLM, SamplingParams
from llm_core.model.config import ModelConfig
from tests.conftest import (
    REF_WINDOW,
    _make_peaky,
    append_mtp_shard,
    assert_pools_full,
    hf_greedy_outputs,
    hf_reference_config,
)

NUM_MTP = 3
MAX_NEW = 40
LENGTHS = [3, 70, REF_WINDOW, 21, 1, REF_WINDOW + 1, 130, 45]
PROMPTS = [
    torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(900 + i)).tolist()
    for i, n in enumerate(LENGTHS)
]


def _mtp_follows_the_token(name: str, like: torch.Tensor) -> torch.Tensor:
    """MTP weights that predict what the target would after the token read:
    eh_proj passes the token's (normed) embedding through, attention and MLP
    add nothing, so the layer's logits are lm_head(norm(embed(token)))."""
    if name == "eh_proj.weight":
        h = like.shape[0]
        return torch.cat((torch.eye(h), torch.zeros(h, h)), dim=1)
    if name.endswith("norm.weight"):
        return torch.ones_like(like)
    return torch.zeros_like(like)


@pytest.fixture(scope="module")
def draftable_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A transformers checkpoint whose next token depends mostly on the current
    one (attention and MLP outputs scaled down), with three MTP layers that draft
    exactly that: drafts are often, not always, right."""
    from transformers import MiMoV2FlashForCausalLM

    out = tmp_path_factory.mktemp("draftable")
    torch.manual_seed(0)
    model = MiMoV2FlashForCausalLM(hf_reference_config()).eval()
    _make_peaky(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "o_proj" in name or "down_proj" in name:
                p.mul_(0.03)
    model.save_pretrained(out)
    config = ModelConfig.from_json_file(out / "config.json").with_mtp_layers(NUM_MTP)
    append_mtp_shard(out, config, _mtp_follows_the_token)
    config_json = out / "config.json"
    data = json.loads(config_json.read_text())
    data["num_nextn_predict_layers"] = NUM_MTP
    config_json.write_text(json.dumps(data))
    return out


@pytest.fixture(scope="module")
def reference(draftable_checkpoint: Path) -> list[list[int]]:
    from transformers import MiMoV2FlashForCausalLM

    hf = MiMoV2FlashForCausalLM.from_pretrained(draftable_checkpoint, dtype=torch.float32).eval()
    return hf_greedy_outputs(hf, PROMPTS, MAX_NEW)


def test_default_is_one_draft_per_mtp_layer(draftable_checkpoint: Path) -> None:
    assert LLM(draftable_checkpoint).engine.num_speculative == NUM_MTP
    assert LLM(draftable_checkpoint, speculative_tokens=0).engine.drafter is None


@pytest.mark.parametrize("k", [1, NUM_MTP, NUM_MTP + 2])
def test_greedy_with_speculation_matches_transformers_at_every_batch_size(
    draftable_checkpoint: Path, reference: list[list[int]], k: int
) -> None:
    llm = LLM(draftable_checkpoint, speculative_tokens=k, chunked_prefill_size=5, max_num_batched_tokens=64)
    for batch in range(1, 9) if k == NUM_MTP else (1, 8):
        outputs = llm.generate(PROMPTS[:batch], SamplingParams(max_tokens=MAX_NEW))
        assert [o.token_ids for o in outputs] == reference[:batch], f"batch {batch}"
    spec = llm.stats()["speculative"]
    # Drafts were really accepted (and rejected): both paths of the commit ran.
    assert 1.3 < spec["mean_acceptance_length"] < k + 1, spec
    assert spec["drafts_proposed"][0] >= spec["drafts_accepted"][0] > 0
    assert_pools_full(llm)


def test_speculation_on_and_off_agree_with_a_prefix_cache_and_preemption(
    draftable_checkpoint: Path, reference: list[list[int]]
) -> None:
    probe = LLM(draftable_checkpoint).stats()
    swa_tokens = 8 * (REF_WINDOW + 16 + NUM_MTP) + 64
    budget = probe["full_pool"]["bytes_per_token"] * 220 + probe["swa_pool"]["bytes_per_token"] * swa_tokens
    llm = LLM(draftable_checkpoint, kv_budget_bytes=budget, max_running_requests=8, chunked_prefill_size=32,
              max_num_batched_tokens=64)
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW))
    assert [o.token_ids for o in outputs] == reference
    assert llm.stats()["preemptions"] > 0
    assert_pools_full(llm)


def test_abort_mid_verify_returns_every_slot(draftable_checkpoint: Path) -> None:
    llm = LLM(draftable_checkpoint, chunked_prefill_size=16, max_num_batched_tokens=64)
    ids = [llm.add_request(p, SamplingParams(max_tokens=MAX_NEW)) for p in PROMPTS[:4]]
    while llm.stats()["speculative"]["verify_steps"] < 6:
        llm.step()
    assert any(r.drafts is not None for r in llm.engine.requests.values())  # waiting for the next verify
    for rid in ids:
        llm.abort(rid)
    assert not llm.engine.requests
    assert_pools_full(llm)


def test_swa_slots_stay_within_window_chunk_page_and_drafts(draftable_checkpoint: Path) -> None:
    chunk, page = 16, 4
    llm = LLM(draftable_checkpoint, chunked_prefill_size=chunk, max_num_batched_tokens=64, page_size=page)
    engine = llm.engine
    peaks: list[int] = []
    forward = engine.runner.logits

    def spying_forward(chunks):  # noqa: ANN001, ANN202 - sample while the step's slots are held
        peaks.extend(c.seq.view.swa_slots_held for c in chunks)
        return forward(chunks)

    engine.runner.logits = spying_forward  # type: ignore[method-assign]
    llm.generate([p * 3 for p in PROMPTS[:4]], SamplingParams(max_tokens=60))
    window = REF_WINDOW + 1
    assert max(peaks) <= window + chunk + page + NUM_MTP
    assert_pools_full(llm)


def _draft_log(llm: LLM) -> tuple[list[list[int]], list[int]]:
    """Run one request to its end, logging the drafts waiting after every step."""
    log: list[list[int]] = []
    (rid,) = list(llm.engine.requests)
    tokens: list[int] = []
    while llm.engine.has_unfinished():
        tokens += [e.token for e in llm.step()]
        request = llm.engine.requests.get(rid)
        pending = request.drafts if request is not None else None
        if pending is not None:
            log.append(pending[0].tolist())
    return log, tokens


@pytest.mark.parametrize("tier", ["device", "host"])
def test_a_cache_hit_drafts_exactly_as_the_same_prompt_served_cold(draftable_checkpoint: Path, tier: str) -> None:
    params = SamplingParams(max_tokens=30)
    turn_one = PROMPTS[6]  # 130 tokens: checkpoints well past the window
    warm = LLM(draftable_checkpoint, chunked_prefill_size=48, checkpoint_interval=32,
               kv_host_bytes=(64 << 20) if tier == "host" else 0)
    answer = warm.generate([turn_one], params)[0].token_ids
    if tier == "host":  # the first turn's KV (MTP layers' window included) leaves the device
        warm.engine.flush_cache()
    second = turn_one + answer + PROMPTS[3]
    warm.add_request(second, params)
    cached_log, cached_tokens = _draft_log(warm)
    by_tier = warm.stats()["prefix_cache"]["cached_tokens_by_tier"]
    assert by_tier[tier] >= len(turn_one) // 16 * 16

    cold = LLM(draftable_checkpoint, chunked_prefill_size=48, enable_prefix_caching=False)
    cold.add_request(second, params)
    cold_log, cold_tokens = _draft_log(cold)
    assert cached_tokens == cold_tokens
    assert cached_log == cold_log and len(cold_log) > 3


def test_speculative_tokens_need_mtp_layers(tmp_path: Path) -> None:
    from llm_core.loading.checkpoint import write_random_checkpoint
    from llm_core.model.presets import tiny

    model_dir = write_random_checkpoint(tmp_path / "model", tiny().with_mtp_layers(0), seed=0)
    assert LLM(model_dir).engine.drafter is None  # the default: no layers, no drafts
    with pytest.raises(ValueError, match="MTP layers"):
        LLM(model_dir, speculative_tokens=2)


def test_speculative_tokens_are_checked() -> None:
    from llm_core.engine import EngineConfig

    with pytest.raises(ValueError, match="speculative_tokens"):
        EngineConfig(speculative_tokens=-1)


def test_sampled_requests_with_drafts_repeat_whatever_their_batch(draftable_checkpoint: Path) -> None:
    llm = LLM(draftable_checkpoint, chunked_prefill_size=32, max_num_batched_tokens=64)
    seeded = [SamplingParams(max_tokens=24, temperature=0.8, seed=s, top_k=8 if s % 2 else -1) for s in range(4)]
    together = [o.token_ids for o in llm.generate(PROMPTS[:4], seeded)]
    alone = [llm.generate([p], [params])[0].token_ids for p, params in zip(PROMPTS[:4], seeded)]
    assert together == alone and all(len(t) == 24 for t in together)
    spec = llm.stats()["speculative"]
    assert spec["drafts_accepted"][0] > 0  # sampled drafts were accepted too
    assert_pools_full(llm)
