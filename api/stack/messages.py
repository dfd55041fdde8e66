"""The messages between the stack's processes: typed, versioned, msgpack on the wire.

Every message is a ``msgspec`` struct tagged with its name; a frame is one
message, encoded with msgpack (never pickle: a peer can only make us build
these types). The protocol version travels in every ``Hello``/``Ping``, and a
peer speaking another version is refused with a reason instead of
misreading its frames.

API -> worker: ``Ping`` (liveness, and registration: a worker sends KV events
to every API that pings it), ``Submit``, ``Abort``, ``Flush``,
``SnapshotRequest``. Worker -> API: ``WorkerPong``, ``KVEventsMsg``,
``Flushed``, and ``StepOutputs``: what one engine step did for that API's
requests (``Admitted``, ``Refused``, ``Tokens``, ``Failed``), in one frame.

Disaggregation, decode worker -> prefill worker: ``PrefillRequest`` (the
KV goes into the buffer its ticket names), ``AbortPrefill``, ``Probe``
(liveness while it waits). Prefill worker -> decode worker: ``Prefilled``
(the KV is sent; the first token), ``PrefillFailed``, ``ProbeAck``.

API -> encoder: ``Ping``, ``EmbedMedia``. Encoder -> API: ``EncoderPong``,
``Embedded``, ``EmbedFailed``.

Media never travel as tensors: an encoder writes embeddings into the
machine's shared-memory store and answers with the content key; a worker
reads them from there by key (or from the key's owner machine).
"""

from __future__ import annotations

from typing import Any

import msgspec

from llm_core import SamplingParams
from llm_core.sample.grammar import GrammarSpec
from llm_core.kv.kv_events import EventBatch, KVEvent, Medium

__all__ = [
    "PROTOCOL_VERSION", "Abort", "AbortPrefill", "Admitted", "Prefilled", "PrefillFailed", "PrefillRequest",
    "Probe", "ProbeAck", "Ticket", "EmbedFailed", "EmbedMedia", "Embedded", "EncoderPong", "Failed",
    "Flush", "Flushed", "KVEventsMsg", "Message", "Ping", "ProtocolError", "Refused", "SamplingSpec",
    "SnapshotRequest", "SpanSpec", "StepOutputs", "Submit", "Tokens", "WorkerPong", "decode", "encode",
]

PROTOCOL_VERSION = 6


class ProtocolError(ValueError):
    """A frame that is not a message of this protocol version."""


class _Msg(msgspec.Struct, tag=True, array_like=True, frozen=True):
    pass


# ----------------------------------------------------------------- requests
class SamplingSpec(msgspec.Struct, array_like=True, frozen=True):
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logprobs: int | None
    grammar: tuple[str, str, str] | None  # GrammarSpec's (kind, source, after)

    @classmethod
    def of(cls, params: SamplingParams) -> SamplingSpec:
        g = params.grammar
        grammar = (g.kind, g.source, g.after) if g is not None else None
        return cls(params.max_tokens, params.temperature, params.top_p, params.top_k, params.seed,
                   tuple(params.stop_token_ids), params.ignore_eos, params.presence_penalty,
                   params.frequency_penalty, params.repetition_penalty, params.logprobs, grammar)

    def params(self) -> SamplingParams:
        """Checked again on the worker: it trusts no peer's values."""
        grammar = GrammarSpec(*self.grammar) if self.grammar is not None else None  # type: ignore[arg-type]
        return SamplingParams(self.max_tokens, self.temperature, self.top_p, self.top_k, self.seed,
                              self.stop_token_ids, self.ignore_eos, self.presence_penalty, self.frequency_penalty,
                              self.repetition_penalty, self.logprobs, grammar)


class SpanSpec(msgspec.Struct, array_like=True, frozen=True):
    """A multimodal span: prompt positions [offset, offset + length) take the
    embedding stored under ``key`` in the embedding store."""

    offset: int
    length: int
    key: bytes


class Ping(_Msg):
    version: int
    sender: str  # the API's (or supervisor's) id
    sent_at: float


class Submit(_Msg):
    request_id: str  # assigned by the caller
    incarnation: str  # the worker incarnation it was routed to: a restarted worker refuses it
    prompt_ids: list[int]
    spans: list[SpanSpec]
    sampling: SamplingSpec
    # Disaggregated: the prefill worker's address and incarnation; this (decode) worker gets the KV from it.
    prefill_by: str = ""
    prefill_incarnation: str = ""


class Ticket(msgspec.Struct, array_like=True, frozen=True):
    """``llm_core.cluster.kv_transport.TransferTicket`` on the wire."""

    transport: str
    transfer_id: str
    nbytes: int
    address: str
    group: str
    tag: int


class PrefillRequest(_Msg):
    transfer_id: str
    incarnation: str  # the prefill worker's, as the API routed it
    prompt_ids: list[int]
    spans: list[SpanSpec]
    sampling: SamplingSpec
    ticket: Ticket
    page_size: int  # the receiver's KV layout: a sender of another layout refuses
    swa_mode: str
    kv_layout: str  # the receiver's KV dtype and FP8 scales (Engine.kv_layout)


class AbortPrefill(_Msg):
    transfer_id: str


class Probe(_Msg):
    transfer_id: str


class ProbeAck(_Msg):
    transfer_id: str
    known: bool  # False: the prefill worker has no such transfer (restarted, or done)


class Prefilled(_Msg):
    transfer_id: str
    first_token: int
    seed: int
    cached_tokens: int
    finish_reason: str | None
    logprob: float | None
    top_logprobs: list[tuple[int, float]]
    nbytes: int


class PrefillFailed(_Msg):
    transfer_id: str
    status: int
    message: str


class Abort(_Msg):
    request_id: str


class Flush(_Msg):
    """Answered with ``Flushed``: the worker's stats as of now, after it
    dropped every prefix no request holds (``drop``) or as they are."""

    token: str
    drop: bool = True


class SnapshotRequest(_Msg):
    pass


# -------------------------------------------------------------- worker side
class WorkerPong(_Msg):
    version: int
    worker_id: str
    incarnation: str  # new on every start: the router starts its index over
    sent_at: float  # echoed from the Ping
    model: str
    fingerprint: bytes | None  # None: prefix caching off (nothing to route on)
    page_size: int
    window_tokens: int
    keep_all_swa: bool
    queued_tokens: int  # prompt tokens waiting or prefilling, not cached
    running: int
    waiting: int
    pending: int
    stats: dict[str, Any]
    role: str = "both"  # "prefill" | "decode" | "both"


class Admitted(_Msg):
    request_id: str


class Refused(_Msg):
    """Refused before any token: the caller answers ``status`` with ``message``."""

    request_id: str
    status: int
    message: str


class Tokens(_Msg):
    request_id: str
    tokens: list[int]
    finish_reason: str | None  # set with the request's last tokens
    # With SamplingParams.logprobs: per token, its logprob and its top (token, logprob) pairs.
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    cached_tokens: int | None = None  # with the request's first tokens


class Failed(_Msg):
    """The request failed after admission (500: this request's fault; 503: the engine's)."""

    request_id: str
    status: int
    message: str


RequestOutput = Admitted | Refused | Tokens | Failed


class StepOutputs(_Msg):
    """Everything about one API's requests since the last frame (about one
    engine step), in order: one frame per step, not one per token."""

    outputs: list[RequestOutput]


class KVEventsMsg(_Msg):
    worker_id: str
    incarnation: str
    epoch: int
    start: int
    snapshot: bool
    # (medium, address, part, held) per event; see llm_core/kv/kv_events.py
    events: list[tuple[str, bytes, bytes, int]]

    @classmethod
    def of(cls, worker_id: str, incarnation: str, batch: EventBatch) -> KVEventsMsg:
        return cls(worker_id, incarnation, batch.epoch, batch.start, batch.snapshot,
                   [(e.medium, e.address, e.part, e.held) for e in batch.events])

    def batch(self) -> EventBatch:
        events = tuple(KVEvent(_medium(m), a, p, h) for m, a, p, h in self.events)
        return EventBatch(self.epoch, self.start, events, self.snapshot)


class Flushed(_Msg):
    token: str
    stats: dict[str, Any]


# ------------------------------------------------------------- encoder side
class EmbedMedia(_Msg):
    request_id: str  # one media item's id, assigned by the caller
    kind: str  # "image" | "video" | "audio"
    path: str | None  # a file the encoder can read (same machine, shared spool)
    data: bytes | None  # otherwise the bytes themselves
    digest: bytes | None = None  # the file's file_digest, when the API has it (a clip seen and heard)


class Embedded(_Msg):
    request_id: str
    key: bytes  # where the embedding is in the store
    rows: int
    cached: bool


class EmbedFailed(_Msg):
    request_id: str
    status: int
    message: str


class EncoderPong(_Msg):
    version: int
    encoder_id: str
    incarnation: str
    sent_at: float
    media_kinds: list[str]
    store: str  # the shared-memory store it writes
    in_flight: int
    stats: dict[str, Any]


Message = (Ping | Submit | Abort | Flush | SnapshotRequest | WorkerPong | Admitted | Refused | Tokens | Failed
           | StepOutputs | KVEventsMsg | Flushed | EmbedMedia | Embedded | EmbedFailed | EncoderPong | PrefillRequest
           | AbortPrefill | Probe | ProbeAck | Prefilled | PrefillFailed)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)  # type: ignore[arg-type]
_MEDIA: dict[str, Medium] = {"device": "device", "host": "host", "disk": "disk"}


def _medium(name: str) -> Medium:
    try:
        return _MEDIA[name]
    except KeyError:
        raise ProtocolError(f"unknown KV medium {name!r}") from None


def encode(message: _Msg) -> bytes:
    return _encoder.encode(message)


def decode(frame: bytes) -> Any:
    """One message; ProtocolError for anything else, and for a peer of another version."""
    try:
        message = _decoder.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"not a message of protocol version {PROTOCOL_VERSION}: {exc}") from None
    version = getattr(message, "version", PROTOCOL_VERSION)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"peer speaks protocol version {version}, this process {PROTOCOL_VERSION}")
    return message
