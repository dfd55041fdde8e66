"""Shared fixtures: tiny checkpoints built here, never downloaded."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from llm_core.model.config import ModelConfig
from llm_core.model.model import MTPLayer
from llm_core.model.presets import tiny
from llm_core.loading.checkpoint import write_random_checkpoint

_REPORT = pytest.StashKey[list[str]]()


# The integration tier: files that start servers, stacks or engine-core
# processes, compile, train, run a benchmark or check a model end to end
# against transformers (each over ~4 s on 2 cores). `make test-fast` leaves
# them out; `make test` runs everything. A file that joins this tier is named here.
INTEGRATION_FILES = frozenset({
    "api/test_agent_api.py", "api/test_bad_input_corpus.py", "api/test_chat_server.py", "api/test_demo_page.py",
    "api/test_demo_routes.py", "api/test_disagg_stack.py", "api/test_engine_core.py", "api/test_engine_loop.py",
    "api/test_fault_isolation.py", "api/test_fp8_serving.py", "api/test_openapi_fuzz.py", "api/test_server.py",
    "api/test_stack.py", "api/test_stack_parts.py", "api/test_textstream.py", "api/test_uploads.py",
    "bench/test_encoder.py", "bench/test_ep.py", "bench/test_fp8.py", "bench/test_load.py", "bench/test_pd.py",
    "bench/test_router.py", "bench/test_schedule_replay.py", "bench/test_serve.py", "bench/test_structured.py",
    "bench/test_throughput.py", "bench/test_tiers.py",
    "demo/test_demo.py", "demo/test_demo_user_clips.py", "demo/test_demo_world.py",
    "embedding_cache/test_keys.py", "embedding_cache/test_ring.py", "embedding_cache/test_service.py",
    "embedding_cache/test_store.py",
    "llm_core/kv/test_block_table.py", "llm_core/test_compile.py", "llm_core/model/test_config_sweep.py",
    "llm_core/test_engine.py", "llm_core/test_engine_kv_tiers.py", "llm_core/test_engine_multimodal.py",
    "llm_core/test_engine_prefix_cache.py", "llm_core/model/test_expert_parallel.py", "llm_core/model/test_fp8.py",
    "llm_core/kv/test_kv_fp8.py", "llm_core/kv/tiers/test_kv_transfer.py", "llm_core/cluster/test_kv_transport.py",
    "llm_core/sample/test_sampling.py", "llm_core/sched/test_schedule_policy.py", "llm_core/sample/test_speculative.py",
    "llm_core/sample/test_structured_decoding.py", "llm_core/kv/test_triton_attention.py", "llm_core/model/test_triton_fp8.py",
    "llm_core/test_warmup.py",
    "media/test_video.py",
})
# Files whose tests share a session-scoped fixture (a live server), by group.
FIXTURE_GROUPS = {
    "api/test_agent_api.py": "demo-server", "api/test_demo_routes.py": "demo-server",
}
# `make test` hands these out first, longest first (measured in a fresh clone on 2
# cores: the warm-up test compiles with a cold inductor cache there), then the
# rest of the integration tier, then the unit tier: a worker that takes a long
# file near the end would leave the other one idle until it is done.
LONGEST_FILES = (
    "llm_core/test_warmup.py", "bench/test_load.py", "api/test_openapi_fuzz.py", "api/test_stack.py",
    "api/test_disagg_stack.py", "llm_core/kv/test_triton_attention.py", "api/test_fp8_serving.py",
    "llm_core/model/test_triton_fp8.py", "demo/test_demo.py", "llm_core/model/test_expert_parallel.py",
    "demo/test_demo_world.py", "api/test_demo_page.py", "api/test_agent_api.py", "api/test_demo_routes.py",
    "api/test_server.py", "api/test_chat_server.py", "embedding_cache/test_store.py", "bench/test_serve.py",
    "llm_core/kv/test_kv_fp8.py", "llm_core/cluster/test_kv_transport.py", "api/test_bad_input_corpus.py",
    "llm_core/kv/tiers/test_kv_transfer.py", "api/test_stack_parts.py", "api/test_engine_core.py",
)
_TESTS = Path(__file__).resolve().parent


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_REPORT] = []
    if getattr(config.option, "numprocesses", None):
        # pytest-xdist's controller (`-n 2`), before it starts its workers, one
        # per core: each worker's torch and OpenMP kernels on one thread. With a
        # thread per core each, the workers' spinning OpenMP pools oversubscribe
        # the cores (measured on 2 cores: the engine and speculation tests 7x slower).
        os.environ["OMP_NUM_THREADS"] = "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.relative_to(_TESTS).as_posix() in INTEGRATION_FILES:
            item.add_marker(pytest.mark.slow)
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: its order is the one files are handed out in
        items.sort(key=_file_rank)  # stable: each file's tests keep their order


_LONGEST_RANK = {path: rank for rank, path in enumerate(LONGEST_FILES)}


def _file_rank(item: pytest.Item) -> int:
    path = item.path.relative_to(_TESTS).as_posix()
    return _LONGEST_RANK.get(path, len(LONGEST_FILES) + (path not in INTEGRATION_FILES))


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`make test`'s `--dist loadfile`: each file's tests on one worker, and the
    files of one ``FIXTURE_GROUPS`` group too (their session fixture starts once);
    handed out in collection order."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    config.option.loadscopereorder = False  # files in collection order (LONGEST_FILES first), not by test count

    class GroupedFileScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return FIXTURE_GROUPS.get(path.removeprefix("tests/"), path)

    return GroupedFileScheduling(config, log)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    lines = config.stash.get(_REPORT, [])
    if lines:
        terminalreporter.section("figures reported by tests")
        for line in lines:
            terminalreporter.write_line(line)


@pytest.fixture
def suite_report(request: pytest.FixtureRequest) -> Callable[[str], None]:
    """Adds a line to the end of the run's summary: shown even though pytest
    captures what passing tests print."""
    return request.config.stash[_REPORT].append


# Short window so prompts of a few dozen tokens are "much longer than W".
REF_WINDOW = 8
REF_MTP_LAYERS = 1


def hf_reference_config():  # -> transformers.MiMoV2FlashConfig
    from transformers import MiMoV2FlashConfig

    return MiMoV2FlashConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        v_head_dim=16,
        sliding_window=REF_WINDOW + 1,
        layer_types=[
            "full_attention",
            "sliding_attention",
            "sliding_attention",
            "full_attention",
            "sliding_attention",
        ],
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=1.5,
        max_position_embeddings=2048,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.334},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
        },
        initializer_range=0.1,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def _make_peaky(model: torch.nn.Module) -> None:
    """Random weights that give confident, varied next tokens (clear argmax margins)."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif name.endswith("e_score_correction_bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)
        model.lm_head.weight.mul_(8.0)


def _random_mtp_weight(name: str, like: torch.Tensor) -> torch.Tensor:
    return torch.randn_like(like) * 0.1 + (1.0 if name.endswith("norm.weight") else 0.0)


def append_mtp_shard(model_dir: Path, config: ModelConfig,
                     weight: Callable[[str, torch.Tensor], torch.Tensor] = _random_mtp_weight) -> None:
    """transformers does not model MTP layers: add them as a second shard with an
    index; ``weight(name, like)`` gives each MTP layer parameter (random by default)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    torch.manual_seed(2)
    tensors = {}
    for j in range(config.num_mtp_layers):
        layer = MTPLayer(config, config.num_hidden_layers + j)
        for name, t in layer.state_dict().items():
            value = weight(name, t)
            if name == "self_attn.sinks":
                name = "self_attn.attention_sink_bias"
            tensors[f"model.mtp.layers.{j}.{name}"] = value
    save_file(tensors, str(model_dir / "model-mtp.safetensors"))
    weight_map = {}
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        weight_map.update(dict.fromkeys(f.keys(), "model.safetensors"))
    weight_map.update(dict.fromkeys(tensors, "model-mtp.safetensors"))
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random MiMoV2FlashForCausalLM saved by transformers (hub tensor names),
    plus MTP layers in a second shard."""
    from transformers import MiMoV2FlashForCausalLM

    out = tmp_path_factory.mktemp("hf_mimo")
    torch.manual_seed(0)
    model = MiMoV2FlashForCausalLM(hf_reference_config()).eval()
    _make_peaky(model)
    model.save_pretrained(out)
    config = ModelConfig.from_json_file(out / "config.json").with_mtp_layers(REF_MTP_LAYERS)
    append_mtp_shard(out, config)
    return out


@pytest.fixture(scope="session")
def hf_model(hf_checkpoint: Path):  # -> transformers.MiMoV2FlashForCausalLM
    from transformers import MiMoV2FlashForCausalLM

    return MiMoV2FlashForCausalLM.from_pretrained(hf_checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `tiny` preset with random weights and a tokenizer, as `swallow init-checkpoint` writes it."""
    return write_random_checkpoint(tmp_path_factory.mktemp("tiny") / "model", tiny(), seed=0)


@pytest.fixture
def checkpoint_copy(hf_checkpoint: Path, tmp_path: Path) -> Path:
    """A writable copy of the reference checkpoint, for tests that break it."""
    dst = tmp_path / "ckpt"
    shutil.copytree(hf_checkpoint, dst)
    return dst


def hf_greedy_outputs(hf_model: Any, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """transformers greedy output of ``max_new`` tokens for every prompt."""
    outs = []
    for prompt in prompts:
        out = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False, pad_token_id=0)
        outs.append(out[0, len(prompt):].tolist())
    return outs


def assert_pools_full(llm: Any) -> None:
    """Every KV slot is back in its pool once the prefix cache is flushed."""
    llm.flush_cache()
    stats = llm.stats()
    for pool in ("full_pool", "swa_pool"):
        assert stats[pool]["free_tokens"] == stats[pool]["capacity_tokens"], stats
