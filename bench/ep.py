"""Expert parallelism on CPU: the same greedy requests through 1, 2 and 4
gloo ranks (processes on this host), with the tokens and every logit row
compared against one rank, the all-to-all bytes the ranks exchanged per step
and per token, and what ``swallow plan``'s formula predicts for them.

On CPU, with every rank on the same few cores, tokens/s says little (the
ranks share the cores and the collectives are loopback TCP); the identity
and the bytes are the point.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from api.models import DEMO_MODEL_DIR
from llm_core.loading.checkpoint import write_random_checkpoint
from llm_core.model.config import ModelConfig
from llm_core.llm import LLM
from llm_core.plan import all_to_all_bytes_per_token
from llm_core.model.presets import tiny
from llm_core.sample.params import SamplingParams
from llm_core.loading.weights import CheckpointReader, read_config

DEFAULT_SIZES = (1, 2, 4)
LOGIT_TOLERANCE = 1e-5
_ROUTED = (".experts.gate_up_proj", ".experts.down_proj")


def ep_bench(model_dir: str | Path | None = None, sizes: Sequence[int] = DEFAULT_SIZES, num_prompts: int = 6,
             max_tokens: int = 24, chunk: int = 64, threads: int = 1, seed: int = 0) -> dict[str, Any]:
    """``model_dir``: a checkpoint whose expert count every size divides
    (None: the ``tiny`` preset with random weights, written to a temporary
    directory). Prompts of 8 to 3 x ``chunk`` tokens, prefilled ``chunk``
    tokens at a time; ``threads``: torch threads of every rank."""
    if sizes[0] != 1:
        raise ValueError("the first EP size is the one-rank baseline: it must be 1")
    with tempfile.TemporaryDirectory() as tmp:
        if model_dir is None:
            model_dir = write_random_checkpoint(Path(tmp) / "model", tiny(), seed=seed)
        config = _config(model_dir)
        for size in sizes:
            if config.n_routed_experts % size:
                raise ValueError(f"{model_dir} has {config.n_routed_experts} routed experts: "
                                 f"{size} ranks cannot split them")
        prompts = _prompts(num_prompts, config.vocab_size, chunk, seed)
        before = torch.get_num_threads()
        torch.set_num_threads(threads)  # the followers take the leader's count
        try:
            runs = {size: _run(model_dir, size, prompts, max_tokens, chunk) for size in sizes}
        finally:
            torch.set_num_threads(before)
    return _report(model_dir, config, runs, len(prompts), max_tokens, threads)


def _config(model_dir: str | Path) -> ModelConfig:
    with CheckpointReader(model_dir) as reader:
        return read_config(model_dir, reader)


def _prompts(count: int, vocab: int, chunk: int, seed: int) -> list[list[int]]:
    """Token prompts of varied lengths, the longest over several prefill chunks."""
    rng = random.Random(seed)
    lengths = [8 + (3 * chunk - 8) * i // max(count - 1, 1) for i in range(count)]
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _run(model_dir: str | Path, size: int, prompts: list[list[int]], max_tokens: int, chunk: int) -> dict[str, Any]:
    started = time.perf_counter()
    llm = LLM(model_dir, ep_size=size, chunked_prefill_size=chunk, max_num_batched_tokens=2 * chunk,
              enable_prefix_caching=False)
    try:
        startup = time.perf_counter() - started
        logits: list[torch.Tensor] = []
        llm.model.compute_logits = _recording(llm.model.compute_logits, logits)  # type: ignore[method-assign]
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        seconds = time.perf_counter() - start
        stats = llm.ep.stats.as_dict() if llm.ep is not None else None
        routed = sum(p.numel() * p.element_size() for name, p in llm.model.named_parameters() if name.endswith(_ROUTED))
    finally:
        llm.close()
    return {"tokens": [o.token_ids for o in outputs], "logits": logits, "seconds": seconds, "startup_s": startup,
            "stats": stats, "routed_expert_bytes": routed,
            "element_bytes": llm.model.lm_head.weight.element_size()}


def _recording(compute: Callable[[torch.Tensor], torch.Tensor],
               into: list[torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    def compute_logits(hidden: torch.Tensor) -> torch.Tensor:
        logits = compute(hidden)
        into.append(logits.detach().clone())
        return logits

    return compute_logits


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Largest absolute logit difference (inf when the runs computed different rows)."""
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        return float("inf")
    return max((float((x - y).abs().max()) for x, y in zip(a, b) if x.numel()), default=0.0)


def _report(model_dir: str | Path, config: ModelConfig, runs: dict[int, dict[str, Any]], num_prompts: int,
            max_tokens: int, threads: int) -> dict[str, Any]:
    base = runs[1]
    sparse_layers = sum(t == "sparse" for t in config.mlp_layer_types)
    rows: dict[str, Any] = {}
    worst = 0.0
    identical = True
    for size, run in runs.items():
        diff = _max_diff(base["logits"], run["logits"])
        same = run["tokens"] == base["tokens"]
        row: dict[str, Any] = {
            "tokens_identical": same,
            "max_logit_diff": diff,
            "tokens_per_s": round(sum(map(len, run["tokens"])) / run["seconds"], 1),
            "startup_s": round(run["startup_s"], 2),
            "routed_expert_bytes_per_rank": run["routed_expert_bytes"],
            "plan_all_to_all_bytes_per_token": all_to_all_bytes_per_token(config, size, run["element_bytes"]),
        }
        stats = run["stats"]
        if stats is None:
            row.update(steps=None, all_to_all_bytes_per_step=0, all_to_all_bytes_per_token=0)
        else:
            steps = stats["layer_calls"] // sparse_layers  # model forwards
            tokens = stats["token_rows"] / sparse_layers  # token rows through those forwards
            row.update(steps=steps, all_to_all_bytes_per_step=round(stats["all_to_all_bytes"] / steps),
                       all_to_all_bytes_per_token=round(stats["all_to_all_bytes"] / tokens),
                       all_gather_bytes_per_step=round(stats["gather_bytes"] / steps),
                       remote_slot_fraction=round(stats["remote_slots"] / (stats["token_rows"]
                                                                           * config.num_experts_per_tok), 4))
        rows[str(size)] = row
        if size != 1:
            worst = max(worst, diff)
            identical = identical and same and diff <= LOGIT_TOLERANCE
    return {
        "model": str(model_dir),
        "routed_experts": config.n_routed_experts,
        "experts_per_token": config.num_experts_per_tok,
        "sparse_layers": sparse_layers,
        "prompts": num_prompts,
        "max_tokens": max_tokens,
        "threads_per_rank": threads,
        "backend": "gloo",
        "identical": identical,
        "max_logit_diff": worst,
        "logit_tolerance": LOGIT_TOLERANCE,
        "ranks": rows,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="checkpoint to run (default: the demo model, else a random tiny one)")
    parser.add_argument("--ep-prompts", type=int, default=6, help="greedy requests run together")
    parser.add_argument("--ep-max-tokens", type=int, default=24, help="tokens generated per request")


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = args.model or (DEMO_MODEL_DIR if (DEMO_MODEL_DIR / "config.json").exists() else None)
    return ep_bench(model, num_prompts=args.ep_prompts, max_tokens=args.ep_max_tokens)
