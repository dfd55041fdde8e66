"""`swallow serve`'s engine core in its own process.

The API process keeps HTTP, chat templates, tokenising, detokenising, SSE
and the media encoders; the engine core is the stack's worker role (the same
engine-core loop, messages and supervision as `swallow stack`), started as a
child over a ZeroMQ IPC socket. So HTTP work never takes the engine's time
or its interpreter lock, and the engine steps on its own: each step's tokens
for every request go to the API as one frame. Media embeddings travel by key
through the shared-memory store the supervisor creates (the encoders here
write it, the engine core reads it), never as tensors.

This module is the process side, light to import: `serve` launches the
child first, then imports its HTTP side and builds its encoders
(``EngineCoreFrontend``, api/engine_core_frontend.py) while the child loads.
The child reports healthy only once its engine is built -- with ``--compile``,
once every graph serving uses is compiled -- so `serve` starts answering
HTTP only then. A child that dies is started again; a stopping `serve` stops
it, and a killed one takes it along (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import uuid
from pathlib import Path

from api.stack.plan import RolePlan, StackPlan, free_ports
from api.stack.supervisor import Supervisor

__all__ = ["EngineCoreProcess", "default_engine_threads", "engine_core_plan", "new_socket_dir", "new_store_name"]

WORKER_ID = "engine-core"


def default_engine_threads(cores: int | None = None) -> int:
    """The engine core's torch intra-op threads: every core but one, which the
    API process keeps for HTTP, tokenising and SSE (measured on 2 cores:
    docs/benchmarks.md, `swallow bench serve`); all of a single core."""
    cores = cores or len(os.sched_getaffinity(0))
    return max(1, cores - 1)


def engine_core_plan(model_dir: Path, engine_args: list[str], *, store_name: str, threads: int, log_level: str,
                     socket_dir: Path, kv_disk_dir: str | None = None) -> StackPlan:
    """One worker role on an IPC socket in ``socket_dir``, its health port on
    localhost; no KV events (a single engine has no router to tell)."""
    address = f"ipc://{socket_dir / 'engine.sock'}"
    (health_port,) = free_ports(1)
    argv = ["worker", "--model", str(model_dir), "--ipc", address.removeprefix("ipc://"),
            "--health-port", str(health_port), "--worker-id", WORKER_ID, "--embedding-cache-name", store_name,
            "--torch-threads", str(threads), "--no-kv-events", "--log-level", log_level, *engine_args]
    if kv_disk_dir:
        argv += ["--kv-disk-dir", kv_disk_dir]
    role = RolePlan(WORKER_ID, "worker", tuple(argv), f"http://127.0.0.1:{health_port}/health", address)
    return StackPlan((role,), store_name, url="")


def new_socket_dir() -> Path:
    """A directory of its own for the engine core's socket (``EngineCoreProcess``
    removes it on stop)."""
    return Path(tempfile.mkdtemp(prefix="swallow-engine-"))


class EngineCoreProcess:
    """The engine core's process, supervised from a thread of the API process;
    its output is the API process's own."""

    def __init__(self, plan: StackPlan, store_bytes: int, socket_dir: Path, own_store: bool = True) -> None:
        """``socket_dir``: made for the plan's socket, removed on stop.
        ``own_store``: the embedding store is this server's (removed when it
        stops), not one the user named for several processes to share."""
        self.plan = plan
        self.socket_dir = socket_dir
        self.supervisor = Supervisor(plan, store_bytes, announce=False, own_store=own_store, inherit_output=True)
        self._stop = threading.Event()
        self._watch: threading.Thread | None = None

    @property
    def address(self) -> str:
        return self.plan.roles[0].address

    def launch(self) -> None:
        """The process started, loading its model; ``wait_ready`` waits for it."""
        self.supervisor.launch()

    def wait_ready(self) -> None:
        """Returns once the engine core is healthy (built, and compiled)."""
        self.supervisor.wait_started()
        self._watch = threading.Thread(target=self._keep_running, name="swallow-engine-core-watch", daemon=True)
        self._watch.start()

    def _keep_running(self) -> None:
        while not self._stop.wait(0.2):
            self.supervisor.check()

    def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.join(timeout=5)
        self.supervisor.stop()
        shutil.rmtree(self.socket_dir, ignore_errors=True)


def new_store_name() -> str:
    return f"swallow-serve-{os.getpid()}-{uuid.uuid4().hex[:8]}"
