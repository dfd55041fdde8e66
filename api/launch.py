"""Starting `swallow serve` as a subprocess on localhost: for live tests and the
load benchmark, which must measure the server a user runs, not an in-process app."""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

__all__ = ["RunningServer", "ServerStartError", "free_port", "launch_server"]

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
    argv = [sys.executable, "-m", "api.cli", "serve", "--model", str(model_dir), "--host", LOCALHOST,
            "--port", str(port), "--log-level", log_level, *extra_args]
    # A file, not a pipe: nobody reads the output while the server runs, and a full
    # pipe would block the server mid-request once it logs more than the pipe holds.
    with tempfile.NamedTemporaryFile("w+", prefix="swallow-serve-", suffix=".log", delete=False) as log:
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


def _wait_healthy(server: RunningServer, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{server.url}/health", timeout=1).status_code == 200:
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
