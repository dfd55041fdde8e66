"""The continuous-batching engine: requests in, token events out.

Each step the scheduler picks chunks (``scheduler.py``), the model runner
computes their logits (``model_runner.py``), the step sampler draws and
verifies tokens (``step_sampler.py``), and the MTP drafter proposes the next
drafts (``speculative.py``). A request is one ``Request`` record
(``request.py``) from ``add_request`` to ``_end``; disaggregation's
handoffs live in ``kv_handoff.py`` and the KV memory in ``engine_kv.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as SequenceOf
from dataclasses import replace
from typing import Any

import torch

from llm_core.cluster.disagg import KVReservation, PrefilledKV, SequenceKVPacker
from llm_core.engine_config import EngineConfig, resolve_speculative_tokens
from llm_core.engine_kv import build_cache, build_kv, fingerprint, memory_stats
from llm_core.model.expert_parallel import ExpertParallelError
from llm_core.sample.grammar import GrammarCompiler, GrammarMatcher
from llm_core.kv.kv_events import KVEventLog
from llm_core.kv_handoff import KVHandoff
from llm_core.kv.kv_pool import SequenceView
from llm_core.model.model import MiMoV2ForCausalLM
from llm_core.model_runner import ModelRunner, compiled
from llm_core.model.multimodal import MultimodalSpan, check_spans, with_cache_tokens
from llm_core.kv.prefix_cache_records import CacheLock, CacheStats
from llm_core.prompts import check_prompt_ids
from llm_core.request import Request, TokenEvent
from llm_core.sample.params import SamplingParams, request_seed
from llm_core.sample.sampling import TokenCounts
from llm_core.sched.schedule_policy import LengthBuckets
from llm_core.sched.scheduler import RequestTooLarge, ScheduledChunk, Scheduler, SchedulerConfig, Sequence
from llm_core.sample.speculative import DraftTarget, MTPDrafter, SpeculativeStats, mtp_layer_forward
from llm_core.step_sampler import NOTHING, Drawn, StepSampler

__all__ = ["Engine", "EngineConfig", "EngineFault", "TokenEvent"]

log = logging.getLogger(__name__)


class EngineFault(RuntimeError):
    """A step failed in a way no request explains (the device is unusable, or the
    engine's own bookkeeping broke): every request in flight is lost and the
    engine must be rebuilt before it serves again."""


class Engine:
    def __init__(self, model: MiMoV2ForCausalLM, config: EngineConfig, device: torch.device,
                 kv_events: KVEventLog | None = None, grammars: GrammarCompiler | None = None) -> None:
        """``kv_events``: the prefix cache and its tiers record there what they
        hold (for a router); a new engine starts a new epoch of it.
        ``grammars``: compiles requests' grammars (structured outputs); without
        it, a request with a grammar is refused."""
        self.model = model
        self.grammars = grammars
        self.config = config
        self.device = device
        mc = model.config
        self.num_speculative = k = resolve_speculative_tokens(config.speculative_tokens, mc.num_mtp_layers)
        self.memory = memory = build_kv(model, config, device, k)
        self.allocator, self.kv, self.block_table = memory.allocator, memory.kv, memory.block_table
        self.window, self.kv_layout = memory.window, memory.layout
        self.kv_events = kv_events
        if kv_events is not None:
            kv_events.reset()
        # Addresses are needed by the tiers and by a router; a digest of the weights costs a gather per tensor.
        addressed = config.enable_prefix_caching and (config.kv_host_bytes > 0 or kv_events is not None)
        self.fingerprint = fingerprint(model, config, memory) if addressed else None
        self.cache, self.tier_io = build_cache(config, memory, device, self.fingerprint, kv_events) \
            if config.enable_prefix_caching else (None, None)
        edges = config.schedule_bucket_edges
        self.scheduler = Scheduler(self.allocator, SchedulerConfig(
            config.max_running_requests, config.max_num_batched_tokens, config.chunked_prefill_size,
            config.schedule_policy,
            tuple(edges) if edges is not None else LengthBuckets.for_context(mc.max_position_embeddings).edges,
            config.prefill_batch_tokens), self.cache)
        self.requests: dict[int, Request] = {}  # every live request, ended in ``_end`` alone
        self.runner = ModelRunner(model, self.kv, self.allocator, self.block_table, self.window, config, device,
                                  self.requests, self.tier_io)
        self._counts = TokenCounts(mc.vocab_size, device)  # requests with penalties
        self.sampler = StepSampler(self.requests, self._counts, grammars, mc.vocab_size, device)
        self.drafter = MTPDrafter(model, self.kv, self.window, k, self.runner.attention_fn,
                                  self.runner.decode_attention_fn, device,
                                  compiled(mtp_layer_forward, device) if config.compile else mtp_layer_forward) \
            if k else None
        self.spec_stats = SpeculativeStats(k)
        self.handoff = KVHandoff(self.allocator, self.cache, SequenceKVPacker(self.kv, self.window, config.swa_mode),
                                 config.max_running_requests, lambda: len(self.scheduler.running))
        self._next_id = 0
        # First tokens of requests prefilled elsewhere: out with the next step.
        self._pending_events: list[TokenEvent] = []

    def close(self, persist: bool = True) -> None:
        """Write what only host memory holds to the disk tier (``persist``), and
        finish the disk writes: a restart over the same directory starts from them."""
        if self.tier_io is not None:
            if persist:
                self.cache.tiers.persist()  # type: ignore[union-attr]
            self.tier_io.close()
            self.tier_io = self.runner.tier_io = None

    # -------------------------------------------------------------- requests
    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """A request that could never fit in the full pool is refused up front."""
        self.memory.check_fits(num_prompt_tokens, max_tokens)

    def add_request(
        self,
        prompt: list[int],
        params: SamplingParams,
        eos_ids: tuple[int, ...] = (),
        mm_spans: SequenceOf[MultimodalSpan] = (),
        export_kv: bool = False,
    ) -> int:
        """Queue a request. Each of ``mm_spans`` replaces the embeddings of its
        prompt positions (the placeholder tokens there are only looked up, never fed).
        ``export_kv``: a prefill worker's request, which ends after its first
        token ("prefilled", unless that token ends it anyway) with its KV
        packed for ``handoff.take_export``."""
        request = self._new_request(prompt, params, eos_ids, mm_spans, request_seed(params),
                                    self.allocator.new_view())
        request.exports_kv = export_kv
        self.scheduler.add(request.seq)
        return request.id

    def _new_request(self, prompt: list[int], params: SamplingParams, eos_ids: tuple[int, ...],
                     mm_spans: SequenceOf[MultimodalSpan], seed: int, view: SequenceView) -> Request:
        check_spans(mm_spans, len(prompt), self.model.config.hidden_size)
        check_prompt_ids(prompt, self.model.config.vocab_size)
        params.check_vocabulary(self.model.config.vocab_size)
        self.check_fits(len(prompt), params.max_tokens)
        matcher = self._grammar_matcher(params)
        spans = self._place_spans(mm_spans)
        request_id = self._next_id
        self._next_id += 1
        if params.penalised:
            self._counts.admit(request_id, prompt)
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else frozenset(eos_ids))
        # Prefix-cache keys see each span's content key, not its placeholder ids.
        cache_prompt = with_cache_tokens(prompt, spans) if spans else list(prompt)
        seq = Sequence(request_id, cache_prompt, params.max_tokens, view, media_ends=tuple(s.end for s in spans))
        request = Request(seq, params, stop_ids, seed, matcher, spans)
        self.requests[request_id] = request
        return request

    def _grammar_matcher(self, params: SamplingParams) -> GrammarMatcher | None:
        if params.grammar is None:
            return None
        if self.grammars is None:
            raise ValueError("structured outputs need the checkpoint's tokenizer.json, which this model lacks")
        return self.grammars.matcher(params.grammar)

    def _place_spans(self, spans: SequenceOf[MultimodalSpan]) -> tuple[MultimodalSpan, ...]:
        """The spans with embeddings on the engine's device and dtype, moved
        once here rather than on every forward that reads them."""
        dtype = self.model.model.embed_tokens.weight.dtype
        return tuple(replace(span, embeddings=span.embeddings.detach().to(device=self.device, dtype=dtype))
                     for span in spans)

    def abort(self, request_id: int) -> bool:
        """Stop a request now and free all its KV. False if it already ended."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        self._end(request, "abort")
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending_events)

    # ------------------------------------------------------ disaggregation
    def reserve_kv(self, num_prompt_tokens: int, max_tokens: int) -> KVReservation | None:
        """Slots for a request prefilled elsewhere (``KVHandoff.reserve``);
        ValueError when the request could never fit."""
        self.check_fits(num_prompt_tokens, max_tokens)
        return self.handoff.reserve(num_prompt_tokens, max_tokens)

    def add_prefilled(self, reservation: KVReservation, prompt: list[int], params: SamplingParams,
                      prefilled: PrefilledKV, eos_ids: tuple[int, ...] = (),
                      mm_spans: SequenceOf[MultimodalSpan] = ()) -> int:
        """Go on with a request from its first token, over KV filled in by
        ``handoff.fill``: nothing is recomputed. Its first token comes out of
        the next ``step``. The reservation is spent (or, on ValueError, still held)."""
        self.handoff.check_filled(reservation, len(prompt), prefilled)
        request = self._new_request(prompt, params, eos_ids, mm_spans, prefilled.seed, reservation.view)
        self.handoff.spend(reservation)
        seq = request.seq
        seq.num_computed = seq.mtp_done = len(prompt)
        seq.cached_tokens = prefilled.cached_tokens
        seq.cache_lock = CacheLock() if self.cache is not None else None
        self.scheduler.adopt(seq)
        try:
            tokens, reason = request.follow_grammar(*request.kept([prefilled.first_token]))
        except ValueError as exc:
            self._pending_events.append(self._fail(request, exc))
            return request.id
        seq.output.extend(tokens)
        if request.id in self._counts:
            self._counts.add({request.id: tokens})
        self._pending_events.append(TokenEvent(request.id, prefilled.first_token, reason,
                                               logprob=prefilled.logprob, top_logprobs=prefilled.top_logprobs,
                                               cached_tokens=prefilled.cached_tokens))
        if reason is not None:
            self._end(request, reason)
        return request.id

    # ------------------------------------------------------------------ step
    def step(self) -> list[TokenEvent]:
        """One forward over the scheduled batch and a token for every chunk that ends
        its known tokens.

        A failure that belongs to some requests -- a media span that cannot be
        read, a row that cannot be sampled -- ends only those, each with an
        "error" event: the batch is split in halves until the failing chunks are
        found, and every other request gets the tokens it would have got anyway
        (greedy output does not depend on batch composition). Anything else
        raises EngineFault.
        """
        events, self._pending_events = self._pending_events, []
        try:
            chunks = self.scheduler.schedule()
        except RequestTooLarge as exc:
            return [*events, self._fail(self.requests[exc.seq.request_id], exc)]
        if not chunks:
            self.runner.finish_restores()
            if self.tier_io is not None and self.scheduler.loading():
                self.tier_io.wait_prefetch(0.01)  # nothing else to run: wait for the disk, not spin
            return events
        return events + self._run(chunks)

    def _run(self, chunks: list[ScheduledChunk]) -> list[TokenEvent]:
        sampled = [c for c in chunks if c.samples]
        try:
            logits = self.runner.logits(chunks)
        except Exception as exc:  # noqa: BLE001 - narrowed to the failing requests below
            return self._isolate(chunks, exc)
        # Only now does the step count: a failed forward left every chunk as it was
        # (its KV slots are simply written again by the retry).
        drawn = self.sampler.draw(sampled, logits) if logits is not None else {}
        events: list[TokenEvent] = []
        kept: list[ScheduledChunk] = []
        ending: list[tuple[Request, str]] = []
        counted: dict[int, list[int]] = {}
        for chunk in chunks:
            request = self.requests[chunk.seq.request_id]
            result = drawn.get(request.id, NOTHING)
            if isinstance(result, Exception):
                events.append(self._fail(request, result))
                continue
            if chunk.drafts:
                self.spec_stats.record(chunk.drafts, len(result.tokens) - 1)
            try:
                tokens, reason = request.follow_grammar(*request.kept(result.tokens))
            except ValueError as exc:
                events.append(self._fail(request, exc))
                continue
            exporting = request.exports_kv and bool(tokens)
            if exporting and reason is None:
                reason = "prefilled"  # the decode worker goes on from here
            # Nothing acts on a draft before this: rejected ones leave both pools here.
            self.scheduler.commit(chunk, max(0, len(tokens) - 1))
            request.drafts = None
            first = not request.seq.output
            request.seq.output.extend(tokens)
            if request.id in self._counts:
                counted[request.id] = tokens
            events += _token_events(request.seq, tokens, reason, result, first)
            if exporting:
                request.first_event = events[-1]
            kept.append(chunk)
            if reason is not None:
                ending.append((request, reason))
        self._counts.add(counted)
        if self.drafter is not None and kept:
            decoding = {c.seq.request_id for c in sampled} - {request.id for request, _ in ending}
            self._draft(kept, decoding)
        self.scheduler.after_step(kept)
        for request, reason in ending:
            if request.exports_kv:
                self.handoff.export(request, reason)
            self._end(request, reason)
        return events

    def _draft(self, chunks: list[ScheduledChunk], decoding: set[int]) -> None:
        """The MTP pass: every chunk's MTP rows brought up to its computed tokens,
        and drafts for the requests (ids in ``decoding``) that go on decoding."""
        assert self.drafter is not None
        targets, drafting = [], []
        for chunk in chunks:
            request = self.requests[chunk.seq.request_id]
            room = request.seq.max_tokens - len(request.seq.output) - 1  # drafts past max_tokens are never kept
            drafts = request.id in decoding and room > 0
            targets.append(DraftTarget(request.seq, request.sampling_row() if drafts else None, request.spans))
            if drafts:
                drafting.append(request)
        masker = self.sampler.draft_masker(drafting)
        try:
            result = self.drafter.run(targets, masker)
        except Exception as exc:  # noqa: BLE001 - drafts only speed decoding up: go on without them
            if self._device_lost():
                raise EngineFault(f"the {self.device} device failed: {type(exc).__name__}: {exc}") from exc
            log.exception("the MTP draft pass failed; these requests go on without drafts")
            return
        finally:
            if masker is not None:
                masker.rollback()
        if result is None:
            return
        sampled = result.plan.sampled_rows.tolist() if result.plan.sampled_rows is not None else []
        probs_row = {row: i for i, row in enumerate(sampled)}
        for i, request in enumerate(drafting):
            probs = result.probs[probs_row[i]] if result.probs is not None and i in probs_row else None
            request.drafts = (result.tokens[i], probs)
            request.seq.num_drafts = min(self.num_speculative, request.seq.max_tokens - len(request.seq.output) - 1)

    def _isolate(self, chunks: list[ScheduledChunk], exc: Exception) -> list[TokenEvent]:
        # A lost expert-parallel rank fails every forward: no request explains it.
        if isinstance(exc, ExpertParallelError) or self._device_lost():
            raise EngineFault(f"the {self.device} device failed: {type(exc).__name__}: {exc}") from exc
        if len(chunks) == 1:
            return [self._fail(self.requests[chunks[0].seq.request_id], exc)]
        mid = len(chunks) // 2
        return self._run(chunks[:mid]) + self._run(chunks[mid:])

    def _device_lost(self) -> bool:
        """After a CUDA error the context may be unusable; a CPU cannot be lost."""
        if self.device.type != "cuda":
            return False
        try:
            torch.cuda.synchronize(self.device)
            torch.ones(1, device=self.device).add_(1).cpu()
        except Exception:  # noqa: BLE001 - any failure here means the device is gone
            return True
        return False

    def _fail(self, request: Request, exc: Exception) -> TokenEvent:
        log.error("request %d failed", request.id, exc_info=exc)
        self._end(request, "error")
        return TokenEvent(request.id, -1, "error", error=f"{type(exc).__name__}: {exc}")

    def _end(self, request: Request, reason: str) -> None:
        """Where every request ends (finished, aborted or failed): its KV, its
        block-table row and its token counts go, and so does its record."""
        self.scheduler.finish(request.seq, reason)
        self.block_table.release(request.id)
        self._counts.release(request.id)
        del self.requests[request.id]

    # ----------------------------------------------------------------- stats
    def reset_stats(self) -> None:
        """Counters from now on (a warm-up's requests are not the server's)."""
        self.spec_stats = SpeculativeStats(self.num_speculative)
        self.scheduler.reset_stats()
        if self.cache is not None:
            self.cache.stats = CacheStats()

    def flush_cache(self) -> None:
        """Drop every cached prefix no running request holds."""
        if self.cache is not None:
            self.cache.flush()

    def stats(self) -> dict[str, Any]:
        scheduler = self.scheduler
        return memory_stats(self.config, self.memory, self.cache, self.tier_io) | {
            "running_requests": len(scheduler.running),
            "waiting_requests": len(scheduler.waiting),
            "queued_prompt_tokens": scheduler.queued_tokens(),
            "preemptions": scheduler.num_preemptions,
            "schedule": scheduler.latency_stats(),
            "speculative": self.spec_stats.as_dict(),
        }


def _token_events(seq: Sequence, tokens: list[int], reason: str | None, drawn: Drawn,
                  first: bool) -> list[TokenEvent]:
    last = len(tokens) - 1
    return [
        TokenEvent(seq.request_id, t, reason if i == last else None,
                   logprob=drawn.logprobs[i] if drawn.logprobs is not None else None,
                   top_logprobs=drawn.top[i] if drawn.top is not None else (),
                   cached_tokens=seq.cached_tokens if first and i == 0 else None)
        for i, t in enumerate(tokens)
    ]
