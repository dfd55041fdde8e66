"""Starting `swallow serve` or `swallow stack` as a subprocess on localhost: for
live tests and benchmarks, which must measure the server a user runs, not an
in-process app."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

__all__ = ["RunningServer", "RunningStack", "ServerStartError", "StackRole", "free_port", "launch_command",
           "launch_server", "launch_stack"]

LOCALHOST = "127.0.0.1"


class ServerStartError(RuntimeError):
    """The server exited or never answered /health; the message holds its log."""


@dataclass(frozen=True)
class RunningServer:
    url: str
    pid: int
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOCALHOST, 0))
        return s.getsockname()[1]


@contextmanager
def launch_server(
    model_dir: str | Path,
    *extra_args: str,
    env: Mapping[str, str] | None = None,
    startup_timeout_s: float = 120.0,
    log_level: str = "warning",
) -> Iterator[RunningServer]:
    """`swallow serve --model MODEL_DIR EXTRA_ARGS...` on a free localhost port,
    yielded once /health answers, stopped on exit."""
    port = free_port()
    argv = [sys.executable, "-m", "swallow", "serve", "--model", str(model_dir), "--host", LOCALHOST,
            "--port", str(port), "--log-level", log_level, *extra_args]
    with launch_command(argv, port, env=env, startup_timeout_s=startup_timeout_s) as server:
        yield server


@contextmanager
def launch_command(
    argv: Sequence[str],
    port: int,
    *,
    env: Mapping[str, str] | None = None,
    startup_timeout_s: float = 120.0,
    log_prefix: str = "swallow-serve-",
) -> Iterator[RunningServer]:
    """Any HTTP server command listening on localhost ``port`` (another engine's
    too, for a side-by-side benchmark), yielded once its /health answers 200."""
    # A file, not a pipe: nobody reads the output while the server runs, and a full
    # pipe would block the server mid-request once it logs more than the pipe holds.
    with tempfile.NamedTemporaryFile("w+", prefix=log_prefix, suffix=".log", delete=False) as log:
        log_path = Path(log.name)
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, text=True,
                                env=dict(env) if env is not None else None)
    server = RunningServer(f"http://{LOCALHOST}:{port}", proc.pid, log_path)
    try:
        _wait_healthy(server, proc, startup_timeout_s)
        yield server
    finally:
        _stop(proc)
        log_path.unlink(missing_ok=True)


@dataclass(frozen=True)
class StackRole:
    name: str
    pid: int  # as started; a restarted role has another (its /health says which)
    address: str
    health_url: str

    def current_pid(self, client: httpx.Client | None = None) -> int | None:
        """The pid its /health reports; ``client``: one a caller polling often
        keeps (a new one costs ~60 ms of CPU)."""
        try:
            get = httpx.get if client is None else client.get
            return int(get(self.health_url, timeout=2).json()["pid"])
        except (httpx.HTTPError, KeyError, ValueError):
            return None


@dataclass(frozen=True)
class RunningStack(RunningServer):
    roles: dict[str, StackRole] = field(default_factory=dict)
    store_name: str = ""


_ROLE_LINE = re.compile(r"^\s+(\S+)\s+pid (\d+)\s+(\S+)\s+(\S+)$")


@contextmanager
def launch_stack(
    model_dir: str | Path,
    *extra_args: str,
    workers: int = 2,
    encoders: int = 1,
    startup_timeout_s: float = 300.0,
) -> Iterator[RunningStack]:
    """`swallow stack` on a free port, yielded once it says it serves (every role
    healthy), stopped with SIGINT (Ctrl-C) on exit."""
    port = free_port()
    argv = [sys.executable, "-m", "swallow", "stack", "--model", str(model_dir), "--workers", str(workers),
            "--encoders", str(encoders), "--host", LOCALHOST, "--port", str(port), "--log-level", "warning",
            *extra_args]
    with tempfile.NamedTemporaryFile("w+", prefix="swallow-stack-", suffix=".log", delete=False) as log:
        log_path = Path(log.name)
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        stack = _wait_stack(proc, log_path, port, startup_timeout_s)
        yield stack
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log_path.unlink(missing_ok=True)


def _wait_stack(proc: subprocess.Popen, log_path: Path, port: int, timeout_s: float) -> RunningStack:
    deadline = time.monotonic() + timeout_s
    while True:
        text = log_path.read_text(errors="replace")
        if "Swallow stack is serving at" in text:
            roles = {}
            for line in text.splitlines():
                if match := _ROLE_LINE.match(line):
                    name, pid, address, health = match.groups()
                    roles[name] = StackRole(name, int(pid), address if address != "-" else "", health)
            store = re.search(r"embedding store (\S+)\)", text)
            return RunningStack(f"http://{LOCALHOST}:{port}", proc.pid, log_path, roles,
                                store.group(1) if store else "")
        if proc.poll() is not None or time.monotonic() > deadline:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            raise ServerStartError(f"the stack did not start:\n{text}")
        time.sleep(0.3)


def _wait_healthy(server: RunningServer, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=1) as client:  # one for every poll: a new one costs ~60 ms of CPU
        while True:
            try:
                if client.get(f"{server.url}/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                raise ServerStartError(f"server did not start:\n{server.log()}")
            time.sleep(0.2)


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
