"""Starting `swallow serve` in a subprocess for live tests."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class LiveServer:
    url: str
    pid: int


@contextmanager
def live_server(model_dir: Path, *extra: str, env: dict[str, str] | None = None) -> Iterator[LiveServer]:
    """A real uvicorn server on localhost, stopped on exit."""
    port = free_port()
    argv: Sequence[str] = [sys.executable, "-m", "api.cli", "serve", "--model", str(model_dir),
                           "--port", str(port), "--log-level", "warning", *extra]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    try:
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"server did not start:\n{proc.stdout.read() if proc.stdout else ''}")
            time.sleep(0.2)
        yield LiveServer(url, proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
