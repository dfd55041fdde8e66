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
decoded here over KV a prefill worker sends, and any worker prefills for a
decode worker that asks; both sides are ``worker_pd``'s.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from api.engine_loop import AsyncEngine, Sink, Submission
from api.streams import EngineOverloaded, EngineUnavailable, RequestFailed, StreamEvent
from api.metrics import ServerMetrics
from api.stack import messages as m
from api.stack.embeddings import embedding_cache, keep_ring_fresh
from api.stack.outbox import Outbox, tokens_message
from api.stack.service import Peers, ServiceSocket, every, run_service
from api.stack.transport import send
from api.stack.worker_pd import Disaggregation
from api.stack.worker_refusals import MissingEmbedding, refusal_status
from embedding_cache import EmbeddingCache, SharedEmbeddingStore
from llm_core import LLM, MultimodalSpan, SamplingParams
from llm_core.kv.kv_events import KVEventLog
from llm_core.prompts import encode_prompt

__all__ = ["WorkerConfig", "WorkerService", "run_worker"]

log = logging.getLogger(__name__)

EVENT_INTERVAL_S = 0.02
ROLES = ("both", "prefill", "decode")


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
        self.embedding_reads = {"read": 0, "missing": 0, "bytes": 0}  # spans' rows taken from the store
        self.metrics = ServerMetrics()
        self.outbox = Outbox(self._send)
        self._service: ServiceSocket | None = None
        self.disaggregation = Disaggregation(
            self.llm, self.engine, worker_id=config.worker_id, incarnation=self.incarnation, host=config.host,
            kv_transport=config.kv_transport, transfer_timeout_s=config.transfer_timeout_s, send=self._send,
            prepare=self._request)

    @property
    def requests(self) -> dict[str, tuple[bytes, asyncio.Task[None]]]:
        assert self._service is not None
        return self._service.held

    @property
    def _peers(self) -> Peers:
        assert self._service is not None
        return self._service.peers

    # ----------------------------------------------------------------- life
    async def serve(self, stop: asyncio.Event) -> None:
        config = self.config
        self._service = ServiceSocket(config.host, config.port, config.health_port, self._http_routes(),
                                      config.ipc_path)
        chores = [self.engine.run_inline(), self._service.dispatch(self._handle),
                  every(EVENT_INTERVAL_S, self._publish_events, "sending KV events"),
                  keep_ring_fresh(self.embeddings, config.embedding_peers)]
        where = f"ipc://{config.ipc_path}" if config.ipc_path else f"tcp://{config.host}:{config.port}"
        log.info("worker %s serving %s on %s (health on %d)", config.worker_id, config.model_dir, where,
                 config.health_port)
        self.disaggregation.start(self._service.context)
        try:
            await self._service.run_until(stop, chores)
        finally:
            self.disaggregation.close()
            self.engine.close()
            self.llm.close()
            await self.embeddings.aclose()
            if self.store is not None:
                self.store.close()

    # ------------------------------------------------------------ messages
    async def _handle(self, identity: bytes, message: object) -> None:
        if isinstance(message, m.PrefillRequest | m.AbortPrefill | m.Probe):
            await self.disaggregation.handle(identity, message)  # a decode worker, not an API: no KV events to it
            return
        if isinstance(message, m.Ping):
            if self._peers.seen(identity):
                log.info("API %s registered", message.sender)
                await self._send(identity, self._snapshot())
            await self._send(identity, self._pong(message))
            return
        self._peers.seen(identity)
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
        return (engine_stats | {"embeddings": dict(self.embedding_reads), "role": self.config.role}
                | self.disaggregation.stats())

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
        for identity in self._peers:
            # A peer that misses a batch sees the gap in the next one and asks for a snapshot.
            await self._send(identity, message)

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
            self.outbox.put(identity, m.Admitted(rid) if event is None else tokens_message(rid, event))

        submission: Submission | None = None
        if not submit.spans and not submit.prefill_by:
            try:
                self._check_incarnation(submit)
                params, prompt = self._checked(submit.sampling, submit.prompt_ids)
                submission = self.engine.submit(prompt, params, sink=sink, request_id=rid)
            except (ValueError, EngineOverloaded, EngineUnavailable) as exc:
                self.outbox.put(identity, m.Refused(rid, refusal_status(exc), str(exc)))
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
                self.outbox.put(identity, m.Refused(rid, refusal_status(exc), str(exc)))
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
            return await self.disaggregation.admit(submit, params, prompt, spans, sink)
        return await self.engine.open(prompt, params, spans, sink=sink, request_id=submit.request_id)

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


def default_id(role: str, port: int) -> str:
    return f"{role}-{socket.gethostname()}-{port}"


async def run_worker(config: WorkerConfig) -> None:
    await run_service(partial(WorkerService, config), f"worker {config.worker_id}")
