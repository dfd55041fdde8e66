"""The stack's parts without model processes: the message schema, peer
addresses, stats summed over workers, restarts' backoff, and the API's
worker links against a scripted worker socket (routing by KV events,
liveness within 2 s, refusals and failures mapped to HTTP's meaning)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from api.streams import EngineOverloaded, EngineUnavailable, RequestFailed
from api.launch import free_port
from api.stack import messages as m
from api.stack.frontend import RemoteEngineClient, WorkerLinks, aggregate_stats
from api.stack.service import PEER_TIMEOUT_S, ServiceSocket
from api.stack import links
from api.stack.links import DEAD_AFTER_S
from api.stack.supervisor import Supervisor, _Process
from api.stack.transport import bind_router, connect_dealer, parse_peers, recv_message, resolve_peers, send
from llm_core import SamplingParams
from llm_core.kv.kv_events import KVEventLog
from llm_core.kv.tiers.kv_tiers import FULL, SWA
from llm_core.sample.grammar import GrammarSpec
from llm_core.kv.page_address import CacheGeometry, token_page_addresses
from llm_core.cluster.router import Router


# ------------------------------------------------------------------ messages
def test_every_message_round_trips() -> None:
    log = KVEventLog()
    log.record("host", bytes(range(16)), SWA, 7)
    samples = [
        m.Ping(m.PROTOCOL_VERSION, "api-1", 1.5),
        m.Submit("r1", "inc", [1, 2, 3], [m.SpanSpec(1, 2, b"k" * 32)],
                 m.SamplingSpec.of(SamplingParams(max_tokens=3))),
        m.Submit("r2", "inc", [1], [], m.SamplingSpec.of(SamplingParams(
            max_tokens=3, presence_penalty=0.5, frequency_penalty=-1.0, repetition_penalty=1.2, logprobs=2,
            grammar=GrammarSpec("json_schema", '{"type": "object"}', after="</think>")))),
        m.Tokens("r2", [5], None, [-0.25], [[(5, -0.25), (9, -2.0)]], 12),
        m.Abort("r1"), m.Flush("t"), m.SnapshotRequest(), m.Admitted("r1"), m.Refused("r1", 400, "no"),
        m.Tokens("r1", [5, 6], "stop"), m.Failed("r1", 500, "boom"), m.KVEventsMsg.of("w", "inc", log.drain()),
        m.Flushed("t", {"a": 1}), m.EmbedMedia("e1", "video", "/spool/x.mp4", None),
        m.EmbedMedia("e2", "audio", None, b"wav", bytes(32)), m.Embedded("e1", b"k", 4, True),
        m.EmbedFailed("e1", 415, "not a video"),
    ]
    for message in samples:
        assert m.decode(m.encode(message)) == message
    batch = m.decode(m.encode(samples[11])).batch()
    assert batch.events[0].medium == "host" and batch.events[0].held == 7


def test_frames_from_another_version_or_garbage_are_refused() -> None:
    with pytest.raises(m.ProtocolError, match=f"version {m.PROTOCOL_VERSION + 1}"):
        m.decode(m.encode(m.Ping(m.PROTOCOL_VERSION + 1, "api", 0.0)))
    for frame in (b"", b"\x93\x01\x02\x03", msgspec.msgpack.encode({"__class__": "os.system"})):
        with pytest.raises(m.ProtocolError):
            m.decode(frame)
    with pytest.raises(ValueError):  # sampling values are checked again on the worker
        m.SamplingSpec(0, 0.0, 1.0, -1, None, (), False, 0.0, 0.0, 1.0, None, None).params()
    with pytest.raises(ValueError):
        m.SamplingSpec(1, 0.0, 1.0, -1, None, (), False, 0.0, 0.0, 1.0, None, ("yaml", "a: 1", "")).params()
    sent = SamplingParams(logprobs=3, presence_penalty=1.0, grammar=GrammarSpec("regex", "a+", after="</think>"))
    assert m.decode(m.encode(m.Submit("r", "i", [1], [], m.SamplingSpec.of(sent)))).sampling.params() == sent


# ----------------------------------------------------------------- addresses
def test_peer_lists() -> None:
    assert [p.address for p in parse_peers("tcp://a:1, tcp://b:2")] == ["tcp://a:1", "tcp://b:2"]
    assert resolve_peers(parse_peers("dns://localhost:7100")) == ["tcp://127.0.0.1:7100"]
    assert resolve_peers(parse_peers("dns://no-such-host.invalid:1")) == []
    for bad in ("a:1", "http://a:1", "tcp://a", "tcp://:1"):
        with pytest.raises(ValueError):
            parse_peers(bad)


def test_stats_summed_over_workers() -> None:
    one = {"prefix_cache": {"cached_prompt_tokens": 30, "computed_prompt_tokens": 70, "hit_rate": 0.3},
           "full_pool": {"capacity_tokens": 100, "free_tokens": 40, "bytes_per_token": 1024},
           "schedule": {"latency_buckets_s": [0.1, 1.0], "buckets": {"0-64": {"ttft": {"counts": [1, 2, 3]}}}},
           "swa_mode": "hybrid", "running_requests": 2}
    two = {"prefix_cache": {"cached_prompt_tokens": 10, "computed_prompt_tokens": 90, "hit_rate": 0.1},
           "full_pool": {"capacity_tokens": 100, "free_tokens": 100, "bytes_per_token": 1024},
           "schedule": {"latency_buckets_s": [0.1, 1.0], "buckets": {"0-64": {"ttft": {"counts": [0, 0, 1]}}}},
           "swa_mode": "hybrid", "running_requests": 1}
    total = aggregate_stats([one, two])
    assert total["prefix_cache"] == {"cached_prompt_tokens": 40, "computed_prompt_tokens": 160, "hit_rate": 0.2}
    assert total["full_pool"] == {"capacity_tokens": 200, "free_tokens": 140, "bytes_per_token": 1024}
    assert total["schedule"]["latency_buckets_s"] == [0.1, 1.0]
    assert total["schedule"]["buckets"]["0-64"]["ttft"]["counts"] == [1, 2, 4]
    assert total["swa_mode"] == "hybrid" and total["running_requests"] == 3


def test_a_service_cancels_only_what_a_quiet_api_held(tmp_path: Path) -> None:
    async def main() -> None:
        service = ServiceSocket("127.0.0.1", 0, free_port(), [], str(tmp_path / "service.sock"))
        try:
            held = {api: asyncio.create_task(asyncio.sleep(60)) for api in (b"quiet", b"talking")}
            service.held.update({f"r-{api.decode()}": (api, task) for api, task in held.items()})
            service.peers.seen(b"quiet")
            service.peers.seen(b"talking")
            service.peers.last_seen[b"quiet"] -= PEER_TIMEOUT_S + 1
            service.forget_silent_peers()
            await asyncio.sleep(0)
            assert held[b"quiet"].cancelled() and not held[b"talking"].done()
            assert list(service.peers) == [b"talking"]
            held[b"talking"].cancel()
        finally:
            service.sock.close()
            service.context.term()

    asyncio.run(main())


def test_a_service_judges_no_api_quiet_while_its_messages_wait_unread(tmp_path: Path) -> None:
    """After a step longer than the peer timeout, the pings that came during
    it are read before anyone is taken for gone."""
    async def main() -> None:
        ipc = str(tmp_path / "service.sock")
        service = ServiceSocket("127.0.0.1", 0, free_port(), [], ipc)
        api = connect_dealer(service.context, f"ipc://{ipc}", b"api-1")
        try:
            held = asyncio.create_task(asyncio.sleep(60))
            service.held["r1"] = (b"api-1", held)
            service.peers.seen(b"api-1")
            service.peers.last_seen[b"api-1"] -= PEER_TIMEOUT_S + 1
            while not await send(api, m.Ping(m.PROTOCOL_VERSION, "api-1", time.time())):
                await asyncio.sleep(0.01)
            while not service.sock.get(zmq.EVENTS) & zmq.POLLIN:
                await asyncio.sleep(0.01)
            service.forget_silent_peers()
            await asyncio.sleep(0)
            assert not held.done() and list(service.peers) == [b"api-1"]
            await recv_message(service.sock, with_identity=True)
            service.forget_silent_peers()  # read, and still nothing newer from it
            await asyncio.sleep(0)
            assert held.cancelled()
        finally:
            api.close()
            service.sock.close()
            service.context.term()

    asyncio.run(main())


def test_a_service_hands_each_message_to_its_handler_and_survives_a_bad_one(tmp_path: Path) -> None:
    async def main() -> list[tuple[bytes, object]]:
        ipc = str(tmp_path / "service.sock")
        service = ServiceSocket("127.0.0.1", 0, free_port(), [], ipc)
        client = connect_dealer(service.context, f"ipc://{ipc}", b"api-1")
        handled: list[tuple[bytes, object]] = []

        async def handle(identity: bytes, message: object) -> None:
            if isinstance(message, m.Abort) and message.request_id == "bad":
                raise RuntimeError("a handler's bug")
            handled.append((identity, message))

        chore = asyncio.create_task(service.dispatch(handle))
        try:
            for rid in ("r1", "bad", "r2"):
                while not await send(client, m.Abort(rid)):  # not connected yet
                    await asyncio.sleep(0.01)
            for _ in range(200):
                if len(handled) == 2:
                    break
                await asyncio.sleep(0.01)
        finally:
            chore.cancel()
            client.close()
            service.sock.close()
            service.context.term()
        return handled

    assert asyncio.run(main()) == [(b"api-1", m.Abort("r1")), (b"api-1", m.Abort("r2"))]


def test_a_role_that_keeps_dying_waits_longer_each_time() -> None:
    process = _Process(plan=None)  # type: ignore[arg-type]
    pauses = [Supervisor._backoff(process, 100.0 + i) for i in range(6)]
    assert pauses[0] == 0.0 and pauses == sorted(pauses) and pauses[-1] <= 10.0
    assert Supervisor._backoff(process, 1000.0) == 0.0  # a minute later it starts afresh


# ----------------------------------------------------- links to a fake worker
class FakeWorker:
    """A worker socket that answers as scripted: pongs while ``alive``,
    KV events on demand, and a request's answers from ``script``."""

    def __init__(self, worker_id: str, page_size: int = 4) -> None:
        self.worker_id = worker_id
        self.port = free_port()
        self.alive = True
        self.incarnation = "inc-1"
        self.geometry = CacheGeometry(b"F" * 16, page_size, 4)
        self.events = KVEventLog()
        self.script: list[object] = []
        self.received: list[object] = []
        self._peer: bytes | None = None

    async def run(self) -> None:
        context = zmq.asyncio.Context()
        sock = bind_router(context, "127.0.0.1", self.port)
        self.sock = sock
        try:
            while True:
                identity, message = await recv_message(sock, with_identity=True)
                self._peer = identity
                self.received.append(message)
                if isinstance(message, m.Ping) and self.alive:
                    await send(sock, m.WorkerPong(m.PROTOCOL_VERSION, self.worker_id, self.incarnation, 0.0, "demo",
                                                  self.geometry.fingerprint, self.geometry.page_size, 4, False, 0, 0,
                                                  0, 0, {"running_requests": 0}), identity)
                elif isinstance(message, m.Submit) and self.alive:
                    for answer in self.script:
                        await send(sock, answer, identity)
        finally:
            sock.close()
            context.term()

    async def cache(self, tokens: list[int]) -> None:
        """Tell the API this worker holds ``tokens``' pages with their windows."""
        for address in token_page_addresses(self.geometry, tokens):
            self.events.record("device", address, FULL, 1)
            self.events.record("device", address, SWA, self.geometry.page_size)
        assert self._peer is not None
        await send(self.sock, m.KVEventsMsg.of(self.worker_id, self.incarnation, self.events.drain()), self._peer)


async def _client(*workers: FakeWorker) -> AsyncIterator[tuple[RemoteEngineClient, WorkerLinks]]:
    router = Router("kv-affinity")
    links = WorkerLinks(",".join(f"tcp://127.0.0.1:{w.port}" for w in workers), router, "test-api")
    await links.start()
    deadline = time.monotonic() + 5
    while len(links.alive()) < len(workers):
        assert time.monotonic() < deadline, "the workers did not come up"
        await asyncio.sleep(0.05)
    try:
        yield RemoteEngineClient(links, max_pending=8), links
    finally:
        await links.aclose()


def _run(coro_fn) -> None:  # noqa: ANN001
    async def main() -> None:
        workers = [FakeWorker("w0"), FakeWorker("w1")]
        tasks = [asyncio.create_task(w.run()) for w in workers]
        try:
            await coro_fn(workers)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())


def test_requests_go_where_the_kv_events_say_the_prefix_is() -> None:
    prompt = list(range(1, 30))

    async def body(workers: list[FakeWorker]) -> None:
        async for client, _ in _client(*workers):
            await workers[1].cache(prompt)
            await asyncio.sleep(0.2)
            for worker in workers:
                worker.received.clear()
            stream = asyncio.create_task(client.open(prompt, SamplingParams(max_tokens=1)))
            await asyncio.sleep(0.3)
            submit = next(msg for msg in workers[1].received if isinstance(msg, m.Submit))
            assert not any(isinstance(msg, m.Submit) for msg in workers[0].received)
            await send(workers[1].sock, m.Admitted(submit.request_id), workers[1]._peer)
            await send(workers[1].sock, m.Tokens(submit.request_id, [7], "length"), workers[1]._peer)
            events = [event async for event in await stream]
            assert [(e.token, e.finish_reason) for e in events] == [(7, "length")]
            assert client.router.loads()["w1"]["routed_cached_tokens"] == 28
            break

    _run(body)


async def _admitted_stream(client: RemoteEngineClient, workers: list[FakeWorker]) -> tuple[FakeWorker, str, Any]:
    """A stream admitted by one of ``workers`` (which answer nothing more):
    that worker, the request's id and the stream."""
    for worker in workers:
        worker.script = []
    stream_task = asyncio.create_task(client.open([1, 2, 3], SamplingParams(max_tokens=5)))
    await asyncio.sleep(0.3)
    target = next(w for w in workers if any(isinstance(x, m.Submit) for x in w.received))
    submit = next(x for x in target.received if isinstance(x, m.Submit))
    await send(target.sock, m.Admitted(submit.request_id), target._peer)
    return target, submit.request_id, await stream_task


def test_a_dead_worker_fails_its_stream_within_two_seconds_and_leaves_routing() -> None:
    async def body(workers: list[FakeWorker]) -> None:
        async for client, _ in _client(*workers):
            target, _, stream = await _admitted_stream(client, workers)
            target.sock.close()  # its process died: the connection closes
            died = time.monotonic()
            with pytest.raises(EngineUnavailable, match="stopped answering"):
                async for _ in stream:
                    pass
            assert time.monotonic() - died < 2.0
            assert client.router.workers == [w.worker_id for w in workers if w is not target]
            break

    _run(body)


def test_a_worker_busy_past_the_dead_time_keeps_its_streams_and_its_place() -> None:
    """A long engine step holds the worker's event loop, not its connection:
    pings unanswered for longer than a death takes to see are no death."""
    async def body(workers: list[FakeWorker]) -> None:
        async for client, _ in _client(*workers):
            target, rid, stream = await _admitted_stream(client, workers)
            target.alive = False
            await asyncio.sleep(DEAD_AFTER_S + 1.0)
            assert target.worker_id in client.router.workers
            await send(target.sock, m.Tokens(rid, [7], "length"), target._peer)
            assert [(e.token, e.finish_reason) async for e in stream] == [(7, "length")]
            break

    _run(body)


def test_a_hung_worker_is_taken_down_and_told_on_its_return_to_abort_what_failed_meanwhile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Connected but silent past the hung time: down, its stream a 503. When it
    answers again (the same incarnation) it may still be running that request,
    which nobody reads: the API aborts it there."""
    monkeypatch.setattr(links, "HUNG_AFTER_S", 1.0)

    async def body(workers: list[FakeWorker]) -> None:
        async for client, worker_links in _client(*workers):
            target, rid, stream = await _admitted_stream(client, workers)
            target.alive = False
            with pytest.raises(EngineUnavailable, match="stopped answering"):
                async for _ in stream:
                    pass
            assert client.router.workers == [w.worker_id for w in workers if w is not target]
            assert not any(isinstance(x, m.Abort) for x in target.received)  # nothing reaches a down link
            target.alive = True
            await _until(lambda: any(isinstance(x, m.Abort) and x.request_id == rid for x in target.received), 5,
                         "the abort of the failed request")
            assert target.worker_id in client.router.workers
            assert all(not link.orphaned for link in worker_links.links.values())
            break

    _run(body)


def test_a_frozen_worker_process_leaves_routing_within_two_seconds_and_comes_back() -> None:
    """SIGSTOP freezes libzmq's threads too: heartbeats go unanswered."""
    script = ("import asyncio, sys; from tests.api.test_stack_parts import FakeWorker; "
              "w = FakeWorker('frozen'); print(w.port, flush=True); asyncio.run(w.run())")
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                               cwd=Path(__file__).parents[2])
    try:
        assert process.stdout is not None
        port = int(process.stdout.readline())

        async def main() -> None:
            links = WorkerLinks(f"tcp://127.0.0.1:{port}", Router("kv-affinity"), "test-api")
            await links.start()
            try:
                await _until(lambda: len(links.alive()) == 1, 30, "the worker to come up")
                os.kill(process.pid, signal.SIGSTOP)
                frozen = time.monotonic()
                await _until(lambda: not links.alive(), 5, "the frozen worker to leave")
                assert time.monotonic() - frozen < 2.0
                os.kill(process.pid, signal.SIGCONT)
                await _until(lambda: len(links.alive()) == 1, 10, "the worker to come back")
            finally:
                await links.aclose()

        asyncio.run(main())
    finally:
        process.kill()
        process.wait()


async def _until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("stop_at", ["last", "first"])
def test_a_reader_stopping_at_the_last_token_sends_no_abort(stop_at: str) -> None:
    """A reader that closes its stream on the final token (as the HTTP handlers
    do) leaves the worker alone; one that leaves before it aborts the request."""

    async def body(workers: list[FakeWorker]) -> None:
        async for client, _ in _client(*workers):
            opened = asyncio.create_task(client.open([1, 2, 3], SamplingParams(max_tokens=2)))
            await asyncio.sleep(0.3)
            target = next(w for w in workers if any(isinstance(x, m.Submit) for x in w.received))
            submit = next(x for x in target.received if isinstance(x, m.Submit))
            await send(target.sock, m.Admitted(submit.request_id), target._peer)
            await send(target.sock, m.Tokens(submit.request_id, [7, 8], "length"), target._peer)
            stream = await opened
            async for event in stream:
                if stop_at == "first" or event.finish_reason is not None:
                    break
            await stream.aclose()
            await asyncio.sleep(0.2)
            aborts = [x for x in target.received if isinstance(x, m.Abort)]
            assert len(aborts) == (1 if stop_at == "first" else 0)
            break

    _run(body)


class _StopsAtSeven:
    """A detokenizer whose text reaches a stop string at token 7."""

    stopped = False

    def push(self, token: int, final: bool = False) -> str:
        self.stopped = self.stopped or token == 7
        return str(token)


def test_a_stop_string_found_by_the_api_aborts_the_request_on_its_worker() -> None:
    async def body(workers: list[FakeWorker]) -> None:
        async for client, _ in _client(*workers):
            opened = asyncio.create_task(client.open([1, 2, 3], SamplingParams(max_tokens=50), text=_StopsAtSeven()))
            await asyncio.sleep(0.3)
            target = next(w for w in workers if any(isinstance(x, m.Submit) for x in w.received))
            submit = next(x for x in target.received if isinstance(x, m.Submit))
            await send(target.sock, m.Admitted(submit.request_id), target._peer)
            await send(target.sock, m.Tokens(submit.request_id, [5, 7], None), target._peer)
            events = [(e.token, e.finish_reason) async for e in await opened]
            assert events == [(5, None), (7, "stop")]
            await asyncio.sleep(0.2)
            assert [x for x in target.received if isinstance(x, m.Abort)] == [m.Abort(submit.request_id)]
            assert client.pending == 0
            break

    _run(body)


@pytest.mark.parametrize(("answer", "error"), [
    (m.Refused("", 400, "prompt too long"), ValueError),
    (m.Refused("", 429, "busy"), EngineOverloaded),
    (m.Refused("", 503, "restarted"), EngineUnavailable),
    (m.Failed("", 500, "boom"), RequestFailed),
])
def test_refusals_and_failures_keep_their_meaning(answer: m.Refused | m.Failed, error: type[Exception]) -> None:
    async def body(workers: list[FakeWorker]) -> None:
        async for client, _ in _client(*workers):
            opened = asyncio.create_task(client.open([1, 2, 3], SamplingParams(max_tokens=5)))
            await asyncio.sleep(0.3)
            target = next(w for w in workers if any(isinstance(x, m.Submit) for x in w.received))
            submit = next(x for x in target.received if isinstance(x, m.Submit))
            if isinstance(answer, m.Failed):
                await send(target.sock, m.Admitted(submit.request_id), target._peer)
            await send(target.sock, type(answer)(submit.request_id, answer.status, answer.message), target._peer)
            with pytest.raises(error, match=answer.message):
                stream = await opened
                async for _ in stream:
                    pass
            assert client.pending == 0
            break

    _run(body)


def test_dead_after_is_inside_the_two_second_promise() -> None:
    from api.stack.transport import HEARTBEAT_INTERVAL_S, HEARTBEAT_TIMEOUT_S

    # A death is at most one heartbeat old when the next is sent, and the connection closes at its timeout.
    assert DEAD_AFTER_S == HEARTBEAT_INTERVAL_S + HEARTBEAT_TIMEOUT_S < 2.0


def test_routing_decisions_and_worker_load_reach_the_metrics() -> None:
    from api.metrics import ServerMetrics

    metrics = ServerMetrics()
    routing = {"policy": "kv-affinity", "decisions": {"w0": {"affinity": 3, "miss": 1}},
               "workers": {"w0": {"queued_tokens": 120, "running": 2, "routed": 4, "routed_uncached_tokens": 9,
                                  "routed_cached_tokens": 300, "indexed_pages": 7}}}
    metrics.set_engine_stats({"routing": routing})
    text = metrics.render().decode()
    assert 'swallow_route_decisions{reason="affinity",worker="w0"} 3.0' in text
    assert 'swallow_worker_queued_tokens{worker="w0"} 120.0' in text
    assert 'swallow_worker_routed_cached_tokens{worker="w0"} 300.0' in text
    metrics.set_engine_stats({"routing": {**routing, "workers": {}}})  # w0 left
    assert 'swallow_worker_queued_tokens{worker="w0"}' not in metrics.render().decode()


def test_route_options_reach_the_api_process_of_the_stack(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from swallow.cli import main

    assert main(["stack", "--workers", "2", "--print-plan", "--route-policy", "least-load",
                 "--route-load-weight", "0.5", "--route-max-load-ratio", "1.5"]) == 0
    plan = json.loads(capsys.readouterr().out)
    api = next(p["argv"] for p in plan["processes"] if p["role"] == "api")
    options = dict(zip(api, api[1:]))  # each flag to the word after it
    assert options["--route-policy"] == "least-load"
    assert options["--route-load-weight"] == "0.5" and options["--route-max-load-ratio"] == "1.5"


def test_the_api_process_builds_its_router_from_its_options() -> None:
    from api.stack.frontend import StackFrontend

    demo = Path(__file__).resolve().parents[2] / "models" / "demo"
    frontend = StackFrontend(demo, workers="tcp://127.0.0.1:1", route_policy="kv-affinity",
                             route_load_weight=0.5, route_max_load_ratio=1.5)
    router = frontend.router
    assert (router.policy, router.load_weight, router.max_load_ratio) == ("kv-affinity", 0.5, 1.5)
