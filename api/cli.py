"""The serving commands of `swallow` (`serve`, the stack's roles, `plan`,
`init-checkpoint`); `python -m api.cli` runs them alone."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from api.models import ensure_default_model, write_random_multimodal
from api.options import (
    INDUCTOR_CACHE_DIR,
    add_embedding_cache_arguments,
    add_engine_arguments,
    add_http_arguments,
    add_route_arguments,
    add_serve_arguments,
    engine_argv,
    engine_options,
    server_options,
)

if TYPE_CHECKING:
    from api.routes import RouteSetFactory


def _plan(args: argparse.Namespace) -> int:
    import json

    from llm_core.plan import Hardware, plan
    from llm_core.model.presets import get_preset

    import torch

    from llm_core.model.fp8 import FP8_DTYPE

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
    from llm_core.model.presets import get_preset

    config = get_preset(args.preset)
    if args.fused_qkv and not args.fp8:
        raise ValueError("--fused-qkv goes with --fp8 (MiMo-V2.5 ships its fused qkv_proj in FP8)")
    fp8 = {"fp8_block": _block(args.fp8_block), "fused_qkv": args.fused_qkv} if args.fp8 else {}
    if args.multimodal:
        out = write_random_multimodal(args.dir, config, seed=args.seed, **fp8)
        kind = "multimodal: vision + audio encoders, chat template; "
    else:
        from llm_core.loading.checkpoint import write_random_checkpoint

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


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(0)


def _serve(args: argparse.Namespace) -> int:
    model_dir = Path(args.model) if args.model else ensure_default_model()
    options = server_options(args)
    # uvicorn shuts down on SIGTERM, then raises it again: with the default action
    # that would end the process before the `finally` below stops the engine core
    # and removes its shared-memory store and socket directory.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    core = None
    try:
        # The engine core loads its model while this process imports the HTTP side
        # and builds its encoders: a start takes the longer of the two, not both.
        core = _launch_engine_core(args, model_dir, options) if args.engine_core == "process" else None
        import uvicorn

        from api.metrics import ServerMetrics
        from api.server import create_app

        metrics = ServerMetrics()
        if core is None:
            model = _embedded_model(args, model_dir, options, metrics)
        else:
            from api.engine_core_frontend import EngineCoreFrontend

            model = EngineCoreFrontend(model_dir, engine_core=core, name=args.served_model_name, options=options,
                                       metrics=metrics, device=args.device, dtype=args.dtype)
            _wait_for_engine_core(core)
        print(f"Swallow is serving {model_dir} -- open http://{args.host}:{args.port}/ for the demo", flush=True)
        app = create_app(model, metrics, args.route_sets)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        if core is not None:
            core.stop()
    return 0


def _embedded_model(args: argparse.Namespace, model_dir: Path, options: Any, metrics: Any) -> Any:
    """`--engine-core thread`: the engine on a thread of this process."""
    import torch

    from api.runtime import ServingModel

    if args.engine_threads:
        torch.set_num_threads(args.engine_threads)
    return ServingModel(model_dir, name=args.served_model_name, options=options, metrics=metrics,
                        **engine_options(args))


def _launch_engine_core(args: argparse.Namespace, model_dir: Path, options: Any) -> Any:
    """`serve`'s engine core, started: loading (and compiling) its model."""
    from api.engine_core import (EngineCoreProcess, default_engine_threads, engine_core_plan, new_socket_dir,
                                 new_store_name)

    threads = args.engine_threads or default_engine_threads()
    socket_dir = new_socket_dir()
    plan = engine_core_plan(model_dir, engine_argv(args), store_name=options.embedding_cache_name or new_store_name(),
                            threads=threads, log_level=args.log_level, socket_dir=socket_dir,
                            kv_disk_dir=args.kv_disk_dir)
    core = EngineCoreProcess(plan, options.embedding_cache_bytes, socket_dir,
                             own_store=options.embedding_cache_name is None)
    print(f"starting the engine core ({threads} torch threads)", flush=True)
    core.launch()
    return core


def _wait_for_engine_core(core: Any) -> None:
    """Until the engine core is healthy (built, and compiled)."""
    import time

    started = time.perf_counter()
    core.wait_ready()
    pid = core.supervisor.pids()[core.plan.roles[0].name]
    print(f"the engine core (pid {pid}) is ready ({time.perf_counter() - started:.1f} s after the API)", flush=True)


def _add_role_parsers(sub: Any, route_sets: Sequence[RouteSetFactory]) -> None:
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
    api.set_defaults(func=_run_role, route_sets=tuple(route_sets))

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
    """The serving commands alone: what `python -m api.cli` runs (the stack's
    processes, launched servers). `swallow` adds the demo's and the benches'."""
    parser = argparse.ArgumentParser(prog="swallow", description="Hybrid-SWA MoE serving")
    add_serving_commands(parser.add_subparsers(dest="command", required=True))
    return parser


def add_serving_commands(sub: Any, route_sets: Sequence[RouteSetFactory] = ()) -> None:
    """`serve`, the stack's roles, `plan` and `init-checkpoint` on a command line's
    sub-commands; the HTTP servers (`serve`, `api`) also mount ``route_sets``."""
    serve = sub.add_parser("serve", help="serve a checkpoint over HTTP (OpenAI-compatible): the API here, the "
                                         "engine core in its own process")
    add_serve_arguments(serve)
    serve.set_defaults(func=_serve, route_sets=tuple(route_sets))

    _add_role_parsers(sub, route_sets)

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


def main(argv: Sequence[str] | None = None, parser: argparse.ArgumentParser | None = None) -> int:
    """Runs a command of ``parser`` (default: the serving commands); a refused input is an error line and exit 2."""
    args = (parser or build_parser()).parse_args(argv)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(INDUCTOR_CACHE_DIR))
    try:
        return args.func(args)
    except (ValueError, OSError) as exc:
        print(f"swallow {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
