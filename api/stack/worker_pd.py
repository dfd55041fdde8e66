"""A worker's part in disaggregated serving (``--role``).

A request the API sends with ``prefill_by`` is decoded here and prefilled
there. This worker reserves the request's KV slots and a transfer buffer
first, then asks the prefill worker (a ``PrefillRequest`` over a socket of
its own to it); that worker runs the prompt (its prefix cache applies),
sends the KV into the buffer and answers ``Prefilled`` with the first token;
the request goes on here from that token. If the KV does not come -- the
prefill worker refused, failed, went silent (``Probe`` unanswered) or took
longer than the transfer timeout -- the reservation is freed and the request
is prefilled here instead: slower, never wrong. A role only steers the API's
routing: any worker can serve a whole request, and any worker prefills for
a decode worker that asks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import zmq.asyncio

from api.engine_loop import AsyncEngine, Sink
from api.streams import EngineOverloaded, EngineUnavailable, RequestFailed, StreamEvent
from api.stack import messages as m
from api.stack.transport import connect_dealer, recv_message, send
from api.stack.worker_refusals import MissingEmbedding, refusal_status
from llm_core import LLM, MultimodalSpan, SamplingParams
from llm_core.cluster.disagg import KVReservation, PrefilledKV
from llm_core.cluster.kv_transport import KVTransport, ReceiveSlot, TransferError, TransferTicket, make_transport

__all__ = ["Disaggregation"]

log = logging.getLogger(__name__)

# A decode worker waiting for KV probes its prefill worker this often, and
# gives up on it (prefilling here instead) after this long without an answer.
PROBE_INTERVAL_S = 0.5
PROBE_SILENCE_S = 2.5
CONNECT_WAIT_S = 2.0  # for a socket to a prefill worker to connect

# A request's sampling, prompt and span references -> its parameters, prompt and
# spans, checked (ValueError, MissingEmbedding): the worker's own, for requests
# it prefills for others as for its own.
PrepareRequest = Callable[[m.SamplingSpec, list[int], Sequence[m.SpanSpec]],
                          Awaitable[tuple[SamplingParams, list[int], list[MultimodalSpan]]]]


class Disaggregation:
    """One worker's disaggregated requests: the decode side (KV received for
    requests prefilled elsewhere) and the prefill side (prefills run, and their
    KV sent, for decode workers)."""

    def __init__(self, llm: LLM, engine: AsyncEngine, *, worker_id: str, incarnation: str, host: str,
                 kv_transport: str, transfer_timeout_s: float, send: Callable[[bytes, object], Awaitable[bool]],
                 prepare: PrepareRequest) -> None:
        self.llm = llm
        self.engine = engine
        self.worker_id = worker_id
        self.incarnation = incarnation
        self.host = host
        self.kv_transport = kv_transport
        self.transfer_timeout_s = transfer_timeout_s
        self._send = send  # to a decode worker, on the worker's own socket
        self._prepare = prepare
        self._context: zmq.asyncio.Context | None = None  # the worker's, for sockets to prefill workers
        # Transports by name (made on first use), this worker's sockets to
        # prefill workers with their readers, transfers waiting for an answer
        # (decode side) and prefills running for a decode worker.
        self._transports: dict[str, KVTransport] = {}
        self._prefill_socks: dict[str, Any] = {}
        self._readers: list[asyncio.Task[None]] = []
        self._transfers: dict[str, asyncio.Queue[object]] = {}
        self._prefills: dict[str, asyncio.Task[None]] = {}
        self.counts = {"prefilled_for_others": 0, "bytes_sent": 0, "send_seconds": 0.0, "received": 0,
                       "bytes_received": 0, "receive_seconds": 0.0, "full_attention_bytes_received": 0,
                       "fallbacks": 0, "no_room": 0, "aborted_in_transfer": 0}

    def start(self, context: zmq.asyncio.Context) -> None:
        """Serve with the worker's ZeroMQ context (its sockets to prefill workers come from it)."""
        self._context = context

    def close(self) -> None:
        for task in self._readers:
            task.cancel()
        for sock in self._prefill_socks.values():
            sock.close()
        for transport in self._transports.values():
            transport.close()

    def stats(self) -> dict[str, Any]:
        return {"disaggregation": dict(self.counts),
                "transfer_buffers": {name: t.buffers() for name, t in self._transports.items()}}

    # ------------------------------------------------------------ decode side
    async def admit(self, submit: m.Submit, params: SamplingParams, prompt: list[int],
                    spans: list[MultimodalSpan], sink: Sink) -> Any:
        """The request's stream from its first token, over KV a prefill worker
        sends into slots reserved first; prefilled here if that fails."""
        reservation = await self.engine.call(lambda llm: llm.reserve_kv(len(prompt), params.max_tokens))
        if reservation is None:
            self.counts["no_room"] += 1  # no room to hold its KV now: it queues here like any request
            return await self.engine.open(prompt, params, spans, sink=sink, request_id=submit.request_id)
        held = True
        try:
            received = await self._receive_kv(submit, reservation)
            if received is not None:
                prefilled, blob, slot = received
                try:
                    stream = await self.engine.open_prefilled(reservation, prompt, params, prefilled, blob, spans,
                                                               sink=sink, request_id=submit.request_id)
                    held = False
                    self.counts["received"] += 1
                    return stream
                except ValueError as exc:
                    log.warning("the KV from %s did not fit its reservation (%s); prefilling here",
                                submit.prefill_by, exc)
                finally:
                    slot.close()
        finally:
            if held:
                self.engine.post(lambda llm: llm.cancel_reservation(reservation))
        self.counts["fallbacks"] += 1
        return await self.engine.open(prompt, params, spans, sink=sink, request_id=submit.request_id)

    def _transport(self, name: str) -> KVTransport:
        transport = self._transports.get(name)
        if transport is None:
            transport = self._transports[name] = make_transport(name, self.host, self.llm.device,
                                                                self.transfer_timeout_s)
        return transport

    def _prefill_sock(self, address: str) -> Any:
        sock = self._prefill_socks.get(address)
        if sock is None:
            assert self._context is not None, "start() first"
            identity = f"{self.worker_id}/decode/{self.incarnation}".encode()
            sock = self._prefill_socks[address] = connect_dealer(self._context, address, identity)
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
        slot = self._transport(self.kv_transport).open_receive(reservation.plan.bytes, submit.prefill_by)
        ticket = slot.ticket
        queue: asyncio.Queue[object] = asyncio.Queue()
        self._transfers[ticket.transfer_id] = queue
        log.debug("request %s: its KV comes from %s as transfer %s", submit.request_id, submit.prefill_by,
                  ticket.transfer_id)
        sock = self._prefill_sock(submit.prefill_by)
        started = time.monotonic()
        deadline = started + self.transfer_timeout_s
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
            self.counts["bytes_received"] += blob.numel()
            self.counts["full_attention_bytes_received"] += reservation.plan.full_attention_bytes
            self.counts["receive_seconds"] += time.monotonic() - started
            delivered = True
            prefilled = PrefilledKV(reservation.num_tokens, answer.first_token, answer.seed, answer.cached_tokens,
                                    answer.finish_reason, blob, reservation.plan, answer.logprob,
                                    tuple(tuple(p) for p in answer.top_logprobs))  # type: ignore[misc]
            return prefilled, blob, slot
        except TransferError as exc:
            log.warning("the KV transfer from %s failed (%s); prefilling here", submit.prefill_by, exc)
            return None
        except asyncio.CancelledError:
            self.counts["aborted_in_transfer"] += 1
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
                return f"no answer within {self.transfer_timeout_s:.1f} s"
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

    # ----------------------------------------------------------- prefill side
    async def handle(self, identity: bytes, message: object) -> None:
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
            answer = m.PrefillFailed(tid, refusal_status(exc), str(exc))
        except TransferError as exc:
            answer = m.PrefillFailed(tid, 503, str(exc))
        finally:
            self._prefills.pop(tid, None)
        await self._send(identity, answer)

    async def _prefill_and_send(self, request: m.PrefillRequest) -> m.Prefilled:
        if request.incarnation and request.incarnation != self.incarnation:
            raise EngineUnavailable(f"worker {self.worker_id} restarted since this request was routed to it")
        config = self.llm.engine.config
        if (request.page_size, request.swa_mode) != (config.page_size, config.swa_mode):
            raise ValueError(f"KV layouts differ: the decode worker pages by {request.page_size} "
                             f"({request.swa_mode}), this one by {config.page_size} ({config.swa_mode})")
        if request.kv_layout != self.llm.engine.kv_layout:
            raise ValueError(f"KV layouts differ: the decode worker stores {request.kv_layout}, this one "
                             f"{self.llm.engine.kv_layout}")
        params, prompt, spans = await self._prepare(request.sampling, request.prompt_ids, request.spans)
        # The prefill side knows the request by its transfer (the decode worker logs which request that is).
        stream = await self.engine.open_export(prompt, params, spans, request_id=f"transfer-{request.transfer_id}")
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
                                self.transfer_timeout_s)
        self.counts["send_seconds"] += time.monotonic() - started
        self.counts["prefilled_for_others"] += 1
        self.counts["bytes_sent"] += exported.blob.numel()
        return m.Prefilled(request.transfer_id, exported.first_token, exported.seed, exported.cached_tokens,
                           exported.finish_reason, exported.logprob, [tuple(p) for p in exported.top_logprobs],
                           exported.blob.numel())


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

