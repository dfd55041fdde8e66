"""The stack's roles from their command lines (`swallow api|encoder|worker|stack`)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
from pathlib import Path

from api.options import engine_argv, engine_options, passed_arguments, server_options

__all__ = ["run"]


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format=f"%(asctime)s {args.command} %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per health check otherwise
    code = {"api": _api, "encoder": _encoder, "worker": _worker, "stack": _stack}[args.command](args)
    if args.command in ("encoder", "worker"):
        # Everything is closed and written; the interpreter's own teardown of
        # torch and friends takes seconds that a stopping stack need not wait.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _model_dir(args: argparse.Namespace) -> Path:
    from api.models import ensure_default_model

    return Path(args.model) if args.model else ensure_default_model()


def _id(args: argparse.Namespace, role: str) -> str:
    return getattr(args, f"{role}_id") or f"{role}-{socket.gethostname()}-{args.port}"


def _api(args: argparse.Namespace) -> int:
    import uvicorn

    from api.metrics import ServerMetrics
    from api.server import create_app
    from api.stack.frontend import StackFrontend

    model_dir = _model_dir(args)
    metrics = ServerMetrics()
    frontend = StackFrontend(model_dir, workers=args.workers, encoders=args.encoders, name=args.served_model_name,
                             options=server_options(args), metrics=metrics, route_policy=args.route_policy,
                             route_load_weight=args.route_load_weight,
                             route_max_load_ratio=args.route_max_load_ratio, shared_spool=args.shared_spool)
    print(f"Swallow API for {model_dir} on http://{args.host}:{args.port}/ (workers {args.workers}, "
          f"route policy {args.route_policy})", flush=True)
    uvicorn.run(create_app(frontend, metrics, getattr(args, "route_sets", ())), host=args.host, port=args.port, log_level=args.log_level)
    return 0


def _encoder(args: argparse.Namespace) -> int:
    from api.stack.encoder import EncoderConfig, run_encoder

    if not args.embedding_cache_name:
        raise ValueError("an encoder needs --embedding-cache-name: the store the workers read")
    config = EncoderConfig(
        _model_dir(args), args.host, args.port, args.health_port, _id(args, "encoder"), args.embedding_cache_name,
        int(args.embedding_cache_mib * (1 << 20)), args.device, args.dtype, int(args.max_upload_mb * (1 << 20)),
        args.embedding_peers, args.embedding_node)
    asyncio.run(run_encoder(config))
    return 0


def _worker(args: argparse.Namespace) -> int:
    from api.stack.worker import WorkerConfig, run_worker

    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)

    config = WorkerConfig(
        _model_dir(args), args.host, args.port, args.health_port, _id(args, "worker"), engine_options(args),
        args.max_pending_requests, args.embedding_cache_name, args.embedding_peers, args.embedding_node,
        args.log_level, args.role, args.kv_transport, args.transfer_timeout, args.ipc, not args.no_kv_events)
    asyncio.run(run_worker(config))
    return 0


def _stack(args: argparse.Namespace) -> int:
    from api.stack.plan import free_ports, plan_stack
    from api.stack.supervisor import run_stack

    roles = ["prefill"] * args.prefill_workers + ["decode"] * args.decode_workers
    if bool(args.prefill_workers) != bool(args.decode_workers):
        raise ValueError("a disaggregated stack needs both --prefill-workers and --decode-workers")
    workers = len(roles) or args.workers
    count = 2 * (workers + args.encoders)
    ports = list(range(args.base_port, args.base_port + count)) if args.base_port else free_ports(count)
    plan = plan_stack(
        _model_dir(args), workers=workers, encoders=args.encoders, host=args.host, port=args.port,
        internal_ports=ports, store_name=f"swallow-stack-{os.getpid()}", embedding_cache_mib=args.embedding_cache_mib,
        route_args=passed_arguments(args, ("--route-policy", "route_policy"), ("--route-load-weight", "route_load_weight"),
                          ("--route-max-load-ratio", "route_max_load_ratio")),
        http_args=passed_arguments(args, ("--served-model-name", "served_model_name"), ("--api-key", "api_key"),
                          ("--max-upload-mb", "max_upload_mb"), ("--spool-dir", "spool_dir"),
                          ("--max-pending-requests", "max_pending_requests")),
        engine_args=engine_argv(args), kv_disk_dir=args.kv_disk_dir, log_level=args.log_level,
        worker_roles=roles, worker_args=_worker_args(args, disaggregated=bool(roles)))
    return run_stack(plan, int(args.embedding_cache_mib * (1 << 20)), print_plan=args.print_plan)


def _worker_args(args: argparse.Namespace, disaggregated: bool) -> list[str]:
    out = passed_arguments(args, ("--torch-threads", "torch_threads"))
    if disaggregated:
        out += ["--kv-transport", args.kv_transport, "--transfer-timeout", str(args.transfer_timeout)]
    return out


