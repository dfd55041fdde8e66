"""Expert parallelism: 2 and 4 gloo ranks (processes on this host) give one
rank's greedy tokens and logits, each rank holds 1/N of the routed experts,
and the all-to-all byte counter matches the routing one rank computed."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from llm_core.engine import EngineConfig
from llm_core.ep_engine import EPLeader, check_engine_config
from llm_core.model.expert_parallel import ExpertParallel, owned_experts, token_range
from llm_core.model.layers import SparseMoE
from llm_core.llm import LLM
from llm_core.sample.params import SamplingParams
from llm_core.loading.weights import CheckpointReader, load_model
from tests.conftest import assert_pools_full

# Prefill chunks of 16 tokens: the longest prompt takes four.
OPTIONS: dict[str, Any] = {"chunked_prefill_size": 16, "max_num_batched_tokens": 32, "enable_prefix_caching": True}
PROMPTS = [[(7 * i + 13 * j) % 500 + 3 for j in range(n)] for i, n in enumerate([5, 60, 23, 9, 41])]
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.8, seed=7)
_ROUTED = (".experts.gate_up_proj", ".experts.down_proj")


# ------------------------------------------------------------ no processes
def test_experts_are_split_in_contiguous_blocks() -> None:
    assert [owned_experts(8, 4, r) for r in range(4)] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    with pytest.raises(ValueError, match="8 routed experts cannot be split evenly over 3"):
        owned_experts(8, 3, 0)


@pytest.mark.parametrize("tokens", [0, 1, 3, 4, 10])
def test_token_ranges_cover_the_batch_once(tokens: int) -> None:
    ranges = [token_range(tokens, 4, r) for r in range(4)]
    assert [t for r in ranges for t in r] == list(range(tokens))
    assert max(map(len, ranges)) - min(map(len, ranges)) <= 1


def test_forwards_must_be_eager_and_tiers_off(tiny_checkpoint: Path) -> None:
    with pytest.raises(ValueError, match="compile"):
        check_engine_config(EngineConfig(compile=True))
    with pytest.raises(ValueError, match="CUDA graphs"):
        check_engine_config(EngineConfig(cuda_graph_max_batch=8))
    with pytest.raises(ValueError, match="KV tiers"):
        check_engine_config(EngineConfig(kv_host_bytes=1 << 20))
    assert check_engine_config(EngineConfig()).cuda_graph_max_batch == 0
    with pytest.raises(ValueError, match="compile"):  # refused before any process starts
        LLM(tiny_checkpoint, ep_size=2, compile=True)


def _per_expert_copy(src: Path, dst: Path) -> Path:
    """``src`` with each layer's fused expert tensors written as the hub's per-expert ones."""
    tensors = {}
    with CheckpointReader(src) as reader:
        for name in reader.names():
            tensor = reader.get(name)
            if name.endswith(".experts.gate_up_proj"):
                prefix = name.removesuffix("gate_up_proj")
                for e, fused in enumerate(tensor):
                    gate, up = fused.chunk(2)
                    tensors[f"{prefix}{e}.gate_proj.weight"], tensors[f"{prefix}{e}.up_proj.weight"] = gate, up
            elif name.endswith(".experts.down_proj"):
                prefix = name.removesuffix("down_proj")
                tensors.update({f"{prefix}{e}.down_proj.weight": t for e, t in enumerate(tensor)})
            else:
                tensors[name] = tensor
    dst.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))
    shutil.copy(src / "config.json", dst / "config.json")
    return dst


@pytest.mark.parametrize("layout", ["fused", "per-expert"])
def test_a_rank_loads_only_its_experts(tiny_checkpoint: Path, tmp_path: Path, layout: str) -> None:
    model_dir = tiny_checkpoint if layout == "fused" else _per_expert_copy(tiny_checkpoint, tmp_path / "hub")
    full = load_model(model_dir)
    # Loading does not communicate: a rank of a group that is never built will do.
    shard = load_model(model_dir, ep=ExpertParallel(rank=1, size=4, group=None, control=None))
    full_params, shard_params = dict(full.named_parameters()), dict(shard.named_parameters())
    assert full_params.keys() == shard_params.keys()
    for name, param in shard_params.items():
        if name.endswith(_ROUTED):
            assert param.shape[0] == full_params[name].shape[0] // 4
            torch.testing.assert_close(param, full_params[name][2:4], rtol=0, atol=0)
        else:
            torch.testing.assert_close(param, full_params[name], rtol=0, atol=0)
    moe = [m for m in shard.modules() if isinstance(m, SparseMoE)]
    assert moe and all(m.ep is not None and m.experts.num_experts == 2 for m in moe)


# ------------------------------------------------------------- with ranks
class Recorder:
    """Every logits row an LLM's model computes, and (one rank) each MoE layer's routing."""

    def __init__(self, llm: LLM, routing: bool = False) -> None:
        self.logits: list[torch.Tensor] = []
        self.routes: list[torch.Tensor] = []
        compute = llm.model.compute_logits

        def compute_logits(hidden: torch.Tensor) -> torch.Tensor:
            out = compute(hidden)
            self.logits.append(out.clone())
            return out

        llm.model.compute_logits = compute_logits  # type: ignore[method-assign]
        if routing:
            for module in llm.model.modules():
                if isinstance(module, SparseMoE):
                    module.gate.register_forward_hook(lambda _m, _x, out: self.routes.append(out[1].clone()))

    def clear(self) -> None:
        self.logits.clear()
        self.routes.clear()


def _generate(llm: LLM, recorder: Recorder) -> list[list[int]]:
    """The prompts from an empty prefix cache (both sides compute the same batches)."""
    llm.flush_cache()
    recorder.clear()
    params = [GREEDY] * (len(PROMPTS) - 1) + [SAMPLED]
    return [out.token_ids for out in llm.generate(PROMPTS, params)]


def _frozen_clock() -> float:
    """The scheduler's clock on both sides of a comparison. Compute-aware
    order ages waiting requests by wall time, so a group of ranks (slower
    than one rank on 2 cores) could order a queue otherwise than one rank
    would; with time frozen, both orders follow the tokens alone."""
    return 0.0


@pytest.fixture(scope="module")
def one_rank(tiny_checkpoint: Path) -> Iterator[tuple[LLM, Recorder]]:
    llm = LLM(tiny_checkpoint, **OPTIONS)
    llm.engine.scheduler.clock = _frozen_clock
    yield llm, Recorder(llm, routing=True)
    llm.close()


@pytest.fixture(scope="module", params=[2, 4], ids=["ep2", "ep4"])
def ranks(request: pytest.FixtureRequest, tiny_checkpoint: Path) -> Iterator[tuple[LLM, Recorder]]:
    """This process as rank 0 of ``param`` gloo ranks, one thread each (the
    followers take the leader's count; more would only share 2 cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    llm = LLM(tiny_checkpoint, ep_size=request.param, **OPTIONS)
    assert isinstance(llm.core, EPLeader)
    llm.core.wall_clock = _frozen_clock  # the followers replay the leader's readings
    try:
        yield llm, Recorder(llm)
    finally:
        llm.close()
        torch.set_num_threads(threads)


def test_ranks_give_one_ranks_tokens_and_logits(ranks: tuple[LLM, Recorder],
                                                one_rank: tuple[LLM, Recorder]) -> None:
    (llm, recorder), (base, base_recorder) = ranks, one_rank
    assert _generate(llm, recorder) == _generate(base, base_recorder)
    assert len(recorder.logits) == len(base_recorder.logits) > len(PROMPTS)
    for got, want in zip(recorder.logits, base_recorder.logits):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert_pools_full(llm)


def test_each_rank_holds_a_share_of_the_experts(ranks: tuple[LLM, Recorder], one_rank: tuple[LLM, Recorder]) -> None:
    def routed_bytes(llm: LLM) -> int:
        return sum(p.numel() * p.element_size() for n, p in llm.model.named_parameters() if n.endswith(_ROUTED))

    llm, base = ranks[0], one_rank[0]
    assert llm.ep is not None
    assert routed_bytes(llm) * llm.ep.size == routed_bytes(base)


def test_byte_counter_matches_the_routing(ranks: tuple[LLM, Recorder], one_rank: tuple[LLM, Recorder]) -> None:
    """Slots whose expert lives on another rank than their token's, counted
    from one rank's routing of the same batches, cross twice (there and back)."""
    (llm, recorder), (base, base_recorder) = ranks, one_rank
    assert llm.ep is not None
    size, hidden = llm.ep.size, llm.config.hidden_size
    _generate(base, base_recorder)
    llm.ep.stats.reset()
    _generate(llm, recorder)
    owner_block = llm.config.n_routed_experts // size
    remote = 0
    for ids in base_recorder.routes:
        source = torch.cat([torch.full((len(token_range(ids.shape[0], size, r)),), r) for r in range(size)])
        remote += int((ids // owner_block != source[:, None]).sum())
    stats = llm.ep.stats
    assert stats.layer_calls == len(base_recorder.routes)
    assert stats.token_rows == sum(ids.shape[0] for ids in base_recorder.routes)
    assert stats.remote_slots == remote > 0
    assert stats.all_to_all_bytes == 2 * remote * hidden * 4  # float32 rows, dispatch + combine
    assert llm.stats()["expert_parallel"]["all_to_all_bytes"] == stats.all_to_all_bytes


def test_aborts_and_flushes_reach_every_rank(ranks: tuple[LLM, Recorder], one_rank: tuple[LLM, Recorder]) -> None:
    """Calls between steps are replayed on the followers in order: after an
    abort mid-prefill and a flush, the ranks still agree with one rank."""
    def run(llm: LLM) -> dict[int, list[int]]:
        ids = [llm.add_request(p, GREEDY) for p in PROMPTS]
        out: dict[int, list[int]] = {i: [] for i in ids}
        for step in range(40):
            if step == 2:
                llm.abort(ids[1])  # the long prompt, mid-prefill
            for event in llm.step():
                out[event.request_id].append(event.token)
            if not llm.engine.has_unfinished():
                break
        llm.flush_cache()
        return {i - ids[0]: tokens for i, tokens in out.items()}

    llm, base = ranks[0], one_rank[0]
    assert run(llm) == run(base)
    assert_pools_full(llm)
    assert _generate(llm, ranks[1]) == _generate(base, one_rank[1])  # still in step


def test_a_batch_smaller_than_the_group(ranks: tuple[LLM, Recorder], one_rank: tuple[LLM, Recorder]) -> None:
    """One request decoding (one token and its MTP draft a step): some ranks route no token at all."""
    llm, base = ranks[0], one_rank[0]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    assert llm.generate([PROMPTS[3]], params)[0].token_ids == base.generate([PROMPTS[3]], params)[0].token_ids


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL puts one rank on each)")
def test_nccl_ranks_give_one_ranks_tokens(tiny_checkpoint: Path) -> None:
    base = LLM(tiny_checkpoint, device="cuda", compile=False, cuda_graph_max_batch=0, **OPTIONS)
    base_recorder = Recorder(base)
    want = _generate(base, base_recorder)
    base.close()
    llm = LLM(tiny_checkpoint, device="cuda", ep_size=2, compile=False, **OPTIONS)
    try:
        assert llm.ep is not None and llm.ep.device.type == "cuda"
        recorder = Recorder(llm)
        assert _generate(llm, recorder) == want
        for got, expected in zip(recorder.logits, base_recorder.logits):
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
        assert llm.ep.stats.all_to_all_bytes > 0
    finally:
        llm.close()

