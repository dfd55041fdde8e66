"""`swallow stack`: the whole stack on this machine, supervised.

It creates the machine's shared-memory embedding store, starts the encoders,
the workers and then the API (``plan.py``), waits until the API answers, and
prints its URL. A role that dies is started again with the same command line
(after a short, growing pause if it keeps dying). SIGINT/SIGTERM stop every
role (SIGTERM, then SIGKILL after a grace period), and the shared-memory
store is removed: nothing is left running or mapped. Each role also gets
SIGTERM from the kernel if the supervisor itself dies (PR_SET_PDEATHSIG), so
even a killed supervisor leaves no orphans behind.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from api.stack.plan import RolePlan, StackPlan
from embedding_cache import SharedEmbeddingStore

__all__ = ["Supervisor", "run_stack"]

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 300.0
GRACE_S = 10.0
_PR_SET_PDEATHSIG = 1
_MAX_BACKOFF_S = 10.0


def _die_with_parent() -> None:  # runs in the child, between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: the supervisor's own shutdown still stops its children


@dataclass
class _Process:
    plan: RolePlan
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    last_start: float = 0.0
    restart_at: float | None = None
    log_path: Path | None = None
    restarts: list[float] = field(default_factory=list)


class Supervisor:
    def __init__(self, plan: StackPlan, store_bytes: int, log_dir: Path | None = None,
                 announce: bool = True, own_store: bool = True, inherit_output: bool = False) -> None:
        """``announce``: print where the stack serves once it is up (not for
        `serve`'s engine core, whose API says that itself). ``own_store``:
        remove the embedding store on stop (not one the user named, which
        other processes may share). ``inherit_output``: the roles write to this
        process's stdout and stderr, not to a log file each (`serve`'s engine
        core: one server, one output)."""
        self.plan = plan
        self.announce = announce
        self.own_store = own_store
        self.store_bytes = store_bytes
        self.log_dir = None if inherit_output else log_dir or Path(tempfile.mkdtemp(prefix="swallow-stack-"))
        self.processes = [_Process(role) for role in plan.roles]
        # Set by SIGINT/SIGTERM. A plain flag: a signal handler runs between two
        # bytecodes of the main thread, maybe inside a lock it holds (an Event's
        # wait), and setting an Event there deadlocked the stop for good.
        self._stopping = False
        self._store: SharedEmbeddingStore | None = None

    # ------------------------------------------------------------------ life
    def run(self) -> int:
        """Until SIGINT/SIGTERM; 0 on a clean stop."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_stop_signal)
        try:
            self.start()
            while not self._stopping:
                self.check()
                time.sleep(0.2)
            return 0
        finally:
            self.stop()

    def _on_stop_signal(self, signum: int, frame: object) -> None:
        self._stopping = True

    def start(self) -> None:
        self.launch()
        self.wait_started()

    def launch(self) -> None:
        """The store made and every role spawned (an API once the rest is healthy);
        ``wait_started`` waits for them: a caller can do its own work meanwhile."""
        # The store outlives any one role: workers read what encoders wrote before a restart.
        self._store = SharedEmbeddingStore.open(self.plan.store_name, self.store_bytes)
        for process in self.processes:
            if process.plan.role == "api":
                self._wait_healthy([p for p in self.processes if p.plan.role != "api"])
            self._spawn(process)

    def wait_started(self) -> None:
        self._wait_healthy(self.processes)
        if not self.announce:
            return
        lines = [f"Swallow stack is serving at {self.plan.url} ({self._summary()}, embedding store "
                 f"{self.plan.store_name}); logs in {self.log_dir}"]
        for process in self.processes:
            assert process.proc is not None
            lines.append(f"  {process.plan.name:<10} pid {process.proc.pid:<8} {process.plan.address or '-':<24} "
                         f"{process.plan.health_url}")
        print("\n".join(lines), flush=True)

    def stop(self) -> None:
        """Every role stopped (SIGTERM, then SIGKILL), the store removed."""
        running = [p.proc for p in self.processes if p.proc is not None and p.proc.poll() is None]
        for proc in reversed(running):  # the API first: it stops taking requests
            proc.terminate()
        deadline = time.monotonic() + GRACE_S
        for proc in running:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._store is not None:
            self._store.close()
            if self.own_store:
                self._store.unlink()
            self._store = None

    # ----------------------------------------------------------- supervision
    def check(self) -> None:
        """Start again any role that died."""
        now = time.monotonic()
        for process in self.processes:
            proc = process.proc
            if proc is None or proc.poll() is None:
                continue
            if process.restart_at is None:
                pause = self._backoff(process, now)
                log.warning("%s exited with %s; starting it again in %.1f s", process.plan.name, proc.returncode,
                            pause)
                print(f"{process.plan.name} exited ({proc.returncode}); restarting", file=sys.stderr, flush=True)
                process.restart_at = now + pause
            elif now >= process.restart_at:
                process.restart_at = None
                self._spawn(process)

    @staticmethod
    def _backoff(process: _Process, now: float) -> float:
        """0 for a role that ran a while; growing for one that keeps dying at once."""
        process.restarts = [t for t in process.restarts if now - t < 60.0] + [now]
        return 0.0 if len(process.restarts) <= 1 else min(_MAX_BACKOFF_S, 0.5 * 2 ** (len(process.restarts) - 2))

    def _spawn(self, process: _Process) -> None:
        argv = [sys.executable, "-m", "swallow", *process.plan.argv]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if self.log_dir is None:
            process.proc = subprocess.Popen(argv, preexec_fn=_die_with_parent, env=env)
        else:
            process.log_path = self.log_dir / f"{process.plan.name}.log"
            with process.log_path.open("ab") as out:
                process.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                                preexec_fn=_die_with_parent, env=env)
        process.starts += 1
        process.last_start = time.monotonic()

    def _wait_healthy(self, processes: Sequence[_Process]) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        waiting = list(processes)
        # One client for every poll: each new one loads the CA bundle (~60 ms of
        # CPU), which the roles starting beside the supervisor need.
        with httpx.Client(timeout=1.0) as client:
            while waiting:
                self._poll_health(client, waiting)
                if not waiting:
                    return
                if time.monotonic() > deadline:
                    names = ", ".join(p.plan.name for p in waiting)
                    raise RuntimeError(f"{names} did not become healthy in {STARTUP_TIMEOUT_S:.0f} s")
                time.sleep(0.2)

    def _poll_health(self, client: httpx.Client, waiting: list[_Process]) -> None:
        """Take every healthy role off ``waiting``; raise if one exited."""
        if self._stopping:
            raise KeyboardInterrupt
        for process in list(waiting):
            if _healthy(client, process.plan.health_url):
                waiting.remove(process)
            elif process.proc is not None and process.proc.poll() is not None:
                output = _tail(process.log_path) if process.log_path is not None else "(its output is above)"
                raise RuntimeError(f"{process.plan.name} exited while starting:\n{output}")

    def _summary(self) -> str:
        roles = [p.plan.role for p in self.processes]
        return f"{roles.count('worker')} workers, {roles.count('encoder')} encoders"

    def pids(self) -> dict[str, int]:
        return {p.plan.name: p.proc.pid for p in self.processes if p.proc is not None}


def _healthy(client: httpx.Client, url: str) -> bool:
    try:
        return client.get(url).status_code == 200
    except httpx.HTTPError:
        return False


def _tail(path: Path | None, lines: int = 40) -> str:
    if path is None or not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def run_stack(plan: StackPlan, store_bytes: int, print_plan: bool = False) -> int:
    if print_plan:
        print(json.dumps(plan.as_dict(), indent=2))
        return 0
    supervisor = Supervisor(plan, store_bytes)
    try:
        return supervisor.run()
    except KeyboardInterrupt:
        return 0
    except RuntimeError as exc:
        print(f"swallow stack: {exc}", file=sys.stderr)
        return 1
