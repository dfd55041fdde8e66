"""`swallow encoder`: media in, embeddings into the machine's shared memory.

An API sends one message per media item (a path on a shared spool, or the
bytes); the encoder looks it up in the embedding cache, else decodes,
preprocesses and encodes it in a forward batched with other requests'
items, stores the rows in the shared-memory store (and with the key's owner
machine on the ring), and answers with the content key and the number of
rows. Workers read the rows by that key: tensors never cross a socket.
A media failure is that item's alone (a 4xx with the reason).

Its HTTP port serves /health, /metrics and, for other machines' lookups,
/internal/embeddings/{key}.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from api.metrics import ServerMetrics
from api.media_pipeline import media_pipeline
from api.stack import messages as m
from api.stack.embeddings import embedding_cache, keep_ring_fresh
from api.stack.service import ServiceSocket, run_service
from api.stack.transport import send
from embedding_cache import SharedEmbeddingStore, embedding_cache_routes
from encoders import EncoderQueueFull
from encoders.media_kinds import media_kinds, placeholder_token_ids
from media import MediaError

__all__ = ["EncoderConfig", "EncoderService", "run_encoder"]

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class EncoderConfig:
    model_dir: Path
    host: str
    port: int
    health_port: int
    encoder_id: str
    store_name: str
    store_bytes: int = 256 << 20
    device: str = "cpu"
    dtype: str = "float32"
    max_file_bytes: int = 512 << 20
    embedding_peers: str = ""
    embedding_node: str | None = None


class EncoderService:
    def __init__(self, config: EncoderConfig) -> None:
        self.config = config
        self.incarnation = uuid.uuid4().hex
        self.metrics = ServerMetrics()
        self.store = SharedEmbeddingStore.open(config.store_name, config.store_bytes)
        self.cache = embedding_cache(self.store, config.embedding_peers, config.embedding_node)
        pipeline = media_pipeline(config.model_dir, self.cache, config.max_file_bytes, self.metrics, config.device,
                                  config.dtype)
        if pipeline is None:
            self.store.close()
            raise ValueError(f"{config.model_dir} has no media encoders: an encoder has nothing to serve")
        self.batcher, self.embedder = pipeline
        self.media_kinds = sorted(media_kinds(set(self.batcher.kinds), placeholder_token_ids(config.model_dir)))
        self._service: ServiceSocket | None = None

    @property
    def in_flight(self) -> dict[str, tuple[bytes, asyncio.Task[None]]]:
        assert self._service is not None
        return self._service.held

    async def serve(self, stop: asyncio.Event) -> None:
        config = self.config
        self._service = ServiceSocket(config.host, config.port, config.health_port, self._http_routes())
        chores = [self._service.dispatch(self._handle), keep_ring_fresh(self.cache, config.embedding_peers)]
        log.info("encoder %s (%s) on tcp://%s:%d, store %s", config.encoder_id, ", ".join(self.media_kinds),
                 config.host, config.port, config.store_name)
        try:
            await self._service.run_until(stop, chores)
        finally:
            await self.batcher.aclose()
            self.embedder.close()
            await self.cache.aclose()
            self.store.close()

    async def _handle(self, identity: bytes, message: object) -> None:
        assert self._service is not None
        self._service.peers.seen(identity)
        if isinstance(message, m.Ping):
            await send(self._service.sock, self._pong(message), identity)
        elif isinstance(message, m.EmbedMedia):
            task = asyncio.create_task(self._embed(identity, message))
            self.in_flight[message.request_id] = (identity, task)
        else:
            log.warning("unexpected %s", type(message).__name__)

    def _pong(self, ping: m.Ping) -> m.EncoderPong:
        stats = self.embedder.stats
        return m.EncoderPong(m.PROTOCOL_VERSION, self.config.encoder_id, self.incarnation, ping.sent_at,
                             self.media_kinds, self.config.store_name, len(self.in_flight),
                             {"upload_hits": stats.upload_hits, "content_hits": stats.content_hits,
                              "misses": stats.misses, "store": self.store.stats()})

    async def _embed(self, identity: bytes, request: m.EmbedMedia) -> None:
        assert self._service is not None
        rid = request.request_id
        try:
            answer = await self._embedding(request)
        except MediaError as exc:
            answer = m.EmbedFailed(rid, exc.status, str(exc))
        except EncoderQueueFull as exc:
            answer = m.EmbedFailed(rid, 503, f"{exc}; retry shortly")
        except ValueError as exc:
            answer = m.EmbedFailed(rid, 400, str(exc))
        except Exception as exc:  # noqa: BLE001 - this item's failure, not the encoder's
            log.exception("embedding a %s failed", request.kind)
            answer = m.EmbedFailed(rid, 500, f"the {request.kind} could not be encoded: {type(exc).__name__}: {exc}")
        finally:
            self.in_flight.pop(rid, None)
        self.metrics.count_embedding(request.kind, isinstance(answer, m.Embedded) and answer.cached)
        await send(self._service.sock, answer, identity)

    async def _embedding(self, request: m.EmbedMedia) -> m.Embedded | m.EmbedFailed:
        if request.kind not in self.media_kinds:
            return m.EmbedFailed(request.request_id, 400, f"this model does not take {request.kind} input")
        if (request.path is None) == (request.data is None):
            return m.EmbedFailed(request.request_id, 400, "a media item needs a path or its bytes, not both")
        source = Path(request.path) if request.path is not None else request.data
        emb = await self.embedder.embed(request.kind, source, request.digest)  # type: ignore[arg-type]
        assert emb.tensor is not None  # an embedder returns the rows it made or found
        if emb.key not in self.store and self.cache.ring is None:
            size = emb.tensor.numel() * emb.tensor.element_size()
            return m.EmbedFailed(request.request_id, 413, f"the {request.kind}'s embedding ({size} bytes) does not "
                                 f"fit the embedding store ({self.store.capacity_bytes} bytes)")
        return m.Embedded(request.request_id, emb.key, emb.rows, emb.cached)

    def _http_routes(self) -> list[Route]:
        async def health(_: Request) -> Response:
            return JSONResponse({"status": "ok", "role": "encoder", "encoder_id": self.config.encoder_id,
                                 "incarnation": self.incarnation, "media_kinds": self.media_kinds,
                                 "pid": os.getpid()})

        async def metrics(_: Request) -> Response:
            return Response(self.metrics.render(), media_type=self.metrics.content_type)

        return [Route("/health", health), Route("/metrics", metrics), *embedding_cache_routes(self.store)]


async def run_encoder(config: EncoderConfig) -> None:
    await run_service(partial(EncoderService, config), f"encoder {config.encoder_id}")
