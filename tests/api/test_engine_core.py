"""`swallow serve` runs its engine core in a process of its own (the worker
role over ZeroMQ IPC): streams carry every step's token ids as they come, one
id per stream, also without a tokenizer; a step's outputs leave the worker
as one frame; the engine core goes when the server goes."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from api.engine_core import (EngineCoreProcess, default_engine_threads, engine_core_plan, new_socket_dir,
                             new_store_name)
from api.stack import messages as m
from api.stack.outbox import Outbox
from api.stack.transport import parse_peers
from llm_core.loading.checkpoint import write_random_checkpoint
from llm_core.model.presets import tiny
from tests.api.live import HTTP, LiveServer, alive, live_server


def _chunks(url: str, body: dict) -> list[dict]:
    out = []
    with HTTP.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line.removeprefix("data: ")))
    return out


@pytest.fixture(scope="module")
def no_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model_dir = write_random_checkpoint(tmp_path_factory.mktemp("no-tokenizer") / "model", tiny(), seed=0)
    (model_dir / "tokenizer.json").unlink()
    return model_dir


@pytest.fixture(scope="module")
def server(no_tokenizer: Path) -> Iterator[LiveServer]:
    with live_server(no_tokenizer, "--speculative-tokens", "0") as running:
        yield running


def test_served_stream_sends_each_step_without_a_tokenizer(no_tokenizer: Path, server: LiveServer) -> None:
    assert not (no_tokenizer / "tokenizer.json").exists()
    health = HTTP.get(f"{server.url}/health", timeout=10).json()
    assert health["role"] == "serve" and health["engine_core"] == {"engine-core": True}
    body = {"prompt": list(range(3, 40)), "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "stream": True}
    chunks = _chunks(server.url, body)
    ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    assert len(ids) == 12
    assert len(chunks) == 12  # one chunk per step, not one at the end
    assert len({c["id"] for c in chunks}) == 1
    whole = HTTP.post(f"{server.url}/v1/completions", json=body | {"stream": False}, timeout=120).json()
    assert whole["choices"][0]["token_ids"] == ids
    # Fresh stats: the requests just answered are counted.
    stats = HTTP.get(f"{server.url}/stats", timeout=10).json()
    assert stats["prefix_cache"]["computed_prompt_tokens"] >= 37
    metrics = HTTP.get(f"{server.url}/metrics", timeout=10).text
    assert "swallow_recompiles_total 0.0" in metrics


def _engine_core_pid(server: LiveServer) -> int:
    """The server's engine core: its one `swallow worker` child process."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(fields[1]) == server.pid and fields[0] != "Z" and b"worker" in cmdline:
            children.append(int(stat.parent.name))
    assert len(children) == 1, children
    return children[0]


def test_engine_core_plan_is_one_worker_on_an_ipc_socket(tmp_path: Path) -> None:
    plan = engine_core_plan(tmp_path / "model", ["--no-compile"], store_name="s", threads=1, log_level="info",
                            socket_dir=tmp_path)
    (role,) = plan.roles
    assert role.role == "worker" and role.address == f"ipc://{tmp_path / 'engine.sock'}"
    assert parse_peers(role.address)[0].address == role.address
    argv = list(role.argv)
    assert argv[argv.index("--torch-threads") + 1] == "1" and "--no-kv-events" in argv
    assert default_engine_threads(2) == 1 and default_engine_threads(1) == 1 and default_engine_threads(8) == 7


def test_outbox_sends_one_frame_per_turn_and_merges_a_requests_tokens() -> None:
    sent: list[tuple[bytes, object]] = []

    async def send(identity: bytes, message: object) -> bool:
        sent.append((identity, message))
        return True

    async def run() -> None:
        outbox = Outbox(send)
        outbox.put(b"api", m.Admitted("a"))
        outbox.put(b"api", m.Tokens("a", [1], None))
        outbox.put(b"api", m.Tokens("a", [2], None, cached_tokens=None))
        outbox.put(b"api", m.Tokens("b", [3], "length"))
        outbox.put(b"other", m.Tokens("c", [4], None))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        outbox.put(b"api", m.Tokens("a", [5], "stop"))
        await asyncio.sleep(0)
        await asyncio.sleep(0)

    asyncio.run(run())
    assert [identity for identity, _ in sent] == [b"api", b"other", b"api"]
    first = sent[0][1]
    assert isinstance(first, m.StepOutputs)
    assert first.outputs == [m.Admitted("a"), m.Tokens("a", [1, 2], None), m.Tokens("b", [3], "length")]
    assert m.decode(m.encode(first)) == first
    assert sent[2][1].outputs == [m.Tokens("a", [5], "stop")]


@pytest.mark.parametrize("bad", ["ipc://", "ipc:/x"])
def test_bad_ipc_addresses_are_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_peers(bad)


def test_a_dead_engine_core_is_started_again(server: LiveServer) -> None:
    core_pid = int(server.log().split("the engine core (pid ", 1)[1].split(")", 1)[0])
    assert core_pid == _engine_core_pid(server)
    os.kill(core_pid, signal.SIGKILL)
    states = []
    deadline = time.monotonic() + 90
    with httpx.Client(timeout=10) as client:
        while time.monotonic() < deadline:
            states.append(client.get(f"{server.url}/health").status_code)
            if states[-1] == 200 and 503 in states:
                break
            time.sleep(0.2)
    assert 503 in states and states[-1] == 200  # unavailable while it was down, serving again after
    body = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    reply = HTTP.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200 and len(reply.json()["choices"][0]["token_ids"]) == 4
    assert _engine_core_pid(server) != core_pid


def test_the_engine_core_stops_with_the_server(server: LiveServer) -> None:
    """The module's last test: it stops the server the others used, which
    leaves no process, no socket directory and no shared-memory store."""
    core_pid = _engine_core_pid(server)
    assert core_pid != server.pid and alive(core_pid)
    argv = Path(f"/proc/{core_pid}/cmdline").read_bytes().decode().split("\0")
    socket_dir = Path(argv[argv.index("--ipc") + 1]).parent
    store = Path("/dev/shm") / argv[argv.index("--embedding-cache-name") + 1]
    assert socket_dir.is_dir() and store.exists()
    os.kill(server.pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while (alive(core_pid) or alive(server.pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(core_pid) and not alive(server.pid)
    assert not socket_dir.exists() and not store.exists()


def test_an_engine_core_process_writes_no_log_file_and_removes_its_socket_dir(tmp_path: Path) -> None:
    socket_dir = new_socket_dir()
    plan = engine_core_plan(tmp_path / "model", ["--no-compile"], store_name=new_store_name(), threads=1,
                            log_level="info", socket_dir=socket_dir)
    core = EngineCoreProcess(plan, 1 << 20, socket_dir)
    assert core.supervisor.log_dir is None
    core.stop()  # never launched: nothing to stop but its directory
    assert not socket_dir.exists()
