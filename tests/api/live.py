"""Starting `swallow serve` in a subprocess for live tests (see api/launch.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from api.launch import RunningServer, ServerStartError, free_port, launch_server

__all__ = ["DEMO", "HTTP", "LiveServer", "alive", "free_port", "live_server"]

LiveServer = RunningServer
DEMO = Path(__file__).resolve().parents[2] / "models" / "demo"
# One client for the live tests' plain requests (thread-safe, keeps connections):
# each new httpx client builds an SSL context, ~60 ms of CPU, and the suite sends
# hundreds of requests.
HTTP = httpx.Client()


@contextmanager
def live_server(model_dir: Path, *extra: str, env: dict[str, str] | None = None) -> Iterator[LiveServer]:
    """A real uvicorn server on localhost, stopped on exit; a failed start fails the test."""
    try:
        with launch_server(model_dir, *extra, env=env) as server:
            yield server
    except ServerStartError as exc:  # only raised before the yield: the test body never saw a server
        pytest.fail(str(exc))


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie is dead: only its parent
    has not reaped it yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
