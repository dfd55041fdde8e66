"""What the commands take: their argument groups, and the engine and server
options those build. `swallow`'s parser, the stack's roles and the benchmarks
that start servers all read arguments through here."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# `serve --engine-core`: its own process (the default), or a thread of the API process.
ENGINE_CORE_MODES = ("process", "thread")
# A step's token budget. On CPU a prefill step costs ~40 us a token, so a
# burst of prompts is served in finer steps: measured with `swallow bench
# serve` at 32 concurrent requests, 2048 gave a 20% lower TTFT p50 than 4096
# at the same throughput (1024 cost throughput).
CPU_BATCHED_TOKENS = 2048
ACCELERATOR_BATCHED_TOKENS = 4096
CPU_PREFILL_BATCH_TOKENS = 256
# Compiled graphs are kept where a restarted server (and its engine core) finds them.
INDUCTOR_CACHE_DIR = Path.home() / ".cache" / "swallow" / "inductor"


@dataclass(frozen=True)
class ServerOptions:
    """What the HTTP front end is built with (`serve`, `api`)."""

    api_key: str | None = None
    max_upload_bytes: int = 512 << 20
    spool_dir: Path | None = None  # default: a fresh directory under the system temp dir
    max_pending_requests: int = 256
    embedding_cache_bytes: int = 256 << 20
    # Processes on one machine that name the same store share embeddings.
    embedding_cache_name: str | None = None
    # Output parsers by name ("mimo", or "none"); None: the checkpoint's own (config.json model_type).
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None


def add_serve_arguments(serve: argparse.ArgumentParser) -> None:
    """What `swallow serve` takes (also how `bench serve` reads a server's arguments)."""
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
    group.add_argument("--prefill-batch-tokens", type=int,
                       help="once a step's prefill holds this many tokens, waiting requests go in the next step "
                            "(0: only --max-num-batched-tokens limits it; default: "
                            f"{CPU_PREFILL_BATCH_TOKENS} on CPU, where a prompt costs the same per token at any "
                            "batch size and a second prompt in a step only delays the first one's first token; "
                            "0 elsewhere)")
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


def prefill_batch_tokens(given: int | None, device: str) -> int | None:
    """``--prefill-batch-tokens`` as the engine takes it (None: no limit but the budget)."""
    if given is not None and given < 0:
        raise SystemExit(f"--prefill-batch-tokens: 0 or more tokens, got {given}")
    if given is None:
        return CPU_PREFILL_BATCH_TOKENS if device == "cpu" else None
    return given or None


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
        "prefill_batch_tokens": prefill_batch_tokens(args.prefill_batch_tokens, args.device),
        "enable_prefix_caching": not args.no_prefix_caching,
        # Expert parallelism runs eager (its all-to-alls have data-dependent sizes).
        "compile": args.device.startswith("cuda") and args.ep_size == 1 if args.compile is None else args.compile,
        "cuda_graph_max_batch": args.cuda_graph_max_batch,
        "speculative_tokens": args.speculative_tokens,
        "schedule_policy": args.schedule_policy,
        "schedule_bucket_edges": bucket_edges(args.schedule_buckets),
        **kv_tier_options(args),
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


def server_options(args: argparse.Namespace) -> ServerOptions:
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


def bucket_edges(text: str | None) -> tuple[int, ...] | None:
    """``--schedule-buckets``: None for the default, () for one bucket."""
    if text is None:
        return None
    if text.strip().lower() == "none":
        return ()
    try:
        return tuple(int(float(part)) for part in text.split(","))
    except ValueError:
        raise SystemExit(f"--schedule-buckets: comma-separated token counts, got {text!r}") from None


def kv_tier_options(args: argparse.Namespace) -> dict[str, Any]:
    """Engine options of the host and disk KV tiers: a disk directory alone
    turns both on with default budgets."""
    disk_gib = args.kv_disk_gib if args.kv_disk_gib is not None else (8.0 if args.kv_disk_dir else 0.0)
    host_gib = args.kv_host_gib if args.kv_host_gib is not None else (1.0 if disk_gib else 0.0)
    if disk_gib and not args.kv_disk_dir:
        raise ValueError("--kv-disk-gib needs --kv-disk-dir")
    return {"kv_host_bytes": int(host_gib * (1 << 30)), "kv_disk_bytes": int(disk_gib * (1 << 30)),
            "kv_disk_dir": args.kv_disk_dir}


def add_route_arguments(parser: argparse.ArgumentParser) -> None:
    from llm_core.cluster.router import DEFAULT_LOAD_WEIGHT, DEFAULT_MAX_LOAD_RATIO, ROUTE_POLICIES

    parser.add_argument("--route-policy", default="kv-affinity", choices=ROUTE_POLICIES,
                        help="kv-affinity (default): the worker that can reuse the longest window-safe prefix, "
                             "less a load term; round-robin; least-load")
    parser.add_argument("--route-load-weight", type=float, default=DEFAULT_LOAD_WEIGHT,
                        help="kv-affinity: tokens of queue one token of reuse is worth giving up "
                             f"(default {DEFAULT_LOAD_WEIGHT})")
    parser.add_argument("--route-max-load-ratio", type=float, default=DEFAULT_MAX_LOAD_RATIO,
                        help="kv-affinity: a worker whose work so far exceeds this times the mean (plus one "
                             f"request) takes no request while another is under it (default {DEFAULT_MAX_LOAD_RATIO})")


def passed_arguments(args: argparse.Namespace, *options: tuple[str, str]) -> list[str]:
    """The ``(flag, attribute)`` options set in ``args``, as command-line arguments again."""
    out: list[str] = []
    for flag, name in options:
        value = getattr(args, name)
        if value is not None:
            out += [flag, str(value)]
    return out


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine options set in ``args`` as arguments again: a worker's (or the engine core's) command line."""
    out = passed_arguments(args, ("--device", "device"), ("--dtype", "dtype"), ("--kv-budget-mib", "kv_budget_mib"),
                  ("--max-running-requests", "max_running_requests"),
                  ("--max-num-batched-tokens", "max_num_batched_tokens"),
                  ("--prefill-batch-tokens", "prefill_batch_tokens"),
                  ("--cuda-graph-max-batch", "cuda_graph_max_batch"), ("--speculative-tokens", "speculative_tokens"),
                  ("--schedule-policy", "schedule_policy"), ("--schedule-buckets", "schedule_buckets"),
                  ("--kv-host-gib", "kv_host_gib"), ("--kv-disk-gib", "kv_disk_gib"),
                  ("--quantization", "quantization"), ("--kv-cache-dtype", "kv_cache_dtype"))
    if args.no_prefix_caching:
        out.append("--no-prefix-caching")
    if args.ep_size != 1:
        out += ["--ep-size", str(args.ep_size)]
    if args.compile is not None:
        out.append("--compile" if args.compile else "--no-compile")
    return out
