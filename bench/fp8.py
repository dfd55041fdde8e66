"""`swallow bench fp8`: the published FP8 checkpoints, end to end.

* ``identical_greedy``: FP8 hub-layout checkpoints (partial scale blocks in
  both dimensions, MTP layers, MiMo-V2.5's fused qkv_proj, a multimodal one)
  give the greedy tokens transformers gives on their dequantized weights
  (``llm_core.loading.fp8_dequantize``, which shares nothing with the loader).
* ``weights_bytes_fp8`` / ``weights_bytes_bf16``: MiMo-V2-Flash's weights as
  the engine holds them, counted on the meta device.
* ``load_peak_rss_over_resident``: a fresh process loads an FP8 checkpoint
  written here (dequantizing to bfloat16): its peak resident memory during
  the load, less what it held before, over the loaded model's bytes.
* ``kv_capacity_fp8_over_bf16``: 128K-token requests of MiMo-V2.5-Pro an FP8
  KV cache fits against a BF16 one, in the same budget, through the allocator.
* ``demo_eval_bf16_kv`` / ``demo_eval_fp8_kv``: the demo model's eval accuracy
  with each KV dtype (the model itself runs in float32).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench import log
from llm_core import LLM, SamplingParams
from llm_core.kv.kv_capacity import GIB, kv_capacity
from llm_core.loading.checkpoint import write_random_checkpoint
from llm_core.model.config import ModelConfig
from llm_core.model.fp8 import FP8_DTYPE
from llm_core.loading.fp8_dequantize import write_dequantized_copy
from llm_core.plan import weight_bytes
from llm_core.model.presets import get_preset, tiny, tiny_kv2, tiny_wide

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "demo"
# (config, block, fused qkv_proj, multimodal)
GREEDY_CASES: dict[str, tuple[Callable[[], ModelConfig], tuple[int, int], bool, bool]] = {
    "partial-blocks-mtp": (tiny_wide, (64, 64), False, False),
    "fused-qkv": (tiny_kv2, (32, 32), True, False),
    "multimodal": (tiny, (128, 128), False, True),
}
NUM_PROMPTS, MAX_TOKENS = 6, 16


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (3, 17, 33, 60, 90, 130)][:NUM_PROMPTS]


def _transformers_greedy(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    try:
        from transformers import MiMoV2FlashForCausalLM
    except ImportError as exc:
        raise RuntimeError("bench fp8 checks against transformers (pip install -e '.[dev]')") from exc
    model = MiMoV2FlashForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False,
                                 pad_token_id=0)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs


def identical_greedy(root: Path, log: Callable[[str], None]) -> dict[str, bool]:
    from api.models import write_random_multimodal

    result = {}
    for name, (make, block, fused, multimodal) in GREEDY_CASES.items():
        config = make()
        out = root / name
        if multimodal:
            fp8 = write_random_multimodal(out / "fp8", config, seed=5, fp8_block=block, fused_qkv=fused)
        else:
            fp8 = write_random_checkpoint(out / "fp8", config, seed=5, fp8_block=block, fused_qkv=fused)
        prompts = _prompts(config.vocab_size)
        ours = [o.token_ids for o in LLM(fp8).generate(prompts, SamplingParams(max_tokens=MAX_TOKENS,
                                                                                 ignore_eos=True))]
        result[name] = ours == _transformers_greedy(write_dequantized_copy(fp8, out / "dequantized"), prompts)
        log(f"fp8 greedy {name}: {'identical' if result[name] else 'DIFFERENT'} to transformers")
    return result


# A checkpoint big enough that the interpreter's own memory is small beside it:
# 8 layers of 32 experts of 1024 x 512, about 290M parameters (290 MB as FP8).
_LOAD_CONFIG = dataclasses.replace(tiny(), vocab_size=32000, hidden_size=1024, intermediate_size=2048,
                                   num_hidden_layers=8, layer_types=("full",) + ("sliding",) * 6 + ("full",),
                                   mlp_layer_types=("dense",) + ("sparse",) * 7, moe_intermediate_size=512,
                                   n_routed_experts=32, num_experts_per_tok=4, n_group=1, topk_group=1,
                                   num_mtp_layers=1)
_MEASURE = """
import gc, json, sys, torch
from llm_core.model.fp8_linear import resident_weight_bytes
from llm_core.loading.weights import load_model

def kib(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

# A tiny model's load first: what a process sets up once (kernel libraries'
# buffers, thread pools) is not the load's, and is not memory to reuse either.
load_model(sys.argv[2], dtype=torch.bfloat16)
gc.collect()
before = kib("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak (VmHWM) restarts from now
model = load_model(sys.argv[1], dtype=torch.bfloat16)
print(json.dumps({"before": before, "peak": kib("VmHWM"), "resident": resident_weight_bytes(model)}))
"""


def load_peak(root: Path, log: Callable[[str], None], config: ModelConfig = _LOAD_CONFIG) -> dict[str, Any]:
    started = time.monotonic()
    fp8 = write_random_checkpoint(root / "load", config, seed=1, fp8_block=(128, 128))
    file_bytes = sum(f.stat().st_size for f in fp8.glob("*.safetensors"))
    log(f"wrote a {file_bytes / 1e6:.0f} MB FP8 checkpoint in {time.monotonic() - started:.0f} s")
    warm = write_random_checkpoint(root / "warm-up", tiny(), seed=1, fp8_block=(128, 128))
    run = subprocess.run([sys.executable, "-c", _MEASURE, str(fp8), str(warm)], capture_output=True, text=True,
                         cwd=ROOT, check=False)
    if run.returncode:
        raise RuntimeError(f"the load measurement failed: {run.stderr[-2000:]}")
    measured = json.loads(run.stdout.strip().splitlines()[-1])
    ratio = (measured["peak"] - measured["before"]) / measured["resident"]
    return {"load_peak_rss_over_resident": round(ratio, 4), "load_checkpoint_file_bytes": file_bytes,
            "load_resident_bytes": measured["resident"], "load_peak_rss_bytes": measured["peak"] - measured["before"]}


def kv_capacity_ratio(context: int = 131072, budget_gib: float = 1024.0) -> dict[str, Any]:
    config = get_preset("mimo-v2.5-pro")
    budget = int(budget_gib * GIB)
    bf16 = kv_capacity(config, context, budget, dtype=torch.bfloat16)["hybrid_max_requests"]
    fp8 = kv_capacity(config, context, budget, dtype=FP8_DTYPE)["hybrid_max_requests"]
    return {"kv_capacity_fp8_over_bf16": round(fp8 / bf16, 4), "kv_requests_bf16": bf16, "kv_requests_fp8": fp8,
            "kv_capacity_context": context, "kv_capacity_budget_gib": budget_gib}


def demo_evals(per_task: int, log: Callable[[str], None]) -> dict[str, Any]:
    from demo.evaluate import eval_demo

    out: dict[str, Any] = {}
    for label, kv in (("bf16", "bf16"), ("fp8", "fp8_e4m3")):
        started = time.monotonic()
        result = eval_demo(DEMO, per_task=per_task, concurrencies=(16,), prefix_caching=(True,),
                           engine_options={"kv_cache_dtype": kv})
        out[f"demo_eval_{label}_kv"] = result["overall_accuracy"]
        out[f"demo_eval_{label}_kv_worst_task"] = result["worst_task_accuracy"]
        log(f"demo eval, {kv} KV: {result['overall_accuracy']} ({time.monotonic() - started:.0f} s)")
    out["demo_eval_items"] = result["items"]
    out["demo_eval_fp8_minus_bf16"] = round(out["demo_eval_fp8_kv"] - out["demo_eval_bf16_kv"], 4)
    return out


def fp8_bench(per_task: int = 6, log: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    started = time.monotonic()
    flash = get_preset("mimo-v2-flash")
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="swallow-fp8-") as tmp:
        greedy = identical_greedy(Path(tmp), log)
        result["identical_greedy"] = all(greedy.values())
        result["identical_greedy_cases"] = greedy
        result |= load_peak(Path(tmp), log)
    fp8, bf16 = weight_bytes(flash, "fp8"), weight_bytes(flash, "bf16")
    result |= {"weights_bytes_fp8": fp8.total, "weights_bytes_bf16": bf16.total,
               "weights_bf16_over_fp8": round(bf16.total / fp8.total, 4)}
    result |= kv_capacity_ratio()
    result |= demo_evals(per_task, log)
    result["seconds"] = round(time.monotonic() - started, 1)
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fp8-eval-per-task", type=int, default=6, help="demo eval items per task, with each KV dtype")


def run(args: argparse.Namespace) -> dict[str, Any]:
    return fp8_bench(per_task=args.fp8_eval_per_task, log=log)
