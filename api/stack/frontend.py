"""`swallow api`: the HTTP server of the stack. Its ``Frontend`` keeps the
tokenizer, chat template and router here, sends media to encoder processes
and requests to worker processes.

Routing: every worker's KV events feed the ``Router`` (``llm_core/cluster/router.py``),
which sends a request to the worker that can reuse the longest window-safe
prefix of it, less a load term. Tokens come back over the worker's socket and
are detokenized here, where stop strings end a request (the worker is told to
abort it). A worker that stops answering leaves routing within
``links.DEAD_AFTER_S``; its streams end with a 503 error event.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import replace
from collections.abc import AsyncGenerator, Sequence
from pathlib import Path
from typing import Any

from api.chat import MediaRef
from api.streams import (
    Detokenizer, EngineOverloaded, EngineUnavailable, RequestFailed, StreamEvent, admitted_stream,
)
from api.metrics import ServerMetrics
from api.options import ServerOptions
from api.stack import messages as m
from api.stack.links import Link, LinkSet, ServiceDown
from api.stack.transport import parse_peers, send
from encoders.media_kinds import encoder_kinds, media_kinds, placeholder_token_ids
from llm_core import ModelConfig, MultimodalSpan, SamplingParams
from llm_core.model.chat import ChatTemplate
from llm_core.prompts import check_context_length, encode_prompt
from llm_core.model.multimodal import MediaEmbedding, SpanRef, with_cache_tokens
from llm_core.kv.page_address import CacheGeometry
from llm_core.cluster.router import DEFAULT_LOAD_WEIGHT, DEFAULT_MAX_LOAD_RATIO, NoWorkers, Router
from llm_core.model.tokenizer import Tokenizer
from media import MediaError

__all__ = ["EncoderLinks", "RemoteEmbedder", "RemoteEngineClient", "StackFrontend", "WorkerLinks"]

log = logging.getLogger(__name__)

_FLUSH_TIMEOUT_S = 60.0


# ------------------------------------------------------------------ workers
class WorkerLinks(LinkSet[m.WorkerPong]):
    """The workers, kept in the router while they answer."""

    def __init__(self, peers: str, router: Router, sender: str) -> None:
        super().__init__(parse_peers(peers), m.WorkerPong, sender)
        if not self.peers:
            raise ValueError("the API needs at least one worker address (--workers)")
        self.router = router
        self._flushes: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._registered: dict[str, str] = {}  # worker id -> the address routed to

    def on_up(self, link: Link[m.WorkerPong]) -> None:
        pong = link.pong
        assert pong is not None
        holder = self._registered.get(pong.worker_id)
        if holder is not None and holder != link.address and holder in self.links and self.links[holder].alive:
            log.error("worker id %s answers at %s and at %s: routing to the first only", pong.worker_id, holder,
                      link.address)
            return
        # No fingerprint (prefix caching off): nothing to reuse there, but it takes requests.
        geometry = CacheGeometry(pong.fingerprint or b"", max(pong.page_size, 1), pong.window_tokens,
                                 pong.keep_all_swa)
        self.router.add_worker(pong.worker_id, geometry, pong.role)  # from an empty index: a restarted one has nothing
        self._registered[pong.worker_id] = link.address

    def on_down(self, link: Link[m.WorkerPong]) -> None:
        if link.pong is not None and self._registered.get(link.pong.worker_id) == link.address:
            del self._registered[link.pong.worker_id]
            self.router.remove_worker(link.pong.worker_id)

    def on_pong(self, link: Link[m.WorkerPong]) -> None:
        pong = link.pong
        assert pong is not None
        if self._registered.get(pong.worker_id) == link.address:
            self.router.report_load(pong.worker_id, pong.queued_tokens, pong.running)

    def on_orphans(self, link: Link[m.WorkerPong], request_ids: set[str]) -> None:
        # Their clients were answered with a 503: nobody reads their tokens.
        log.warning("%s is back; aborting the %d requests failed while it was away", link.name, len(request_ids))
        for request_id in request_ids:
            asyncio.create_task(self._send(link, m.Abort(request_id)))

    def on_message(self, link: Link[m.WorkerPong], message: object) -> None:
        if isinstance(message, m.StepOutputs):
            for output in message.outputs:
                super().on_message(link, output)
        elif isinstance(message, m.KVEventsMsg):
            registered = self._registered.get(message.worker_id) == link.address
            if registered and link.alive and message.incarnation == link.incarnation:
                if not self.router.apply_events(message.worker_id, message.batch()):
                    asyncio.create_task(self._send(link, m.SnapshotRequest()))
        elif isinstance(message, m.Flushed):
            future = self._flushes.get(f"{link.address}/{message.token}")
            if future is not None and not future.done():
                future.set_result(message.stats)
        else:
            super().on_message(link, message)

    async def _send(self, link: Link[m.WorkerPong], message: object) -> None:
        await send(link.sock, message)

    def by_id(self, worker_id: str) -> Link[m.WorkerPong]:
        link = self.links.get(self._registered.get(worker_id, ""))
        if link is None or not link.alive:
            raise ServiceDown(f"worker {worker_id} is gone; retry the request")
        return link

    async def flush(self, drop: bool = True) -> dict[str, dict[str, Any]]:
        """Every live worker's stats (by its name) as of now, after it dropped
        every prefix no request holds (``drop``)."""
        token = uuid.uuid4().hex
        waits = {}
        for link in self.alive():
            future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
            self._flushes[f"{link.address}/{token}"] = future
            await self._send(link, m.Flush(token, drop))
            waits[link.name] = future
        try:
            done = await asyncio.wait_for(asyncio.gather(*waits.values(), return_exceptions=True), _FLUSH_TIMEOUT_S)
        finally:
            for key in [k for k in self._flushes if k.endswith(token)]:
                del self._flushes[key]
        return {name: stats for name, stats in zip(waits, done) if isinstance(stats, dict)}


class RemoteEngineClient:
    """``EngineClient`` over the workers: route, submit, stream."""

    def __init__(self, workers: WorkerLinks, max_pending: int, encoders: EncoderLinks | None = None,
                 vocab_size: int | None = None) -> None:
        """``vocab_size``: token ids in sampling parameters are checked here
        (a 400 before they travel), not only on the worker."""
        self.vocab_size = vocab_size
        self.workers = workers
        self.encoders = encoders
        self.router = workers.router
        self.max_pending = max_pending
        self._pending = 0

    @property
    def pending(self) -> int:
        return self._pending

    def stats(self, per_worker: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
        """The live workers' stats summed (pools, cache, queues), and each one's
        (as of their last pong, unless given)."""
        if per_worker is None:
            per_worker = {link.name: link.pong.stats for link in self.workers.alive() if link.pong is not None}
        encoders = {link.name: link.pong.stats for link in self.encoders.alive() if link.pong is not None} \
            if self.encoders is not None else {}
        return aggregate_stats(list(per_worker.values())) | {
            "workers": per_worker, "encoders": encoders,
            "routing": {"policy": self.router.policy, "workers": self.router.loads(),
                        "decisions": decision_counts(self.router)}}

    async def current_stats(self) -> dict[str, Any]:
        return self.stats(await self.workers.flush(drop=False))

    async def flush_cache(self) -> dict[str, Any]:
        return aggregate_stats(list((await self.workers.flush()).values()))

    async def open(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        spans: Sequence[MultimodalSpan | SpanRef] = (),
        text: Detokenizer | None = None,
        request_id: str | None = None,
    ) -> AsyncGenerator[StreamEvent, None]:
        if self._pending >= self.max_pending:
            raise EngineOverloaded(f"the server is at capacity ({self._pending} requests in progress)")
        if self.vocab_size is not None:
            params.check_vocabulary(self.vocab_size)
        # The API's id goes to the worker in the Submit: its log lines name the request the same way.
        request_id = request_id or uuid.uuid4().hex
        try:
            decision = self.router.route(request_id, with_cache_tokens(prompt_ids, spans))
        except NoWorkers:
            raise EngineUnavailable("no worker is available; retry shortly") from None
        routed = RoutedStream()
        routed.worker_id = decision.worker_id
        self._pending += 1
        source = self._items(prompt_ids, params, spans, text, routed, request_id)
        routed.stream = await admitted_stream(source, lambda _finished: self._release(request_id, routed))
        return routed  # type: ignore[return-value]

    async def _items(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        spans: Sequence[MultimodalSpan | SpanRef],
        text: Detokenizer | None,
        routed: RoutedStream,
        request_id: str,
    ) -> AsyncGenerator[StreamEvent | None, None]:
        """The request sent to its worker: its admission (None), then its events."""
        try:
            routed.link, prefill_by, prefill_incarnation = self._links_for(request_id, routed.worker_id, routed)
            submit = m.Submit(request_id, routed.link.incarnation, list(prompt_ids),
                              [m.SpanSpec(s.offset, s.length, s.key) for s in spans], m.SamplingSpec.of(params),
                              prefill_by, prefill_incarnation)
            queue = await self.workers.request(routed.link, request_id, submit)
            routed.worker_holds = True  # sent: from here the worker may hold it, admitted or not yet
            answer = await queue.get()
            if not isinstance(answer, m.Admitted):
                routed.worker_holds = False  # refused, or lost before admission
                raise _error_of(answer)
            yield None
            async for event in self._tokens(queue, request_id, text, routed):
                yield event
        except ServiceDown as exc:
            raise EngineUnavailable(str(exc)) from None

    async def _release(self, request_id: str, routed: RoutedStream) -> None:
        self._pending -= 1
        self.router.prefill_done(request_id)
        self.router.decode_done(request_id)
        link = routed.link
        if link is not None:
            link.waiting.pop(request_id, None)
            # The client left, a stop string or a text failure ended it here: the
            # worker would go on generating it.
            if routed.worker_holds and link.alive:
                await self.workers._send(link, m.Abort(request_id))

    def _links_for(self, request_id: str, prefill_worker: str,
                   routed: RoutedStream) -> tuple[Link[m.WorkerPong], str, str]:
        """The link the request goes to and, disaggregated, the prefill
        worker's address and incarnation it is to get its KV from."""
        prefill = self.workers.by_id(prefill_worker)
        decode_worker = self.router.pick_decode(request_id, prefill_worker)
        if decode_worker is None:
            return prefill, "", ""
        try:
            decode = self.workers.by_id(decode_worker)
        except ServiceDown:
            self.router.decode_done(request_id)
            return prefill, "", ""  # its decode worker just went: decode where it is prefilled
        routed.decode_worker_id = decode_worker
        return decode, prefill.address, prefill.incarnation

    async def _tokens(self, queue: asyncio.Queue[Any], request_id: str, text: Detokenizer | None,
                      routed: RoutedStream) -> AsyncGenerator[StreamEvent, None]:
        first = True
        while True:
            message = await queue.get()
            if not isinstance(message, m.Tokens):
                routed.worker_holds = False  # it failed there, or the worker is gone
                raise _error_of(message)
            if first:
                first = False
                self.router.prefill_done(request_id)
            for i, token in enumerate(message.tokens):
                reason = message.finish_reason if i == len(message.tokens) - 1 else None
                # Ended by the worker before it is handed over: a reader that
                # stops at the last event and closes the stream sends no abort.
                routed.worker_holds = reason is None
                event = _with_text(token, reason, text)
                logprob = message.logprobs[i] if message.logprobs is not None else None
                top = tuple(map(tuple, message.top_logprobs[i])) if message.top_logprobs is not None else ()
                yield replace(event, logprob=logprob, top_logprobs=top,  # type: ignore[arg-type]
                              cached_tokens=message.cached_tokens if i == 0 else None)


class RoutedStream:
    """A request's token stream, and the worker serving it."""

    def __init__(self) -> None:
        self.stream: AsyncGenerator[StreamEvent, None] | None = None
        self.link: Link[m.WorkerPong] | None = None  # the worker it was sent to
        self.worker_holds = False  # sent there and not ended by the worker: closing it sends an abort
        self.worker_id = ""  # where its prompt is computed
        self.decode_worker_id = ""  # disaggregated: where it is decoded

    def __aiter__(self) -> RoutedStream:
        return self

    async def __anext__(self) -> StreamEvent:
        assert self.stream is not None
        return await self.stream.__anext__()

    async def aclose(self) -> None:
        if self.stream is not None:
            await self.stream.aclose()


def _with_text(token: int, reason: str | None, text: Detokenizer | None) -> StreamEvent:
    if text is None:
        return StreamEvent(token, reason)
    try:
        delta = text.push(token, final=reason is not None)
    except Exception as exc:  # noqa: BLE001 - this request's problem
        raise RequestFailed(f"the request's text could not be decoded: {type(exc).__name__}: {exc}") from exc
    return StreamEvent(token, "stop" if text.stopped else reason, delta)


def _error_of(message: object) -> Exception:
    """The exception a worker's refusal, failure or loss means here."""
    if isinstance(message, Exception):
        return EngineUnavailable(str(message)) if isinstance(message, ServiceDown) else message
    if isinstance(message, m.Refused | m.Failed):
        if message.status == 429:
            return EngineOverloaded(message.message)
        if message.status == 503:
            return EngineUnavailable(message.message)
        if message.status >= 500:
            return RequestFailed(message.message)
        return ValueError(message.message)
    return RequestFailed(f"unexpected answer from the worker: {type(message).__name__}")


def aggregate_stats(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """Several engines' stats as one: counts and capacities summed, the hit rate recomputed."""
    if not stats:
        return {}
    out = _sum(stats)
    cache = out.get("prefix_cache")
    if isinstance(cache, dict):
        total = cache.get("cached_prompt_tokens", 0) + cache.get("computed_prompt_tokens", 0)
        cache["hit_rate"] = round(cache.get("cached_prompt_tokens", 0) / total, 4) if total else 0.0
    return out


# Values that are the same on every worker (bounds, sizes, settings) or not sums.
_NOT_ADDITIVE = frozenset({"bytes_per_token", "num_speculative_tokens", "latency_buckets_s", "bucket_edges",
                           "restore_seconds_buckets", "hit_rate", "mean_acceptance_length", "swa_mode", "policy"})


def _sum(values: list[Any]) -> Any:
    first = values[0]
    if isinstance(first, bool) or not isinstance(first, int | float | dict | list):
        return first
    if isinstance(first, dict):
        keys = dict.fromkeys(k for v in values if isinstance(v, dict) for k in v)
        present = {k: [v[k] for v in values if isinstance(v, dict) and v.get(k) is not None] or [None] for k in keys}
        return {k: vs[0] if k in _NOT_ADDITIVE else _sum(vs) for k, vs in present.items()}
    if isinstance(first, list):
        if all(isinstance(v, list) and len(v) == len(first) for v in values) and \
                all(isinstance(x, int | float) and not isinstance(x, bool) for v in values for x in v):
            return [sum(col) for col in zip(*values)]
        return first
    return sum(v for v in values if isinstance(v, int | float))


def decision_counts(router: Router) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for (worker, reason), count in router.decisions.items():
        out.setdefault(worker, {})[reason] = count
    return out


# ----------------------------------------------------------------- encoders
class EncoderLinks(LinkSet[m.EncoderPong]):
    pass


class RemoteEmbedder:
    """``Embedder`` over the encoder processes: the item goes to the live
    encoder with the fewest of this API's items in flight."""

    def __init__(self, encoders: EncoderLinks, shared_spool: bool) -> None:
        self.encoders = encoders
        self.shared_spool = shared_spool

    async def embed(self, ref: MediaRef) -> MediaEmbedding:
        live = self.encoders.alive()
        if not live:
            raise EngineUnavailable("no encoder is available; retry shortly")
        link = min(live, key=lambda link: len(link.waiting))
        request_id = uuid.uuid4().hex
        path = str(ref.path.resolve()) if self.shared_spool and ref.path is not None else None
        message = m.EmbedMedia(request_id, ref.kind, path, None if path is not None else ref.read(), ref.digest)
        try:
            queue = await self.encoders.request(link, request_id, message)
            answer = await queue.get()
        except ServiceDown as exc:
            raise EngineUnavailable(str(exc)) from None
        finally:
            link.waiting.pop(request_id, None)
        if isinstance(answer, ServiceDown):
            raise EngineUnavailable(f"the encoder handling this {ref.kind} stopped ({answer}); retry the request")
        if isinstance(answer, m.EmbedFailed):
            if answer.status >= 500:
                raise (EngineUnavailable if answer.status == 503 else RequestFailed)(answer.message)
            raise MediaError(answer.message, answer.status)
        if not isinstance(answer, m.Embedded):
            raise RequestFailed(f"unexpected answer from the encoder: {type(answer).__name__}")
        return MediaEmbedding(ref.kind, answer.key, answer.rows, cached=answer.cached)  # the rows stay in the store


# ----------------------------------------------------------------- frontend
class StackFrontend:
    """The ``Frontend`` of `swallow api`: no weights here, only the model's
    config, tokenizer and chat template."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        workers: str,
        encoders: str = "",
        name: str | None = None,
        options: ServerOptions = ServerOptions(),
        metrics: ServerMetrics | None = None,
        route_policy: str = "kv-affinity",
        route_load_weight: float = DEFAULT_LOAD_WEIGHT,
        route_max_load_ratio: float = DEFAULT_MAX_LOAD_RATIO,
        shared_spool: bool = False,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.name = name or self.model_dir.name
        self.options = options
        self.metrics = metrics
        self.config = ModelConfig.from_json_file(self.model_dir / "config.json")
        self._tokenizer = Tokenizer.from_model_dir(self.model_dir)
        self.chat_template = ChatTemplate.from_model_dir(self.model_dir)
        self.placeholder_ids = placeholder_token_ids(self.model_dir)
        sender = f"api-{uuid.uuid4().hex[:8]}"
        self.router = Router(route_policy, route_load_weight, route_max_load_ratio)
        self.workers = WorkerLinks(workers, self.router, sender)
        self.encoders = EncoderLinks(parse_peers(encoders), m.EncoderPong, sender) if encoders else None
        self.engine = RemoteEngineClient(self.workers, options.max_pending_requests, self.encoders,
                                         self.config.vocab_size)
        self._embedder = RemoteEmbedder(self.encoders, shared_spool) if self.encoders is not None else None
        self._kinds = media_kinds(encoder_kinds(self.model_dir), self.placeholder_ids) if encoders else frozenset()

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def context_length(self) -> int:
        return self.config.max_position_embeddings

    @property
    def media_kinds(self) -> frozenset[str]:
        return self._kinds

    @property
    def embedder(self) -> RemoteEmbedder | None:
        return self._embedder

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        return encode_prompt(prompt, self._tokenizer, self.vocab_size, self.model_dir)

    def check_length(self, num_prompt_tokens: int, max_tokens: int) -> None:
        # The KV pools' limits are each worker's to check, at admission.
        check_context_length(num_prompt_tokens, max_tokens, self.context_length)

    def health(self) -> tuple[bool, dict[str, Any]]:
        workers = {link.name: link.alive for link in self.workers.links.values()}
        encoders = {link.name: link.alive for link in self.encoders.links.values()} if self.encoders else {}
        return any(workers.values()), {"role": "api", "workers": workers, "encoders": encoders,
                                       "route_policy": self.router.policy}

    async def start(self) -> None:
        await self.workers.start()
        if self.encoders is not None:
            await self.encoders.start()

    async def aclose(self) -> None:
        await self.workers.aclose()
        if self.encoders is not None:
            await self.encoders.aclose()
