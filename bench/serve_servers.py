"""The servers `swallow bench serve` drives, started and stopped: `swallow
serve` (the argv the bench gives it, the engine options and torch threads
that argv means, so that the offline side runs with the same, its start-up
times over an empty and a warm inductor cache, its recompile counter) and
vLLM's OpenAI server from another venv on Swallow's checkpoint exported for
it (tools/vllm_peer.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx

from api.launch import LOCALHOST, RunningServer, free_port, launch_command, launch_server
from bench.load_mix import flush_cache
from bench.serve_drivers import Plan, Run, Target, served_model_name

__all__ = ["RECOMPILES", "ServedResult", "SwallowServer", "parsed_engine_options", "recompiles_in", "server_args_for",
           "server_engine_threads", "split_server_args", "swallow_server", "torch_threads", "vllm_argv", "vllm_env",
           "vllm_server"]

RECOMPILES = "swallow_recompiles_total"
# Compiling servers (and vLLM, which compiles at start-up) take minutes on 2 cores.
STARTUP_TIMEOUT_S = 900.0
VLLM_MAX_MODEL_LEN = 1024  # the longest request is 512 + 256 tokens
VLLM_PEER = Path(__file__).resolve().parents[1] / "tools" / "vllm_peer.py"


def split_server_args(values: Sequence[str]) -> list[str]:
    """``--server-arg`` values, each split like a shell would: "--kv-budget-mib 512"."""
    return [part for value in values for part in shlex.split(value)]


def server_args_for(compile: bool | None, speculative_tokens: int | None, extra: Sequence[str]) -> list[str]:
    """`swallow serve` arguments with compile always explicit (unset: the server's
    own default for the other arguments, e.g. on with --device cuda)."""
    if compile is None:
        compile = bool(parsed_engine_options(extra)["compile"])
    args = [*extra, "--compile" if compile else "--no-compile"]
    if speculative_tokens is not None:
        args += ["--speculative-tokens", str(speculative_tokens)]
    return args


def _serve_namespace(server_args: Sequence[str], model_dir: str | Path) -> argparse.Namespace:
    from api.options import add_serve_arguments

    parser = argparse.ArgumentParser(prog="swallow serve")
    add_serve_arguments(parser)
    return parser.parse_args(["--model", str(model_dir), *server_args])


def parsed_engine_options(server_args: Sequence[str], model_dir: str | Path = "unused") -> dict[str, Any]:
    """The engine options `swallow serve SERVER_ARGS` builds: offline runs with exactly these."""
    from api.options import engine_options

    return engine_options(_serve_namespace(server_args, model_dir))


def server_engine_threads(server_args: Sequence[str]) -> int | None:
    """The torch threads `swallow serve SERVER_ARGS` gives its engine (None: torch's
    default), for the offline engine to get as many: on 2 cores, 2 threads against 1
    is the whole difference (and 2 threads collapse when anything else runs)."""
    args = _serve_namespace(server_args, "unused")
    if getattr(args, "engine_threads", None):
        return args.engine_threads
    if getattr(args, "engine_core", "thread") == "thread":  # in the API process: torch's default
        return None
    from api.engine_core import default_engine_threads

    return default_engine_threads()


@contextmanager
def torch_threads(threads: int | None) -> Iterator[int]:
    """``threads`` intra-op threads in this process for a while (None: as they are)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


@contextmanager
def _timed_server(model_dir: Path, server_args: Sequence[str], inductor_cache: Path
                  ) -> Iterator[tuple[RunningServer, float]]:
    env = os.environ | {"TORCHINDUCTOR_CACHE_DIR": str(inductor_cache)}
    started = time.perf_counter()
    with launch_server(model_dir, *server_args, env=env, startup_timeout_s=STARTUP_TIMEOUT_S) as server:
        yield server, time.perf_counter() - started


def recompiles_in(metrics_text: str) -> float | None:
    """``swallow_recompiles_total`` summed over its labels; None when the server has no such counter."""
    from prometheus_client.parser import text_string_to_metric_families

    values = [sample.value for family in text_string_to_metric_families(metrics_text)
              for sample in family.samples if sample.name == RECOMPILES]
    return sum(values) if values else None


def _recompiles(url: str) -> float | None:
    response = httpx.get(f"{url}/metrics", timeout=30)
    response.raise_for_status()
    return recompiles_in(response.text)


@dataclass
class ServedResult:
    runs: dict[int, list[Run]]
    ready_s_cold: float
    ready_s_warm: float
    recompiles: float | None


@dataclass(frozen=True)
class SwallowServer:
    target: Target
    ready_s_cold: float
    ready_s_warm: float
    recompiles_at_ready: float | None

    def result(self, runs: dict[int, list[Run]], notes: list[str]) -> ServedResult:
        now = _recompiles(self.target.url)
        if self.recompiles_at_ready is None or now is None:
            notes.append(f"the server's /metrics has no {RECOMPILES} counter: recompiles_after_ready is null")
            recompiles = None
        else:
            recompiles = now - self.recompiles_at_ready
        return ServedResult(runs, self.ready_s_cold, self.ready_s_warm, recompiles)


@contextmanager
def swallow_server(model_dir: Path, server_args: Sequence[str], plan: Plan) -> Iterator[SwallowServer]:
    """`swallow serve` started over an empty inductor cache (timed, stopped),
    then again over the cache it left (timed): the second one serves."""
    with tempfile.TemporaryDirectory(prefix="swallow-inductor-") as cache:
        with _timed_server(model_dir, server_args, Path(cache)) as (_, cold):
            plan.log(f"swallow serve ready in {cold:.1f} s (empty inductor cache)")
        with _timed_server(model_dir, server_args, Path(cache)) as (server, warm):
            plan.log(f"swallow serve ready in {warm:.1f} s (warm inductor cache)")
            before = _recompiles(server.url)  # just after ready: before any request
            target = Target(server.url, served_model_name(server.url), flush_cache)
            yield SwallowServer(target, round(cold, 2), round(warm, 2), before)


def _vllm_peer() -> ModuleType:
    """tools/vllm_peer.py, by path: tools/ is not a package the repo installs."""
    spec = importlib.util.spec_from_file_location("vllm_peer", VLLM_PEER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _reset_vllm_prefix_cache(url: str) -> None:
    """vLLM's counterpart of /flush_cache (a dev-mode route, as its own sweep benchmark uses)."""
    response = httpx.post(f"{url}/reset_prefix_cache", timeout=60)
    response.raise_for_status()
    if response.json().get("success") is not True:
        raise RuntimeError(f"vLLM did not reset its prefix cache: {response.text[:200]}")


def vllm_argv(python: str, model_dir: Path, port: int) -> list[str]:
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--host", LOCALHOST,
            "--port", str(port), "--skip-tokenizer-init", "--max-model-len", str(VLLM_MAX_MODEL_LEN),
            "--dtype", "float32", "--uvicorn-log-level", "warning"]


def vllm_env(peer: ModuleType) -> dict[str, str]:
    env = {**peer.RUN_ENV, **os.environ}  # the peer script's settings, unless the caller set them
    # Dev mode: for /reset_prefix_cache. Safe path: the repo root (the cwd) holds packages
    # named api, media, ... that must not shadow anything in vLLM's venv.
    return env | {"VLLM_SERVER_DEV_MODE": "1", "PYTHONSAFEPATH": "1"}


@contextmanager
def vllm_server(python: str, model_dir: Path, plan: Plan) -> Iterator[tuple[Target, dict[str, Any]]]:
    """vLLM's OpenAI server on Swallow's checkpoint exported for it, and what to report of it."""
    from llm_core.model.presets import tiny

    peer = _vllm_peer()
    with tempfile.TemporaryDirectory(prefix="swallow-vllm-") as tmp:
        exported = peer.export_checkpoint(model_dir, tiny(), Path(tmp) / "model")
        port, env = free_port(), vllm_env(peer)
        argv = vllm_argv(python, exported, port)
        started = time.perf_counter()
        with launch_command(argv, port, env=env, startup_timeout_s=STARTUP_TIMEOUT_S, log_prefix="vllm-") as server:
            ready_s = time.perf_counter() - started
            plan.log(f"vLLM ready in {ready_s:.1f} s")
            version = httpx.get(f"{server.url}/version", timeout=30).json().get("version")
            target = Target(server.url, served_model_name(server.url), _reset_vllm_prefix_cache,
                            {"return_token_ids": True})
            about = {"version": version, "ready_s": round(ready_s, 2), "argv": argv[1:],
                     "env": {k: env[k] for k in (*peer.REPORTED_ENV, "VLLM_SERVER_DEV_MODE") if k in env}}
            yield target, about
