"""Determinism contract with KV tiers: prefixes restored from host memory and
from disk (also after a restart, also with corrupted files) give the same
tokens as recomputing them, and as transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llm_core import LLM, SamplingParams
from tests.conftest import assert_pools_full, hf_greedy_outputs

PARAMS = SamplingParams(max_tokens=10)


def _ids(seed: int, n: int) -> list[int]:
    return torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _tiered(checkpoint: Path, disk: Path | None = None, host_pages: int = 4096) -> LLM:
    """Tiers sized in pages of full and SWA KV (the smallest host tier holds one of each)."""
    kv = LLM(checkpoint, page_size=4, enable_prefix_caching=False).engine.kv
    page_bytes = 4 * (kv.full_bytes_per_token + kv.swa_bytes_per_token)
    return LLM(checkpoint, page_size=4, chunked_prefill_size=16, kv_host_bytes=host_pages * page_bytes,
               kv_disk_bytes=(1 << 26) if disk else 0, kv_disk_dir=str(disk) if disk else None)


def _by_tier(llm: LLM) -> dict[str, int]:
    return llm.stats()["prefix_cache"]["cached_tokens_by_tier"]


def _conversation(llm: LLM, turns: int, seed: int, between=lambda: None) -> list[list[int]]:
    """Turns of one conversation; ``between`` runs after each turn."""
    conversation, outputs = _ids(seed, 29), []
    for turn in range(turns):
        got = llm.generate([conversation], PARAMS)[0].token_ids
        outputs.append(got)
        conversation = conversation + got + _ids(seed + 1 + turn, 6)
        between()
    return outputs


@pytest.fixture(scope="module")
def reference(hf_checkpoint: Path) -> list[list[int]]:
    return _conversation(LLM(hf_checkpoint, enable_prefix_caching=False), 3, 1)


def test_turns_restored_from_host_memory_match_recompute_and_transformers(
    hf_checkpoint: Path, hf_model, reference: list[list[int]]
) -> None:
    llm = _tiered(hf_checkpoint)
    # Every turn's prefix leaves the device before the next turn: it comes back from host memory.
    assert _conversation(llm, 3, 1, between=llm.engine.flush_cache) == reference
    assert _by_tier(llm)["host"] >= 2 * 28 and _by_tier(llm)["device"] == 0
    tiers = llm.stats()["kv_tiers"]
    assert tiers["restored_entries"]["host"] > 0 and tiers["load_failures"] == 0
    assert tiers["demoted_bytes"] > 0 and sum(tiers["restore_seconds_counts"]) > 0
    prompt = _ids(1, 29) + reference[0] + _ids(2, 6)
    assert reference[1] == hf_greedy_outputs(hf_model, [prompt], 10)[0]


def test_a_small_host_tier_spills_to_disk_and_disk_restores_match(
    hf_checkpoint: Path, tmp_path: Path, reference: list[list[int]]
) -> None:
    llm = _tiered(hf_checkpoint, tmp_path / "kv", host_pages=2)
    assert _conversation(llm, 3, 1, between=llm.engine.flush_cache) == reference
    assert _by_tier(llm)["disk"] > 0
    assert llm.stats()["kv_tiers"]["spilled_bytes"] > 0
    llm.engine.close()


def _first_turn_on_disk(checkpoint: Path, directory: Path) -> list[int]:
    """Serve turn 1, push its KV to disk, close (writes finish)."""
    llm = _tiered(checkpoint, directory, host_pages=2)
    out = llm.generate([_ids(1, 29)], PARAMS)[0].token_ids
    llm.engine.flush_cache()
    llm.engine.close()
    return out


def test_a_restart_over_the_same_disk_directory_restores_the_conversation(
    hf_checkpoint: Path, tmp_path: Path, reference: list[list[int]]
) -> None:
    first = _first_turn_on_disk(hf_checkpoint, tmp_path / "kv")
    assert first == reference[0]
    restarted = _tiered(hf_checkpoint, tmp_path / "kv", host_pages=2)
    turn2 = _ids(1, 29) + first + _ids(2, 6)
    assert restarted.generate([turn2], PARAMS)[0].token_ids == reference[1]
    assert _by_tier(restarted)["disk"] >= 28
    restarted.engine.close()


def test_another_model_never_reads_the_directory(hf_checkpoint: Path, tiny_checkpoint: Path, tmp_path: Path) -> None:
    _first_turn_on_disk(hf_checkpoint, tmp_path / "kv")
    other = LLM(tiny_checkpoint, page_size=4, kv_host_bytes=1 << 20, kv_disk_bytes=1 << 26,
                kv_disk_dir=str(tmp_path / "kv"))
    assert len(other.engine.cache.tiers.disk) == 0  # type: ignore[union-attr]
    other.engine.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_a_damaged_page_file_is_detected_and_recomputed(
    hf_checkpoint: Path, tmp_path: Path, reference: list[list[int]], damage: str
) -> None:
    first = _first_turn_on_disk(hf_checkpoint, tmp_path / "kv")
    restarted = _tiered(hf_checkpoint, tmp_path / "kv", host_pages=2)
    files = sorted((tmp_path / "kv").rglob("*.kv"))
    assert len(files) == len(restarted.engine.cache.tiers.disk) > 0  # type: ignore[union-attr]
    for path in files[::2]:  # every other stored entry, behind the running server's back
        data = path.read_bytes()
        if damage == "flip":
            path.write_bytes(data[:-5] + bytes([data[-5] ^ 0x40]) + data[-4:])
        elif damage == "truncate":
            path.write_bytes(data[: len(data) // 2])
        else:
            path.unlink()
    turn2 = _ids(1, 29) + first + _ids(2, 6)
    assert restarted.generate([turn2], PARAMS)[0].token_ids == reference[1]
    tiers = restarted.stats()["kv_tiers"]
    assert tiers["load_failures"] >= 1 and tiers["checksum_failures"] >= 1
    restarted.engine.close()


def test_a_request_waiting_for_disk_does_not_hold_up_the_others(
    hf_checkpoint: Path, tmp_path: Path, reference: list[list[int]]
) -> None:
    first = _first_turn_on_disk(hf_checkpoint, tmp_path / "kv")
    llm = _tiered(hf_checkpoint, tmp_path / "kv", host_pages=64)
    from_disk = llm.add_request(_ids(1, 29) + first + _ids(2, 6), PARAMS)
    other = llm.add_request(_ids(77, 9), PARAMS)
    events = llm.step()
    # The first step runs the other request; the first waits for its prefix to come from disk.
    assert {e.request_id for e in events} == {other}
    assert llm.engine.scheduler.waiting.first().request_id == from_disk
    tokens: dict[int, list[int]] = {from_disk: [], other: []}
    for e in events:
        tokens[e.request_id].append(e.token)
    while llm.engine.has_unfinished():
        for e in llm.step():
            tokens[e.request_id].append(e.token)
    assert tokens[from_disk] == reference[1]
    assert _by_tier(llm)["host"] + _by_tier(llm)["disk"] >= 28  # read from disk into host memory, then restored
    assert llm.stats()["kv_tiers"]["restored_entries"]["disk"] > 0
    llm.engine.close()


def test_aborting_a_request_that_waits_for_disk_leaks_nothing(hf_checkpoint: Path, tmp_path: Path) -> None:
    first = _first_turn_on_disk(hf_checkpoint, tmp_path / "kv")
    llm = _tiered(hf_checkpoint, tmp_path / "kv", host_pages=64)
    waiting = llm.add_request(_ids(1, 29) + first + _ids(2, 6), PARAMS)
    assert llm.step() == [] and llm.engine.scheduler.loading()
    assert llm.abort(waiting)
    while llm.engine.has_unfinished():
        llm.step()
    llm.engine.cache.tiers.poll()  # type: ignore[union-attr]  # the read that was on its way lands in host memory
    assert_pools_full(llm)
    llm.engine.close()


def test_preemption_under_a_tiny_device_pool_with_tiers_matches_recompute(hf_checkpoint: Path) -> None:
    prompts = [_ids(40 + i, 30 + 7 * i) for i in range(6)]
    params = SamplingParams(max_tokens=24)
    expected = [o.token_ids for o in LLM(hf_checkpoint, enable_prefix_caching=False).generate(prompts, params)]
    kv = LLM(hf_checkpoint, page_size=4, enable_prefix_caching=False).engine.kv
    per_token = kv.full_bytes_per_token + kv.swa_bytes_per_token
    llm = LLM(hf_checkpoint, page_size=4, chunked_prefill_size=16, kv_budget_bytes=320 * per_token,
              kv_host_bytes=4096 * per_token, max_running_requests=4)
    for _ in range(2):  # the second round comes back through the tiers
        assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert llm.stats()["preemptions"] > 0
    assert llm.stats()["kv_tiers"]["restored_entries"]["host"] > 0
    assert_pools_full(llm)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_demotions_copy_on_a_side_stream_and_restores_match(hf_checkpoint: Path, tmp_path: Path) -> None:
    def tiered(**kwargs) -> LLM:
        return LLM(hf_checkpoint, device="cuda", dtype="float32", page_size=4, chunked_prefill_size=16,
                   kv_host_bytes=1 << 24, kv_disk_bytes=1 << 26, kv_disk_dir=str(tmp_path / "kv"), **kwargs)

    reference = _conversation(LLM(hf_checkpoint, device="cuda", dtype="float32", enable_prefix_caching=False), 3, 1)
    llm = tiered()
    assert llm.engine.tier_io is not None and llm.engine.tier_io._copy_stream is not None
    assert _conversation(llm, 3, 1, between=llm.engine.flush_cache) == reference
    assert _by_tier(llm)["host"] > 0 and llm.stats()["kv_tiers"]["load_failures"] == 0
    assert_pools_full(llm)
    llm.engine.close()


def test_restores_copied_layer_by_layer_beside_the_forward_match(
    hf_checkpoint: Path, reference: list[list[int]]
) -> None:
    kv = LLM(hf_checkpoint, page_size=4, enable_prefix_caching=False).engine.kv
    page_bytes = 4 * (kv.full_bytes_per_token + kv.swa_bytes_per_token)
    llm = LLM(hf_checkpoint, page_size=4, chunked_prefill_size=16, kv_host_bytes=4096 * page_bytes,
              kv_restore_layerwise=True)
    io = llm.engine.tier_io
    assert io is not None and io.layerwise is not None
    waited: list[int] = []
    wait_layer = io.layerwise.wait_layer
    io.layerwise.wait_layer = lambda layer: (waited.append(layer), wait_layer(layer))[1]  # type: ignore[method-assign]
    assert _conversation(llm, 3, 1, between=llm.engine.flush_cache) == reference
    assert _by_tier(llm)["host"] >= 2 * 28 and llm.stats()["kv_tiers"]["load_failures"] == 0
    # The restored turns' first steps waited at every layer, in order; nothing is left on its way.
    layers = llm.engine.kv.layer_ids[: llm.engine.model.config.num_hidden_layers]
    assert waited[: len(layers)] == layers and not io.layerwise.pending
    assert_pools_full(llm)
