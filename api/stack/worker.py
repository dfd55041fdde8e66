"""`swallow worker`: one engine behind a ZeroMQ socket.

An API registers by pinging (every ping is answered with the worker's load,
its stats and what a router needs of its cache: fingerprint, page size,
window); from then on the worker sends it its KV events -- first a snapshot,
then every batch the engine's cache recorded, about every 20 ms. Requests
arrive with ids the API chose and their multimodal spans as embedding-store
keys; the worker reads the rows from the machine's shared memory (or the
key's owner machine), admits the request, and streams its tokens back. An
API that stops pinging is gone: its requests are aborted, their KV freed.

The engine core runs on its own thread (``AsyncEngine``) and never waits on
an API: it takes every request that came in since its last step, steps, and
hands the step's tokens over at once. What a step did for an API's requests
(admissions, tokens, failures) leaves as one ``StepOutputs`` frame
(``Outbox``), not a frame per token.

Disaggregation (``--role``): a request the API sends with ``prefill_by`` is
decoded here and prefilled there. This worker reserves the request's KV
slots and a transfer buffer first, then asks the prefill worker (a
``PrefillRequest`` over a socket of its own to it); that worker runs the
prompt (its prefix cache applies), sends the KV into the buffer and answers
``Prefilled`` with the first token; the request goes on here from that token.
If the KV does not come -- the prefill worker refused, failed, went silent
(``Probe`` unanswered) or took longer than the transfer timeout -- the
reservation is freed and the request is prefilled here instead: slower,
never wrong. A role only steers the API's routing: any worker can serve a
whole request.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from api.engine_loop import (
    AsyncEngine,
    EngineOverloaded,
    EngineUnavailable,
    RequestFailed,
    Sink,
    StreamEvent,
    Submission,
)
from api.metrics import ServerMetrics
from api.stack import messages as m
from api.stack.embeddings import embedding_cache, keep_ring_fresh
from api.stack.service import Peers, ServiceSocket, every, run_service
from api.stack.transport import connect_dealer, recv_message, send
from embedding_cache import EmbeddingCache, SharedEmbeddingStore
from llm_core import LLM, MultimodalSpan, SamplingParams
from llm_core.disagg import KVReservation, PrefilledKV
from llm_core.kv_events import KVEventLog
from llm_core.kv_transport import KVTransport, ReceiveSlot, TransferError, TransferTicket, make_transport
from llm_core.llm import encode_prompt

__all__ = ["WorkerConfig", "WorkerService", "run_worker"]

log = logging.getLogger(__name__)

EVENT_INTERVAL_S = 0.02
ROLES = ("both", "prefill", "decode")
# A decode worker waiting for KV probes its prefill worker this often, and
# gives up on it (prefilling here instead) after this long without an answer.
PROBE_INTERVAL_S = 0.5
PROBE_SILENCE_S = 2.5
CONNECT_WAIT_S = 2.0  # for a socket to a prefill worker to connect


@dataclass(frozen=True)
class WorkerConfig:
    model_dir: Path
    host: str
    port: int
    health_port: int
    worker_id: str
    engine_options: Mapping[str, Any] = field(default_factory=dict)
    max_pending: int = 256
    store_name: str | None = None
    embedding_peers: str = ""
    embedding_node: str | None = None
    log_level: str = "info"
    role: str = "both"  # what the API routes here: prompts ("prefill"), decodes ("decode"), or both
    kv_transport: str = "shm"  # how KV comes to this worker as a decode worker: "shm" or "torch"
    transfer_timeout_s: float = 30.0  # a prefill (queue, compute, transfer) not done by then is done here
    ipc_path: str | None = None  # the message socket on this Unix socket instead of host:port
    kv_events: bool = True  # publish what the cache holds (for a router); `serve`'s one engine has none

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.transfer_timeout_s <= 0:
            raise ValueError("transfer_timeout_s must be > 0")


class MissingEmbedding(LookupError):
    pass


class WorkerService:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.incarnation = uuid.uuid4().hex
        self.events = KVEventLog()
        self.llm = LLM(config.model_dir, kv_events=self.events if config.kv_events else None,
                       **config.engine_options)
        # The engine steps on the worker's event loop (``serve``): the loop only
        # moves messages, which it does between steps.
        self.engine = AsyncEngine(self.llm, max_pending=config.max_pending, inline=True)
        # The encoders create the store (with its size); a worker only attaches, once there is one.
        self.store: SharedEmbeddingStore | None = None
        self.embeddings: EmbeddingCache = embedding_cache(None, config.embedding_peers, config.embedding_node)
        self._attach_store()
        self.peers = Peers()
        self.embedding_reads = {"read": 0, "missing": 0, "bytes": 0}  # spans' rows taken from the store
        self.metrics = ServerMetrics()
        self.outbox = Outbox(self._send)
        self._service: ServiceSocket | None = None
        # Disaggregation: transports by name (made on first use), this worker's
        # sockets to prefill workers with their readers, transfers waiting for
        # an answer (decode side) and prefills running for a decode worker.
        self._transports: dict[str, KVTransport] = {}
        self._prefill_socks: dict[str, Any] = {}
        self._readers: list[asyncio.Task[None]] = []
        self._transfers: dict[str, asyncio.Queue[object]] = {}
        self._prefills: dict[str, asyncio.Task[None]] = {}
        self.disagg = {"prefilled_for_others": 0, "bytes_sent": 0, "send_seconds": 0.0, "received": 0,
                       "bytes_received": 0, "receive_seconds": 0.0, "full_attention_bytes_received": 0,
                       "fallbacks": 0, "no_room": 0, "aborted_in_transfer": 0}

    @property
    def requests(self) -> dict[str, tuple[bytes, asyncio.Task[None]]]:
        assert self._service is not None
        return self._service.held

    # ----------------------------------------------------------------- life
    async def serve(self, stop: asyncio.Event) -> None:
        config = self.config
        self._service = ServiceSocket(config.host, config.port, config.health_port, self._http_routes(),
                                      config.ipc_path)
        chores = [self.engine.run_inline(), self._receive(),
                  every(EVENT_INTERVAL_S, self._publish_events, "sending KV events"),
                  every(1.0, self._forget_silent_peers, "checking peers"),
                  keep_ring_fresh(self.embeddings, config.embedding_peers)]
        where = f"ipc://{config.ipc_path}" if config.ipc_path else f"tcp://{config.host}:{config.port}"
        log.info("worker %s serving %s on %s (health on %d)", config.worker_id, config.model_dir, where,
                 config.health_port)
        try:
            await self._service.run_until(stop, chores)
        finally:
            for task in self._readers:
                task.cancel()
            for sock in self._prefill_socks.values():
                sock.close()
            for transport in self._transports.values():
                transport.close()
            self.engine.close()
            self.llm.close()
            await self.embeddings.aclose()
            if self.store is not None:
                self.store.close()

    # ------------------------------------------------------------ messages
    async def _receive(self) -> None:
        assert self._service is not None
        while True:
            identity, message = await recv_message(self._service.sock, with_identity=True)
            assert identity is not None
            try:
                await self._handle(identity, message)
            except Exception:  # noqa: BLE001 - one bad message must not stop the worker
                log.exception("handling %s failed", type(message).__name__)

    async def _handle(self, identity: bytes, message: object) -> None:
        if isinstance(message, m.PrefillRequest | m.AbortPrefill | m.Probe):
            await self._handle_prefill(identity, message)  # a decode worker, not an API: no KV events to it
            return
        if isinstance(message, m.Ping):
            if self.peers.seen(identity):
                log.info("API %s registered", message.sender)
                await self._send(identity, self._snapshot())
            await self._send(identity, self._pong(message))
            return
        self.peers.seen(identity)
        if isinstance(message, m.Submit):
            self._start_request(identity, message)
        elif isinstance(message, m.Abort):
            held = self.requests.get(message.request_id)
            if held is not None and held[0] == identity:
                held[1].cancel()
        elif isinstance(message, m.Flush):
            asyncio.create_task(self._flush(identity, message))
        elif isinstance(message, m.SnapshotRequest):
            await self._send(identity, self._snapshot())
        else:
            log.warning("unexpected %s from an API", type(message).__name__)

    async def _send(self, identity: bytes, message: object) -> bool:
        assert self._service is not None
        return await send(self._service.sock, message, identity)

    def stats(self, engine_stats: dict[str, Any] | None = None) -> dict[str, Any]:
        """The engine's stats (its last snapshot unless given) and the worker's own."""
        engine_stats = engine_stats if engine_stats is not None else self.engine.stats()
        return engine_stats | {"embeddings": dict(self.embedding_reads), "role": self.config.role,
                                      "disaggregation": dict(self.disagg),
                                      "transfer_buffers": {name: t.buffers() for name, t in self._transports.items()}}

    def _pong(self, ping: m.Ping) -> m.WorkerPong:
        stats = self.stats()
        cache = self.llm.engine.cache
        geometry = cache.geometry() if cache is not None and self.llm.engine.fingerprint is not None else None
        return m.WorkerPong(
            m.PROTOCOL_VERSION, self.config.worker_id, self.incarnation, ping.sent_at, self.llm.model_dir.name,
            geometry.fingerprint if geometry else None, geometry.page_size if geometry else 0,
            geometry.window_tokens if geometry else 0, geometry.keep_all_swa if geometry else False,
            int(stats.get("queued_prompt_tokens", 0)), int(stats.get("running_requests", 0)),
            int(stats.get("waiting_requests", 0)), self.engine.pending, stats, self.config.role)

    def _snapshot(self) -> m.KVEventsMsg:
        return m.KVEventsMsg.of(self.config.worker_id, self.incarnation, self.events.snapshot())

    async def _publish_events(self) -> None:
        batch = self.events.drain()
        if not batch.events:
            return
        message = m.KVEventsMsg.of(self.config.worker_id, self.incarnation, batch)
        for identity in self.peers:
            # A peer that misses a batch sees the gap in the next one and asks for a snapshot.
            await self._send(identity, message)

    async def _forget_silent_peers(self) -> None:
        assert self._service is not None
        for identity in self.peers.expired():
            log.warning("an API went quiet; aborted its %d requests", self._service.cancel_of(identity))

    async def _flush(self, identity: bytes, message: m.Flush) -> None:
        engine_stats = await (self.engine.flush_cache() if message.drop else self.engine.current_stats())
        await self._send(identity, m.Flushed(message.token, self.stats(engine_stats)))

    # ------------------------------------------------------------ requests
    def _start_request(self, identity: bytes, submit: m.Submit) -> None:
        """A plain request (no spans to read, no KV to receive) is queued for the
        engine here, in the turn its message arrived: it makes the next step,
        where a task of its own would start a loop turn later and often miss it."""
        rid = submit.request_id

        def sink(event: StreamEvent | None) -> None:  # on this loop, in the step's one callback
            self.outbox.put(identity, m.Admitted(rid) if event is None else _tokens_message(rid, event))

        submission: Submission | None = None
        if not submit.spans and not submit.prefill_by:
            try:
                self._check_incarnation(submit)
                params, prompt = self._checked(submit.sampling, submit.prompt_ids)
                submission = self.engine.submit(prompt, params, sink=sink)
            except (ValueError, EngineOverloaded, EngineUnavailable) as exc:
                self.outbox.put(identity, m.Refused(rid, _refusal_status(exc), str(exc)))
                return
        task = asyncio.create_task(self._serve_request(identity, submit, sink, submission))
        if submission is not None:
            task.add_done_callback(lambda _: submission.release())  # even if cancelled before it ran
        self.requests[rid] = (identity, task)

    async def _serve_request(self, identity: bytes, submit: m.Submit, sink: Sink,
                             submission: Submission | None) -> None:
        rid = submit.request_id
        try:
            try:
                stream = await (submission.admitted() if submission is not None else self._admit(submit, sink))
            except (ValueError, MissingEmbedding, EngineOverloaded, EngineUnavailable, RequestFailed) as exc:
                self.outbox.put(identity, m.Refused(rid, _refusal_status(exc), str(exc)))
                return
            try:
                async for _ in stream:  # tokens went to the sink: this waits for the end or a failure
                    pass
            except (RequestFailed, EngineUnavailable) as exc:
                self.outbox.put(identity, m.Failed(rid, 500 if isinstance(exc, RequestFailed) else 503, str(exc)))
            finally:
                await stream.aclose()  # an abort (cancelled task) frees the request's KV here
        finally:
            held = self.requests.get(rid)
            if held is not None and held[1] is asyncio.current_task():
                del self.requests[rid]

    def _check_incarnation(self, submit: m.Submit) -> None:
        if submit.incarnation != self.incarnation:
            raise EngineUnavailable(f"worker {self.config.worker_id} restarted since this request was routed to it")

    async def _admit(self, submit: m.Submit, sink: Sink) -> Any:
        self._check_incarnation(submit)
        params, prompt, spans = await self._request(submit.sampling, submit.prompt_ids, submit.spans)
        if submit.prefill_by:
            return await self._admit_prefilled(submit, params, prompt, spans, sink)
        return await self.engine.open(prompt, params, spans, sink=sink)

    async def _request(self, sampling: m.SamplingSpec, prompt_ids: list[int],
                       refs: Sequence[m.SpanSpec]) -> tuple[SamplingParams, list[int], list[MultimodalSpan]]:
        """A request's parameters, prompt and spans, checked (ValueError, MissingEmbedding)."""
        params, prompt = self._checked(sampling, prompt_ids)
        return params, prompt, await self._spans(refs)

    def _checked(self, sampling: m.SamplingSpec, prompt_ids: list[int]) -> tuple[SamplingParams, list[int]]:
        """A request's parameters and prompt, checked (ValueError)."""
        params = sampling.params()
        prompt = encode_prompt(prompt_ids, None, self.llm.config.vocab_size, self.llm.model_dir)
        self.llm.check_length(len(prompt), params.max_tokens)
        return params, prompt

    # ------------------------------------------- disaggregation: decode side
    async def _admit_prefilled(self, submit: m.Submit, params: SamplingParams, prompt: list[int],
                               spans: list[MultimodalSpan], sink: Sink) -> Any:
        """The request's stream from its first token, over KV a prefill worker
        sends into slots reserved first; prefilled here if that fails."""
        reservation = await self.engine.call(lambda llm: llm.reserve_kv(len(prompt), params.max_tokens))
        if reservation is None:
            self.disagg["no_room"] += 1  # no room to hold its KV now: it queues here like any request
            return await self.engine.open(prompt, params, spans, sink=sink)
        held = True
        try:
            received = await self._receive_kv(submit, reservation)
            if received is not None:
                prefilled, blob, slot = received
                try:
                    stream = await self.engine.open_prefilled(reservation, prompt, params, prefilled, blob, spans,
                                                               sink=sink)
                    held = False
                    self.disagg["received"] += 1
                    return stream
                except ValueError as exc:
                    log.warning("the KV from %s did not fit its reservation (%s); prefilling here",
                                submit.prefill_by, exc)
                finally:
                    slot.close()
        finally:
            if held:
                self.engine.post(lambda llm: llm.cancel_reservation(reservation))
        self.disagg["fallbacks"] += 1
        return await self.engine.open(prompt, params, spans, sink=sink)

    def _transport(self, name: str) -> KVTransport:
        transport = self._transports.get(name)
        if transport is None:
            transport = self._transports[name] = make_transport(name, self.config.host, self.llm.device,
                                                                self.config.transfer_timeout_s)
        return transport

    def _prefill_sock(self, address: str) -> Any:
        sock = self._prefill_socks.get(address)
        if sock is None:
            assert self._service is not None
            identity = f"{self.config.worker_id}/decode/{self.incarnation}".encode()
            sock = self._prefill_socks[address] = connect_dealer(self._service.context, address, identity)
            self._readers.append(asyncio.create_task(self._read_prefill_answers(sock)))
        return sock

    async def _read_prefill_answers(self, sock: Any) -> None:
        while True:
            _, message = await recv_message(sock, with_identity=False)
            queue = self._transfers.get(getattr(message, "transfer_id", ""))
            if queue is not None:
                queue.put_nowait(message)

    async def _receive_kv(self, submit: m.Submit,
                          reservation: KVReservation) -> tuple[PrefilledKV, Any, ReceiveSlot] | None:
        """Ask the prefill worker for the request and wait for its KV; None
        (the reason logged) if it does not come."""
        slot = self._transport(self.config.kv_transport).open_receive(reservation.plan.bytes, submit.prefill_by)
        ticket = slot.ticket
        queue: asyncio.Queue[object] = asyncio.Queue()
        self._transfers[ticket.transfer_id] = queue
        sock = self._prefill_sock(submit.prefill_by)
        started = time.monotonic()
        deadline = started + self.config.transfer_timeout_s
        delivered = False
        try:
            request = m.PrefillRequest(ticket.transfer_id, submit.prefill_incarnation, submit.prompt_ids,
                                       submit.spans, submit.sampling, m.Ticket(*_ticket_fields(ticket)),
                                       self.llm.engine.config.page_size, self.llm.engine.config.swa_mode,
                                       self.llm.engine.kv_layout)
            if not await _send_when_connected(sock, request, min(CONNECT_WAIT_S, deadline - time.monotonic())):
                log.warning("prefill worker %s is not connected; prefilling here", submit.prefill_by)
                return None
            answer = await self._await_prefill(sock, ticket.transfer_id, queue, deadline)
            if not isinstance(answer, m.Prefilled):
                log.warning("no KV from %s (%s); prefilling here", submit.prefill_by, answer)
                return None
            blob = await asyncio.to_thread(slot.result, max(0.1, deadline - time.monotonic()))
            self.disagg["bytes_received"] += blob.numel()
            self.disagg["full_attention_bytes_received"] += reservation.plan.full_attention_bytes
            self.disagg["receive_seconds"] += time.monotonic() - started
            delivered = True
            prefilled = PrefilledKV(reservation.num_tokens, answer.first_token, answer.seed, answer.cached_tokens,
                                    answer.finish_reason, blob, reservation.plan, answer.logprob,
                                    tuple(tuple(p) for p in answer.top_logprobs))  # type: ignore[misc]
            return prefilled, blob, slot
        except TransferError as exc:
            log.warning("the KV transfer from %s failed (%s); prefilling here", submit.prefill_by, exc)
            return None
        except asyncio.CancelledError:
            self.disagg["aborted_in_transfer"] += 1
            raise
        finally:
            del self._transfers[ticket.transfer_id]
            if not delivered:
                slot.close()
                await send(sock, m.AbortPrefill(ticket.transfer_id))  # it may still be running there

    async def _await_prefill(self, sock: Any, transfer_id: str, queue: asyncio.Queue[object],
                             deadline: float) -> object:
        """``Prefilled`` or ``PrefillFailed``; a string saying why neither came."""
        last_heard = time.monotonic()
        while True:
            now = time.monotonic()
            if now >= deadline:
                return f"no answer within {self.config.transfer_timeout_s:.1f} s"
            if now - last_heard > PROBE_SILENCE_S:
                return f"the prefill worker went silent for {now - last_heard:.1f} s"
            try:
                answer = await asyncio.wait_for(queue.get(), min(PROBE_INTERVAL_S, deadline - now))
            except TimeoutError:
                await send(sock, m.Probe(transfer_id))
                continue
            if isinstance(answer, m.ProbeAck):
                if not answer.known:
                    return "the prefill worker does not know the transfer (it restarted)"
                last_heard = time.monotonic()
                continue
            return answer

    # ------------------------------------------ disaggregation: prefill side
    async def _handle_prefill(self, identity: bytes, message: object) -> None:
        if isinstance(message, m.PrefillRequest):
            task = asyncio.create_task(self._prefill_for(identity, message))
            self._prefills[message.transfer_id] = task
        elif isinstance(message, m.AbortPrefill):
            task = self._prefills.get(message.transfer_id)
            if task is not None:
                task.cancel()
        elif isinstance(message, m.Probe):
            await self._send(identity, m.ProbeAck(message.transfer_id, message.transfer_id in self._prefills))

    async def _prefill_for(self, identity: bytes, request: m.PrefillRequest) -> None:
        """Prefill a decode worker's request, send its KV, answer with the first token."""
        tid = request.transfer_id
        try:
            answer = await self._prefill_and_send(request)
        except (ValueError, MissingEmbedding, EngineOverloaded, EngineUnavailable, RequestFailed) as exc:
            answer = m.PrefillFailed(tid, _refusal_status(exc), str(exc))
        except TransferError as exc:
            answer = m.PrefillFailed(tid, 503, str(exc))
        finally:
            self._prefills.pop(tid, None)
        await self._send(identity, answer)

    async def _prefill_and_send(self, request: m.PrefillRequest) -> m.Prefilled:
        if request.incarnation and request.incarnation != self.incarnation:
            raise EngineUnavailable(f"worker {self.config.worker_id} restarted since this request was routed to it")
        config = self.llm.engine.config
        if (request.page_size, request.swa_mode) != (config.page_size, config.swa_mode):
            raise ValueError(f"KV layouts differ: the decode worker pages by {request.page_size} "
                             f"({request.swa_mode}), this one by {config.page_size} ({config.swa_mode})")
        if request.kv_layout != self.llm.engine.kv_layout:
            raise ValueError(f"KV layouts differ: the decode worker stores {request.kv_layout}, this one "
                             f"{self.llm.engine.kv_layout}")
        params, prompt, spans = await self._request(request.sampling, request.prompt_ids, request.spans)
        stream = await self.engine.open_export(prompt, params, spans)
        last: StreamEvent | None = None
        try:
            async for event in stream:
                last = event
        finally:
            await stream.aclose()
        if last is None or last.exported is None:
            raise RequestFailed("the prefill ended without its KV")
        exported = last.exported
        ticket = TransferTicket(*_ticket_values(request.ticket))
        started = time.monotonic()
        await asyncio.to_thread(self._transport(ticket.transport).send, ticket, exported.blob,
                                self.config.transfer_timeout_s)
        self.disagg["send_seconds"] += time.monotonic() - started
        self.disagg["prefilled_for_others"] += 1
        self.disagg["bytes_sent"] += exported.blob.numel()
        return m.Prefilled(request.transfer_id, exported.first_token, exported.seed, exported.cached_tokens,
                           exported.finish_reason, exported.logprob, [tuple(p) for p in exported.top_logprobs],
                           exported.blob.numel())

    def _attach_store(self) -> None:
        if self.store is not None or not self.config.store_name:
            return
        try:
            self.store = SharedEmbeddingStore.attach(self.config.store_name)
        except FileNotFoundError:
            return  # no encoder has created it yet
        self.embeddings.local = self.store

    async def _spans(self, refs: Sequence[m.SpanSpec]) -> list[MultimodalSpan]:
        if refs:
            self._attach_store()
        spans = []
        for ref in refs:
            rows = await self.embeddings.get(ref.key)
            self.embedding_reads["read" if rows is not None else "missing"] += 1
            if rows is None:
                raise MissingEmbedding(f"the embedding {ref.key.hex()[:16]}... is not in the embedding store "
                                       "(evicted, or its encoder's machine is unreachable); retry the request")
            if rows.ndim != 2 or rows.shape[0] != ref.length:
                raise ValueError(f"the span at {ref.offset} has {ref.length} positions, its embedding "
                                 f"{tuple(rows.shape)} rows")
            self.embedding_reads["bytes"] += rows.numel() * rows.element_size()
            spans.append(MultimodalSpan(ref.offset, rows, ref.key))
        return spans

    # ---------------------------------------------------------------- HTTP
    def _http_routes(self) -> list[Route]:
        async def health(_: Request) -> Response:
            broken = self.engine.broken
            body = {"status": "unavailable" if broken else "ok", "role": "worker", "worker_id": self.config.worker_id,
                    "incarnation": self.incarnation, "pid": os.getpid()}
            if broken:
                body["reason"] = broken
            return JSONResponse(body, status_code=503 if broken else 200)

        async def stats(_: Request) -> Response:
            return JSONResponse(self.stats() | {"pending_requests": self.engine.pending})

        async def metrics(_: Request) -> Response:
            self.metrics.set_engine_stats(self.engine.stats())
            return Response(self.metrics.render(), media_type=self.metrics.content_type)

        return [Route("/health", health), Route("/stats", stats), Route("/metrics", metrics)]


class Outbox:
    """Outputs for APIs, sent as one ``StepOutputs`` frame per API and loop
    turn. The engine hands a step's tokens over in one callback, so every
    stream it advanced queues here in the same turn, and the flush (a task,
    so the turn after) sends them together; a request's consecutive tokens
    become one ``Tokens``."""

    def __init__(self, send: Callable[[bytes, object], Awaitable[bool]]) -> None:
        self._send = send
        self._queued: dict[bytes, list[m.RequestOutput]] = {}
        self._flush_task: asyncio.Task[None] | None = None

    def put(self, identity: bytes, output: m.RequestOutput) -> None:
        queued = self._queued.setdefault(identity, [])
        if queued and _mergeable(queued[-1], output):
            output = _merged(queued.pop(), output)  # type: ignore[arg-type]
        queued.append(output)
        if self._flush_task is None:
            self._flush_task = asyncio.ensure_future(self._flush())

    async def _flush(self) -> None:
        self._flush_task = None  # what is queued from here goes in the next frame
        queued, self._queued = self._queued, {}
        for identity, outputs in queued.items():
            await self._send(identity, m.StepOutputs(outputs))


def _mergeable(last: m.RequestOutput, new: m.RequestOutput) -> bool:
    return (isinstance(last, m.Tokens) and isinstance(new, m.Tokens) and last.request_id == new.request_id
            and last.finish_reason is None and (last.logprobs is None) == (new.logprobs is None))


def _merged(first: m.Tokens, then: m.Tokens) -> m.Tokens:
    logprobs = None if first.logprobs is None else [*first.logprobs, *(then.logprobs or [])]
    top = None if first.top_logprobs is None else [*first.top_logprobs, *(then.top_logprobs or [])]
    return m.Tokens(first.request_id, [*first.tokens, *then.tokens], then.finish_reason, logprobs, top,
                    first.cached_tokens)


async def _send_when_connected(sock: Any, message: object, wait_s: float) -> bool:
    """Send, retrying while a socket just made to a peer connects (a request
    is never queued for a peer that is not there)."""
    give_up = time.monotonic() + wait_s
    while not await send(sock, message):
        if time.monotonic() >= give_up:
            return False
        await asyncio.sleep(0.01)
    return True


def _ticket_fields(ticket: TransferTicket) -> tuple[str, str, int, str, str, int]:
    return ticket.transport, ticket.transfer_id, ticket.nbytes, ticket.address, ticket.group, ticket.tag


def _ticket_values(ticket: m.Ticket) -> tuple[str, str, int, str, str, int]:
    return ticket.transport, ticket.transfer_id, ticket.nbytes, ticket.address, ticket.group, ticket.tag


def _refusal_status(exc: Exception) -> int:
    if isinstance(exc, EngineOverloaded):
        return 429
    if isinstance(exc, EngineUnavailable | MissingEmbedding):
        return 503
    if isinstance(exc, RequestFailed):
        return 500
    return 400


def default_id(role: str, port: int) -> str:
    return f"{role}-{socket.gethostname()}-{port}"


async def run_worker(config: WorkerConfig) -> None:
    await run_service(partial(WorkerService, config), f"worker {config.worker_id}")


def _tokens_message(request_id: str, event: StreamEvent) -> m.Tokens:
    if event.logprob is None:
        return m.Tokens(request_id, [event.token], event.finish_reason, cached_tokens=event.cached_tokens)
    return m.Tokens(request_id, [event.token], event.finish_reason, [event.logprob],
                    [list(event.top_logprobs)], event.cached_tokens)
