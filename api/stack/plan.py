"""What `swallow stack` starts: one command line per process, in start order.

The plan is data, so the same topology can be checked against
`docker-compose.yml` and the Kubernetes manifests, and printed
(`swallow stack --print-plan`).
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DEFAULT_PORTS", "RolePlan", "StackPlan", "free_ports", "plan_stack"]

# Each encoder and worker listens on its message port and, one above, on its HTTP health port.
DEFAULT_PORTS = {"api": 8000, "worker": 7100, "encoder": 7200}


@dataclass(frozen=True)
class RolePlan:
    name: str  # "encoder-0", "worker-1", "api"
    role: str  # "encoder" | "worker" | "api"
    argv: tuple[str, ...]  # `swallow` arguments
    health_url: str
    address: str = ""  # its message socket (tcp://HOST:PORT); "" for the API


@dataclass(frozen=True)
class StackPlan:
    roles: tuple[RolePlan, ...]
    store_name: str  # the shared-memory embedding store encoders write and workers read
    url: str  # where the API answers

    def of_role(self, role: str) -> list[RolePlan]:
        return [r for r in self.roles if r.role == role]

    def as_dict(self) -> dict[str, object]:
        return {"url": self.url, "embedding_store": self.store_name,
                "processes": [{"name": r.name, "role": r.role, "argv": ["swallow", *r.argv],
                               "health": r.health_url, "address": r.address} for r in self.roles]}


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports free now (held open together so none repeats)."""
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((host, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def plan_stack(
    model: str | Path,
    *,
    workers: int,
    encoders: int,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORTS["api"],
    internal_ports: Sequence[int],
    store_name: str,
    embedding_cache_mib: float = 256.0,
    route_args: Sequence[str] = (),
    http_args: Sequence[str] = (),
    engine_args: Sequence[str] = (),
    kv_disk_dir: str | None = None,
    log_level: str = "info",
    worker_roles: Sequence[str] = (),
    worker_args: Sequence[str] = (),
) -> StackPlan:
    """Encoders first, then workers, then the API that connects to them all.
    ``internal_ports``: two per encoder and worker (message, health), on
    localhost; ``*_args`` are passed through to the roles that take them;
    each worker gets its own directory under ``kv_disk_dir``. ``worker_roles``:
    each worker's ``--role`` (default: "both" for all); ``worker_args``: the
    workers' own options (e.g. the KV transport)."""
    if worker_roles and len(worker_roles) != workers:
        raise ValueError(f"{len(worker_roles)} worker roles for {workers} workers")
    if workers < 1:
        raise ValueError("a stack needs at least one worker")
    if encoders < 0:
        raise ValueError("--encoders must be >= 0")
    if len(internal_ports) < 2 * (workers + encoders):
        raise ValueError(f"need {2 * (workers + encoders)} internal ports, got {len(internal_ports)}")
    local = "127.0.0.1"
    ports = iter(internal_ports)
    model_arg = ("--model", str(model))
    roles: list[RolePlan] = []
    for role, count in (("encoder", encoders), ("worker", workers)):
        for i in range(count):
            zmq_port, health_port = next(ports), next(ports)
            name = f"{role}-{i}"
            argv = [role, *model_arg, "--host", local, "--port", str(zmq_port), "--health-port", str(health_port),
                    f"--{role}-id", name, "--embedding-cache-name", store_name, "--log-level", log_level]
            if role == "encoder":
                argv += ["--embedding-cache-mib", str(embedding_cache_mib)]
            else:
                argv += [*engine_args, *worker_args]
                if worker_roles:
                    argv += ["--role", worker_roles[i]]
                if kv_disk_dir:
                    argv += ["--kv-disk-dir", str(Path(kv_disk_dir) / name)]
            roles.append(RolePlan(name, role, tuple(argv), f"http://{local}:{health_port}/health",
                                  f"tcp://{local}:{zmq_port}"))
    api_argv = ["api", *model_arg, "--host", host, "--port", str(port),
                "--workers", ",".join(r.address for r in roles if r.role == "worker"),
                "--encoders", ",".join(r.address for r in roles if r.role == "encoder"),
                "--shared-spool", *route_args, *http_args, "--log-level", log_level]
    shown_host = local if host in ("0.0.0.0", "::", "") else host
    url = f"http://{shown_host}:{port}"
    roles.append(RolePlan("api", "api", tuple(api_argv), f"{url}/health"))
    return StackPlan(tuple(roles), store_name, url)
