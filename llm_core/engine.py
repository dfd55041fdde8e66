"""The continuous-batching engine: scheduler + KV pools + model + sampler."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence as SequenceOf
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

import numpy as np
import torch

from llm_core.block_table import BlockTable
from llm_core.cuda_graphs import DecodeGraphs, graph_batch_sizes
from llm_core.device import column, to_device
from llm_core.expert_parallel import ExpertParallelError
from llm_core.fp8 import FP8_DTYPE
from llm_core.disagg import KVReservation, PrefilledKV, SequenceKVPacker
from llm_core.kv_pool import FullKVPool, KVAllocator, PoolSizing, SequenceView, SWAKVPool, SWAMode
from llm_core.model import MiMoV2ForCausalLM
from llm_core.multimodal import MultimodalSpan, check_spans, with_cache_tokens
from llm_core.attention_backends import DecodeAttentionBackend, PagedAttentionBackend
from llm_core.paged_attention import (
    AttentionFn,
    DecodeAttentionFn,
    DecodeBatch,
    KVCacheTensors,
    PagedBatch,
    paged_attention_torch,
    paged_decode_attention_torch,
)
from llm_core.kv_events import KVEventLog
from llm_core.kv_store import DiskKVStore, HostKVPool
from llm_core.kv_tiers import KVTiers, TierConfig
from llm_core.page_address import model_fingerprint
from llm_core.schedule_policy import LengthBuckets
from llm_core.kv_transfer import RESTORE_BUCKETS, EngineTierIO, model_weights_digest
from llm_core.prefix_cache import CacheLock, CacheStats, RadixCache
from llm_core.grammar import GrammarCompiler, GrammarMatcher
from llm_core.sampling import (
    SamplingParams,
    SamplingPlan,
    SamplingRow,
    TokenCounts,
    apply_penalties,
    apply_token_mask,
    request_seed,
    sample_tokens,
    token_logprobs,
    verify_drafts,
)
from llm_core.scheduler import RequestTooLarge, ScheduledChunk, Scheduler, SchedulerConfig, Sequence
from llm_core.speculative import DraftTarget, MTPDrafter, SpeculativeStats, mtp_layer_forward

AttentionImpl = Literal["auto", "torch", "triton"]
KVCacheDtype = Literal["auto", "bf16", "fp8_e4m3"]
KV_CACHE_DTYPES = ("auto", "bf16", "fp8_e4m3")
DecodeForwardFn = Callable[[MiMoV2ForCausalLM, torch.Tensor, torch.Tensor, DecodeAttentionBackend], torch.Tensor]

log = logging.getLogger(__name__)
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class EngineConfig:
    kv_budget_bytes: int = 256 << 20
    page_size: int = 16
    swa_mode: SWAMode = "hybrid"
    max_running_requests: int = 64
    max_num_batched_tokens: int = 4096
    chunked_prefill_size: int = 1024
    attention: AttentionImpl = "auto"
    enable_prefix_caching: bool = True
    # Extra SWA checkpoints every N tokens (besides prompt ends and finished
    # requests), so a prompt diverging mid-way falls back at most this far.
    checkpoint_interval: int | None = 4096
    # torch.compile(fullgraph=True) the decode forward (one graph, dynamic
    # batch and context sizes; the first steps pay for compiling it).
    compile: bool = False
    # On CUDA with the Triton kernels: replay decode steps of up to this many
    # requests from CUDA graphs captured at start-up for padded batch sizes
    # (0: never; None: up to max_running_requests).
    cuda_graph_max_batch: int | None = None
    # MTP speculative decoding: draft tokens verified per step (None: one per
    # MTP layer the checkpoint has; 0: off). More than the layers reuses the last.
    speculative_tokens: int | None = None
    # KV tiers under the device pools (prefix caching on): host memory, and
    # files under kv_disk_dir (which outlive the process: a restart over the
    # same directory restores earlier prefixes). 0: no such tier.
    kv_host_bytes: int = 0
    kv_disk_bytes: int = 0
    kv_disk_dir: str | None = None
    # Restores from host memory copied layer by layer beside the forward
    # (attention at layer i waits for layer i's pages only); None: on CUDA,
    # where copies and compute do not share the same cores.
    kv_restore_layerwise: bool | None = None
    # Admission order and preemption victims: "compute-aware" (fewest tokens
    # left to compute after the cache hit, with aging), "fcfs" or "lpm".
    schedule_policy: str = "compute-aware"
    # Prompt-length bucket edges sharing each step's prefill budget; None:
    # 64K and 256K of a 1M context, scaled to the model's context length.
    schedule_bucket_edges: tuple[int, ...] | None = None
    # See SchedulerConfig.prefill_batch_tokens (None: admission limited by the budget alone).
    prefill_batch_tokens: int | None = None
    # What both KV pools store: the model's dtype ("auto"), bfloat16, or
    # float8_e4m3fn with per-layer scales (the checkpoint's, else 1.0).
    kv_cache_dtype: KVCacheDtype = "auto"

    def __post_init__(self) -> None:
        if self.swa_mode not in ("hybrid", "full"):
            raise ValueError(f"swa_mode must be 'hybrid' or 'full', got {self.swa_mode!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.attention not in ("auto", "torch", "triton"):
            raise ValueError(f"attention must be 'auto', 'torch' or 'triton', got {self.attention!r}")
        if self.cuda_graph_max_batch is not None and self.cuda_graph_max_batch < 0:
            raise ValueError(f"cuda_graph_max_batch must be >= 0, got {self.cuda_graph_max_batch}")
        if self.speculative_tokens is not None and not 0 <= self.speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_tokens must be from 0 to {MAX_SPECULATIVE_TOKENS}, "
                             f"got {self.speculative_tokens}")
        if self.kv_host_bytes < 0 or self.kv_disk_bytes < 0:
            raise ValueError("kv_host_bytes and kv_disk_bytes must be >= 0")
        if self.kv_disk_bytes and not self.kv_disk_dir:
            raise ValueError("a disk KV tier (kv_disk_bytes) needs kv_disk_dir")
        if self.kv_disk_bytes and not self.kv_host_bytes:
            raise ValueError("a disk KV tier needs a host KV tier too (kv_host_bytes): disk writes go through it")


@dataclass(frozen=True)
class TokenEvent:
    request_id: int
    token: int  # -1 on an "error" event
    finish_reason: str | None  # set on the request's last event: "stop", "length" or "error"
    error: str | None = None  # why the request failed, with finish_reason "error"
    # With SamplingParams.logprobs: the token's log-probability under the model
    # (log-softmax of the raw logits) and the most likely (token, logprob) pairs.
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    cached_tokens: int | None = None  # on a request's first event: prompt tokens the prefix cache served


class EngineFault(RuntimeError):
    """A step failed in a way no request explains (the device is unusable, or the
    engine's own bookkeeping broke): every request in flight is lost and the
    engine must be rebuilt before it serves again."""


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    backend: PagedAttentionBackend | DecodeAttentionBackend
    inputs_embeds: torch.Tensor | None


@dataclass(frozen=True)
class _Sampling:
    params: SamplingParams
    stop_ids: frozenset[int]
    seed: int


@dataclass(frozen=True)
class _Drawn:
    """A request's tokens from one step, with their log-probabilities when it asked."""

    tokens: list[int]
    logprobs: list[float] | None = None
    top: list[tuple[tuple[int, float], ...]] | None = None


_NOTHING = _Drawn([])


@dataclass(frozen=True)
class _GrammarMasks:
    bits: np.ndarray  # [requests * width, words] int32
    drafts: list[int]  # each request's drafts its grammar takes


class _DraftMasker:
    """Grammar masks for the MTP pass, depth by depth: each constrained row's
    grammar takes the row's earlier drafts (tentatively: ``rollback`` undoes
    them), and the next depth's logits are masked to what it allows then. A
    row whose draft ends the output, or that the grammar leaves, drafts freely
    from there (verification refuses those drafts anyway)."""

    def __init__(self, rows: list[tuple[int, GrammarMatcher]], words: int, ends: frozenset[int]) -> None:
        self.rows = rows  # (index among the drafting rows, its grammar)
        self.ends = ends
        self.bits = np.full((len(rows), words), -1, dtype=np.int32)
        self.taken = [0] * len(rows)
        self.alive = [True] * len(rows)
        self._index = torch.tensor([k for k, _ in rows])

    def __call__(self, depth: int, logits: torch.Tensor, drafts: list[torch.Tensor]) -> torch.Tensor:
        previous = drafts[-1][self._index.to(drafts[-1].device)].tolist() if depth else None
        for r, (_, matcher) in enumerate(self.rows):
            row = self.bits[r]
            if previous is not None and self.alive[r]:
                _, taken = matcher.take_draft(row, previous[r], self.ends)
                self.taken[r] += taken
                self.alive[r] = taken and not matcher.stopped
            if self.alive[r]:
                matcher.fill_mask(row)
                if not row.any():
                    self.alive[r] = False
            if not self.alive[r]:
                row.fill(-1)
        return apply_token_mask(logits, self._index.to(logits.device), self.bits)

    def rollback(self) -> None:
        for (_, matcher), taken in zip(self.rows, self.taken):
            matcher.rollback(taken)
        self.taken = [0] * len(self.rows)


def page_slots(pages: list[int], base_page: int, page_size: int, start: int, end: int) -> torch.Tensor:
    """Slots of positions [start, end) given the physical pages of logical
    pages base_page, base_page + 1, ... (vectorised: sequences are long)."""
    first_page = start // page_size
    used = torch.tensor(pages[first_page - base_page : -(-end // page_size) - base_page], dtype=torch.int64)
    slots = (used[:, None] * page_size + torch.arange(page_size)).flatten()
    offset = start - first_page * page_size
    return slots[offset : offset + end - start]


def _sample_rows(chunks: list[ScheduledChunk]) -> list[int]:
    """Batch rows whose hidden state gives a next token: each sampling chunk's
    last known token and its drafts."""
    rows, offset = [], 0
    for chunk in chunks:
        if chunk.samples:
            rows.extend(range(offset + chunk.length - 1, offset + chunk.rows))
        offset += chunk.rows
    return rows


def resolve_speculative_tokens(requested: int | None, num_mtp_layers: int) -> int:
    """Drafts per step: as asked, or one per MTP layer the checkpoint has."""
    if requested is None:
        return num_mtp_layers
    if requested and not num_mtp_layers:
        raise ValueError(f"speculative_tokens={requested} needs MTP layers, and this checkpoint has none")
    return requested


def resolve_kv_dtype(kv_cache_dtype: KVCacheDtype, model_dtype: torch.dtype) -> torch.dtype:
    return {"auto": model_dtype, "bf16": torch.bfloat16, "fp8_e4m3": FP8_DTYPE}[kv_cache_dtype]


def kv_cache_scales(model: MiMoV2ForCausalLM) -> dict[int, tuple[float, float]]:
    """(k_scale, v_scale) of every layer with KV, main and MTP, by KV layer index."""
    mc = model.config
    attentions = [layer.self_attn for layer in model.model.layers]
    if mc.num_mtp_layers:
        attentions += [layer.self_attn for layer in model.model.mtp.layers]
    # A model on the meta device (capacity math) has no values: the pools take 1.0.
    return {a.layer_idx: (float(a.k_scale), float(a.v_scale)) for a in attentions if not a.k_scale.is_meta}


def uses_triton(impl: AttentionImpl, device: torch.device) -> bool:
    return impl == "triton" or (impl == "auto" and device.type == "cuda")


def resolve_attention(impl: AttentionImpl, device: torch.device) -> AttentionFn:
    if uses_triton(impl, device):
        from llm_core.triton_attention import paged_attention_triton

        return paged_attention_triton
    if impl == "auto" and device.type == "cpu":
        from llm_core import cpu_kernels

        if cpu_kernels.available():
            return cpu_kernels.paged_attention_cpu
    return paged_attention_torch


def resolve_decode_attention(impl: AttentionImpl, device: torch.device) -> DecodeAttentionFn:
    if uses_triton(impl, device):
        from llm_core.triton_attention import paged_decode_attention_triton

        return paged_decode_attention_triton
    if impl == "auto" and device.type == "cpu":
        from llm_core import cpu_kernels

        if cpu_kernels.available():
            return cpu_kernels.paged_decode_attention_cpu
    return paged_decode_attention_torch


def decode_logits(model: MiMoV2ForCausalLM, input_ids: torch.Tensor, positions: torch.Tensor,
                  backend: DecodeAttentionBackend) -> torch.Tensor:
    """The decode forward, logits included: what is compiled and captured."""
    hidden = model(input_ids, positions, backend)
    backend.store_hidden(hidden)
    return model.compute_logits(hidden)


def extend_hidden(model: MiMoV2ForCausalLM, input_ids: torch.Tensor, positions: torch.Tensor,
                  backend: PagedAttentionBackend, inputs_embeds: torch.Tensor | None) -> torch.Tensor:
    """The forward of a step with prefill chunks: final hidden states."""
    hidden = model(input_ids, positions, backend, inputs_embeds=inputs_embeds)
    backend.store_hidden(hidden)
    return hidden


def compiled(fn: Callable[..., torch.Tensor], backend: str = "inductor") -> Callable[..., torch.Tensor]:
    """``fn`` under torch.compile(fullgraph=True) with dynamic shapes: one graph
    for every batch size and context (sizes 0 and 1 aside, which torch specialises)."""
    graph = torch.compile(fn, fullgraph=True, dynamic=True, backend=backend)

    def run(*args: Any) -> torch.Tensor:
        # Without duck sizing, two sizes that happen to be equal when a graph is
        # traced (batch and page count, say) are not assumed equal forever,
        # which would recompile it when they part.
        # One graph per MTP layer module as well: more than dynamo's default of 8.
        # Float attributes (norm eps, scales) are constants of the graph: each
        # would otherwise be a symbolic input guarded in Python at every call.
        with torch.fx.experimental._config.patch(use_duck_shape=False), \
                torch._dynamo.config.patch(recompile_limit=64, specialize_float=True):
            return graph(*args)

    return run


def compiled_decode_logits(backend: str = "inductor") -> DecodeForwardFn:
    return compiled(decode_logits, backend)


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
        dtype = model.lm_head.weight.dtype
        self.num_speculative = resolve_speculative_tokens(config.speculative_tokens, mc.num_mtp_layers)
        k = self.num_speculative
        # Without speculation the MTP layers are never run: no KV for them.
        kv_layout = {"mtp_layers": mc.num_mtp_layers if k else 0, "draft_depths": min(k, mc.num_mtp_layers),
                     "kv_dtype": resolve_kv_dtype(config.kv_cache_dtype, dtype), "kv_scales": kv_cache_scales(model)}
        probe = KVCacheTensors(mc, 0, 0, dtype, "meta", **kv_layout)
        self.window = mc.sliding_attention.sliding_window or 1
        sizing = PoolSizing.from_budget(
            config.kv_budget_bytes,
            probe.full_bytes_per_token,
            probe.swa_bytes_per_token,
            # Windows are kept from a page boundary: up to a page more per
            # request, and the drafts of a verify step.
            self.window + config.page_size - 1 + k,
            config.page_size,
            config.max_running_requests,
            config.max_num_batched_tokens,
            config.swa_mode,
        )
        self.allocator = KVAllocator(
            FullKVPool(sizing.full_tokens // config.page_size, config.page_size),
            SWAKVPool(sizing.swa_tokens, 1),
            self.window,
            config.swa_mode,
        )
        self.kv = KVCacheTensors(mc, self.allocator.full.capacity, self.allocator.swa.capacity, dtype, device,
                                 config.page_size, **kv_layout, draft_slots=k * config.max_running_requests)
        # What KV written here needs another engine to share to read it (PD
        # transfers and tier addresses check it): the KV dtype and FP8 scales.
        scales = sorted(self.kv.scale_values().items())
        self.kv_layout = f"kv={self.kv.kv_dtype}" + (f";scales={scales}" if scales else "")
        longest = min(mc.max_position_embeddings, self.allocator.full.capacity)
        self.block_table = BlockTable(-(-longest // config.page_size), device, config.max_running_requests)
        self.tier_io: EngineTierIO | None = None
        self.kv_events = kv_events
        if kv_events is not None:
            kv_events.reset()
        # Addresses are needed by the tiers and by a router; a digest of the weights costs a gather per tensor.
        addressed = config.enable_prefix_caching and (config.kv_host_bytes > 0 or kv_events is not None)
        self.fingerprint = self._fingerprint(dtype) if addressed else None
        self.cache = self._build_cache() if config.enable_prefix_caching else None
        self.scheduler = Scheduler(
            self.allocator,
            SchedulerConfig(config.max_running_requests, config.max_num_batched_tokens, config.chunked_prefill_size,
                            config.schedule_policy, self._bucket_edges(config, mc.max_position_embeddings),
                            config.prefill_batch_tokens),
            self.cache,
        )
        self.attention_fn = resolve_attention(config.attention, device)
        self.decode_attention_fn = resolve_decode_attention(config.attention, device)
        self._decode_logits = compiled_decode_logits() if config.compile else decode_logits
        self._extend_hidden = compiled(extend_hidden) if config.compile else extend_hidden
        self.graphs = self._capture_graphs()
        self.drafter = MTPDrafter(model, self.kv, self.window, k, self.attention_fn, self.decode_attention_fn, device,
                                  compiled(mtp_layer_forward) if config.compile else mtp_layer_forward) \
            if k else None
        self.spec_stats = SpeculativeStats(k)
        # Drafts waiting for the next step's verification: tokens [k] and, for
        # requests that sample, the distributions they were drawn from [k, vocab].
        self._drafts: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._sampling: dict[int, _Sampling] = {}
        self._sequences: dict[int, Sequence] = {}
        self._matchers: dict[int, GrammarMatcher] = {}  # requests with a grammar
        self._counts = TokenCounts(mc.vocab_size, device)  # requests with penalties
        # Multimodal spans of running requests only (embeddings already on the
        # engine's device and dtype); requests without spans have no entry.
        self._spans: dict[int, tuple[MultimodalSpan, ...]] = {}
        self._next_id = 0
        # Disaggregation: requests that stop after their first token and hand
        # their KV over (prefill side); slots held for KV on its way, and the
        # first tokens of requests prefilled elsewhere, out with the next step (decode side).
        self.kv_packer = SequenceKVPacker(self.kv, self.window, config.swa_mode)
        self._export_ids: set[int] = set()
        self._first_events: dict[int, TokenEvent] = {}
        self._exports: dict[int, PrefilledKV] = {}
        self._reservations: dict[int, KVReservation] = {}
        self._next_reservation = 0
        self._pending_events: list[TokenEvent] = []

    def _fingerprint(self, dtype: torch.dtype) -> bytes:
        """The root of the page address chain: pages are comparable only for
        the same weights, KV layout, dtypes and FP8 scales."""
        return model_fingerprint(json.dumps(asdict(self.model.config), sort_keys=True, default=str),
                                 model_weights_digest(self.model), str(dtype), str(self.config.page_size),
                                 f"mtp={self.kv.draft_depths}", str(sorted(self.kv.shapes.items())),
                                 self.kv_layout)

    def _build_cache(self) -> RadixCache:
        """The radix cache, with host and disk tiers under it when configured."""
        config = self.config
        events = self.kv_events
        if not config.kv_host_bytes:
            return RadixCache(self.allocator, config.checkpoint_interval, fingerprint=self.fingerprint,
                              events=events)
        largest = config.page_size * (self.kv.full_bytes_per_token + self.kv.swa_bytes_per_token)
        if config.kv_host_bytes < largest:
            raise ValueError(f"kv_host_bytes={config.kv_host_bytes} cannot hold one page of full and SWA KV "
                             f"({largest} bytes)")
        fingerprint = self.fingerprint
        assert fingerprint is not None
        tier_config = TierConfig(config.kv_host_bytes, config.kv_disk_bytes,
                                 config.page_size * self.kv.full_bytes_per_token, self.kv.swa_bytes_per_token)
        host = HostKVPool(config.kv_host_bytes, pin_memory=self.device.type == "cuda")
        # The tiers' bookkeeping holds the budget; the store's own limit only
        # leaves room for file headers.
        disk = DiskKVStore(config.kv_disk_dir, 2 * config.kv_disk_bytes + (1 << 20), fingerprint) \
            if config.kv_disk_bytes else None
        self.tier_io = EngineTierIO(self.kv, host, disk, layerwise_restore=config.kv_restore_layerwise)
        tiers = KVTiers(tier_config, self.tier_io, events.record_tier_key if events is not None else None)
        if disk is not None:
            tiers.adopt_disk_entries((key, entry.tokens) for key, entry in disk.entries())
        return RadixCache(self.allocator, config.checkpoint_interval, tiers=tiers, fingerprint=fingerprint,
                          events=events)

    def close(self, persist: bool = True) -> None:
        """Write what only host memory holds to the disk tier (``persist``), and
        finish the disk writes: a restart over the same directory starts from them."""
        if self.tier_io is not None:
            if persist:
                self.cache.tiers.persist()  # type: ignore[union-attr]
            self.tier_io.close()
            self.tier_io = None

    # -------------------------------------------------------------- requests
    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """A request that could never fit in the full pool is refused up front."""
        if num_prompt_tokens + max_tokens > self.allocator.full.capacity:
            raise ValueError(
                f"prompt of {num_prompt_tokens} tokens plus max_tokens={max_tokens} needs more KV "
                f"memory than the pool holds ({self.allocator.full.capacity} tokens)"
            )
        longest = self.block_table.width * self.allocator.full.page_size
        if num_prompt_tokens + max_tokens > longest:
            raise ValueError(
                f"prompt of {num_prompt_tokens} tokens plus max_tokens={max_tokens} is longer than "
                f"a sequence may be ({longest} tokens)"
            )

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
        packed for ``take_export``."""
        seq = self._new_sequence(prompt, params, eos_ids, mm_spans, request_seed(params), self.allocator.new_view())
        if export_kv:
            self._export_ids.add(seq.request_id)
        self.scheduler.add(seq)
        return seq.request_id

    def _new_sequence(self, prompt: list[int], params: SamplingParams, eos_ids: tuple[int, ...],
                      mm_spans: SequenceOf[MultimodalSpan], seed: int, view: SequenceView) -> Sequence:
        check_spans(mm_spans, len(prompt), self.model.config.hidden_size)
        params.check_vocabulary(self.model.config.vocab_size)
        self.check_fits(len(prompt), params.max_tokens)
        matcher = self._grammar_matcher(params)
        spans = self._place_spans(mm_spans)
        request_id = self._next_id
        self._next_id += 1
        if matcher is not None:
            self._matchers[request_id] = matcher
        if params.penalised:
            self._counts.admit(request_id, prompt)
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
        self._sampling[request_id] = _Sampling(params, frozenset(stop_ids), seed)
        # Prefix-cache keys see each span's content key, not its placeholder ids.
        cache_prompt = with_cache_tokens(prompt, spans) if spans else list(prompt)
        seq = Sequence(request_id, cache_prompt, params.max_tokens, view,
                       media_ends=tuple(span.end for span in spans))
        self._sequences[request_id] = seq
        if spans:
            self._spans[request_id] = spans
        return seq

    # ------------------------------------------------------ disaggregation
    def take_export(self, request_id: int) -> PrefilledKV | None:
        """The packed KV of a prefilled ``export_kv`` request (once)."""
        return self._exports.pop(request_id, None)

    def reserve_kv(self, num_prompt_tokens: int, max_tokens: int) -> KVReservation | None:
        """Hold the slots of a request prefilled elsewhere before its KV is
        sent: full pages for the prompt, SWA slots for its live window (cached
        prefixes are evicted to make room). None when the pools or the running
        limit have no room now; ValueError when the request could never fit."""
        self.check_fits(num_prompt_tokens, max_tokens)
        if len(self.scheduler.running) + len(self._reservations) >= self.config.max_running_requests:
            return None
        if not self.allocator.can_reserve(num_prompt_tokens) and self.cache is not None:
            self.cache.make_room(*self.allocator.reserve_needs(num_prompt_tokens))
        if not self.allocator.can_reserve(num_prompt_tokens):
            return None
        view = self.allocator.new_view()
        self.allocator.reserve(view, num_prompt_tokens)
        reservation = KVReservation(self._next_reservation, view, num_prompt_tokens, max_tokens,
                                    self.kv_packer.plan(num_prompt_tokens))
        self._next_reservation += 1
        self._reservations[reservation.reservation_id] = reservation
        return reservation

    def fill_reservation(self, reservation: KVReservation, blob: torch.Tensor) -> None:
        """Write a received transfer into the reserved slots (ValueError if it does not fit them)."""
        if self._reservations.get(reservation.reservation_id) is not reservation:
            raise ValueError("that reservation was cancelled or used")
        self.kv_packer.unpack(blob, reservation.view, reservation.num_tokens)
        reservation.filled = True

    def cancel_reservation(self, reservation: KVReservation) -> bool:
        """Give the reserved slots back (a transfer failed, or its request was aborted)."""
        if self._reservations.pop(reservation.reservation_id, None) is None:
            return False
        self.allocator.free(reservation.view)
        return True

    def add_prefilled(self, reservation: KVReservation, prompt: list[int], params: SamplingParams,
                      prefilled: PrefilledKV, eos_ids: tuple[int, ...] = (),
                      mm_spans: SequenceOf[MultimodalSpan] = ()) -> int:
        """Go on with a request from its first token, over KV filled in by
        ``fill_reservation``: nothing is recomputed. Its first token comes out
        of the next ``step``. The reservation is spent (or, on ValueError, still held)."""
        if self._reservations.get(reservation.reservation_id) is not reservation or not reservation.filled:
            raise ValueError("the reservation holds no received KV")
        if len(prompt) != reservation.num_tokens or prefilled.num_tokens != reservation.num_tokens:
            raise ValueError(f"the reservation holds {reservation.num_tokens} tokens, the prompt has {len(prompt)}")
        seq = self._new_sequence(prompt, params, eos_ids, mm_spans, prefilled.seed, reservation.view)
        del self._reservations[reservation.reservation_id]
        seq.num_computed = seq.mtp_done = len(prompt)
        seq.cached_tokens = prefilled.cached_tokens
        seq.cache_lock = CacheLock() if self.cache is not None else None
        self.scheduler.adopt(seq)
        tokens, reason = self._keep(seq, [prefilled.first_token])
        try:
            tokens, reason = self._follow_grammar(seq.request_id, tokens, reason)
        except ValueError as exc:
            self._pending_events.append(self._fail(seq, exc))
            return seq.request_id
        seq.output.extend(tokens)
        if seq.request_id in self._counts:
            self._counts.add({seq.request_id: tokens})
        self._pending_events.append(TokenEvent(seq.request_id, prefilled.first_token, reason,
                                               logprob=prefilled.logprob, top_logprobs=prefilled.top_logprobs,
                                               cached_tokens=prefilled.cached_tokens))
        if reason is not None:
            self._end(seq, reason)
        return seq.request_id

    def _export(self, seq: Sequence, reason: str) -> None:
        """Pack a prefilled request's KV, before its end hands it to the cache."""
        first = self._first_events.pop(seq.request_id)
        blob, plan = self.kv_packer.pack(seq.view, len(seq.prompt))
        self._exports[seq.request_id] = PrefilledKV(
            len(seq.prompt), first.token, self._sampling[seq.request_id].seed, seq.cached_tokens or 0,
            None if reason == "prefilled" else reason, blob, plan, first.logprob, first.top_logprobs)

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
        return tuple(
            replace(span, embeddings=span.embeddings.detach().to(device=self.device, dtype=dtype))
            for span in spans
        )

    def abort(self, request_id: int) -> bool:
        """Stop a request now and free all its KV. False if it already ended."""
        seq = self._sequences.get(request_id)
        if seq is None:
            return False
        self._end(seq, "abort")
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending_events)

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
            return [*events, self._fail(exc.seq, exc)]
        if not chunks:
            self._finish_restores()
            if self.tier_io is not None and self.scheduler.loading():
                self.tier_io.wait_prefetch(0.01)  # nothing else to run: wait for the disk, not spin
            return events
        return events + self._run(chunks)

    def _run(self, chunks: list[ScheduledChunk]) -> list[TokenEvent]:
        sampled = [c for c in chunks if c.samples]
        try:
            logits = self._logits(chunks)
        except Exception as exc:  # noqa: BLE001 - narrowed to the failing requests below
            return self._isolate(chunks, exc)
        # Only now does the step count: a failed forward left every chunk as it was
        # (its KV slots are simply written again by the retry).
        drawn = self._draw(sampled, logits) if logits is not None else {}
        events: list[TokenEvent] = []
        kept: list[ScheduledChunk] = []
        ending: list[tuple[Sequence, str]] = []
        counted: dict[int, list[int]] = {}
        for chunk in chunks:
            seq = chunk.seq
            result = drawn.get(seq.request_id, _NOTHING)
            if isinstance(result, Exception):
                events.append(self._fail(seq, result))
                continue
            tokens, reason = self._keep(seq, result.tokens)
            try:
                tokens, reason = self._follow_grammar(seq.request_id, tokens, reason)
            except ValueError as exc:
                events.append(self._fail(seq, exc))
                continue
            exporting = seq.request_id in self._export_ids and bool(tokens)
            if exporting and reason is None:
                reason = "prefilled"  # the decode worker goes on from here
            # Nothing acts on a draft before this: rejected ones leave both pools here.
            self.scheduler.commit(chunk, max(0, len(tokens) - 1))
            self._drafts.pop(seq.request_id, None)
            first = not seq.output
            seq.output.extend(tokens)
            if seq.request_id in self._counts:
                counted[seq.request_id] = tokens
            events += self._token_events(seq, tokens, reason, result, first)
            if exporting:
                self._first_events[seq.request_id] = events[-1]
            kept.append(chunk)
            if reason is not None:
                ending.append((seq, reason))
        self._counts.add(counted)
        if self.drafter is not None and kept:
            decoding = {c.seq.request_id for c in sampled} - {seq.request_id for seq, _ in ending}
            self._draft(kept, decoding)
        self.scheduler.after_step(kept)
        for seq, reason in ending:
            if seq.request_id in self._export_ids:
                self._export(seq, reason)
            self._end(seq, reason)
        return events

    def _keep(self, seq: Sequence, tokens: list[int]) -> tuple[list[int], str | None]:
        """The tokens a request keeps of those it drew (up to a stop token or
        max_tokens), and why it ends, if it does."""
        stop_ids = self._sampling[seq.request_id].stop_ids
        room = seq.max_tokens - len(seq.output)
        for i, token in enumerate(tokens[:room]):
            if token in stop_ids:
                return tokens[: i + 1], "stop"
        tokens = tokens[:room]
        return tokens, "length" if tokens and len(seq.output) + len(tokens) >= seq.max_tokens else None

    def _follow_grammar(self, request_id: int, tokens: list[int], reason: str | None) -> tuple[list[int], str | None]:
        """Advance the request's grammar by its new tokens; the output ends
        ("stop") where the grammar does. ValueError if it refuses a token."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return tokens, reason
        for i, token in enumerate(tokens):
            if not matcher.consume(token):
                raise ValueError(f"token {token} breaks the request's grammar: {matcher.error}")
            if matcher.stopped:
                return tokens[: i + 1], "stop"
        return tokens, reason

    @staticmethod
    def _token_events(seq: Sequence, tokens: list[int], reason: str | None, drawn: _Drawn,
                      first: bool) -> list[TokenEvent]:
        last = len(tokens) - 1
        return [
            TokenEvent(seq.request_id, t, reason if i == last else None,
                       logprob=drawn.logprobs[i] if drawn.logprobs is not None else None,
                       top_logprobs=drawn.top[i] if drawn.top is not None else (),
                       cached_tokens=seq.cached_tokens if first and i == 0 else None)
            for i, t in enumerate(tokens)
        ]

    def _draw(self, chunks: list[ScheduledChunk], logits: torch.Tensor) -> dict[int, _Drawn | Exception]:
        """Every sampling chunk's new tokens, in one batched draw and one
        device-to-host copy; if that fails, chunk by chunk, so only the chunks
        that fail end (e.g. NaN logits)."""
        try:
            return self._draw_batch(chunks, logits)
        except Exception as exc:  # noqa: BLE001 - narrowed to the failing chunks below
            if len(chunks) == 1:
                return {chunks[0].seq.request_id: exc}
            out: dict[int, _Drawn | Exception] = {}
            offset = 0
            for chunk in chunks:
                n = chunk.drafts + 1
                out.update(self._draw([chunk], logits[offset : offset + n]))
                offset += n
            return out

    def _draw_batch(self, chunks: list[ScheduledChunk], logits: torch.Tensor) -> dict[int, _Drawn | Exception]:
        rows = [self._sampling_row(chunk.seq) for chunk in chunks]
        plan = SamplingPlan.build(rows, logits.shape[-1], logits.device)
        most = max(chunk.drafts for chunk in chunks)
        width = most + 1
        if most == 0:
            raw = logits
            adjusted, _ = self._adjust(chunks, logits, 1, None)
            tokens = sample_tokens(adjusted, plan).view(-1, 1)
            accepted = torch.zeros(len(chunks), dtype=torch.long, device=logits.device)
        else:
            # Each chunk's rows (its next position, then its drafts) padded to most + 1.
            index, offset = [], 0
            for chunk in chunks:
                index.append([offset + min(i, chunk.drafts) for i in range(width)])
                offset += chunk.drafts + 1
            rows_logits = logits[to_device(torch.tensor(index), logits.device)]
            drafts, probs = self._pending_drafts(chunks, most, plan)
            raw = rows_logits.view(-1, rows_logits.shape[-1])
            adjusted, num = self._adjust(chunks, raw, width, drafts)
            num_drafts = to_device(torch.tensor(num), logits.device)
            tokens, accepted = verify_drafts(adjusted.view_as(rows_logits), drafts, num_drafts, probs, plan)
        logprobs = self._logprobs(chunks, raw, tokens)
        host = torch.cat((tokens, accepted[:, None]), dim=1).tolist()  # one copy
        out: dict[int, _Drawn | Exception] = {}
        for i, (chunk, row) in enumerate(zip(chunks, host)):
            n = row[-1]
            if chunk.drafts:
                self.spec_stats.record(chunk.drafts, n)
            chosen, top = logprobs.get(i, (None, None))
            out[chunk.seq.request_id] = _Drawn(row[: n + 1], chosen[: n + 1] if chosen is not None else None,
                                               top[: n + 1] if top is not None else None)
        return out

    def _adjust(self, chunks: list[ScheduledChunk], logits: torch.Tensor, width: int,
                drafts: torch.Tensor | None) -> tuple[torch.Tensor, list[int]]:
        """``logits`` [B * width, vocab] (chunk i's rows from i * width: its
        next position, then one per draft) with the penalties and grammar masks
        of the chunks that have them, and each chunk's drafts, fewer where a
        draft breaks the request's grammar (the rows after it cannot be kept)."""
        num = [chunk.drafts for chunk in chunks]
        penalised = [i for i, chunk in enumerate(chunks) if chunk.seq.request_id in self._counts]
        constrained = [i for i, chunk in enumerate(chunks) if chunk.seq.request_id in self._matchers]
        if not penalised and not constrained:
            return logits, num
        draft_ids = drafts.tolist() if drafts is not None else [[] for _ in chunks]
        if penalised:
            ids = [chunks[i].seq.request_id for i in penalised]
            penalties = self._counts.penalties(
                [i * width + j for i in penalised for j in range(width)],
                [rid for rid in ids for _ in range(width)],
                [self._sampling[rid].params for rid in ids for _ in range(width)],
                [draft_ids[i][:j] for i in penalised for j in range(width)],
            )
            logits = apply_penalties(logits, penalties)
        if constrained:
            masks = self._grammar_masks([chunks[i].seq.request_id for i in constrained],
                                        [draft_ids[i] for i in constrained], [num[i] for i in constrained], width)
            for k, i in enumerate(constrained):
                num[i] = masks.drafts[k]
            rows = to_device(torch.tensor([i * width + j for i in constrained for j in range(width)]), logits.device)
            logits = apply_token_mask(logits, rows, masks.bits)
        return logits, num

    def _grammar_masks(self, request_ids: list[int], drafts: list[list[int]], num: list[int],
                       width: int) -> _GrammarMasks:
        """Each request's allowed-token bitmask at its next position and after
        each of its drafts, found by taking the drafts into its grammar and
        rolling them back; a draft the grammar refuses ends the request's
        drafts there. Rows past them allow everything (they are never kept)."""
        assert self.grammars is not None
        bits = np.full((len(request_ids) * width, self.grammars.words), -1, dtype=np.int32)
        ends = self.grammars.eos_ids
        kept: list[int] = []
        for k, (request_id, proposed, n) in enumerate(zip(request_ids, drafts, num)):
            matcher = self._matchers[request_id]
            valid = taken = 0  # drafts the grammar allows; of them, those it took (an end is not taken)
            try:
                for j in range(n + 1):
                    row = bits[k * width + j]
                    matcher.fill_mask(row)
                    if not row.any():
                        raise ValueError(f"the request's grammar allows no token here: {matcher.error}")
                    if j == n:
                        break
                    allowed, took = matcher.take_draft(row, proposed[j], ends)
                    valid += allowed
                    if not took:
                        break  # refused, or an allowed end: the output ends with this draft
                    taken += 1
                    if matcher.stopped:  # a draft completed the output: nothing after it is kept
                        break
            finally:
                matcher.rollback(taken)
            kept.append(valid)
        return _GrammarMasks(bits, kept)

    def _logprobs(self, chunks: list[ScheduledChunk], logits: torch.Tensor,
                  tokens: torch.Tensor) -> dict[int, tuple[list[float], list[tuple[tuple[int, float], ...]] | None]]:
        """Chunk index -> (logprob of each drawn token, its top alternatives) for
        the chunks that asked; ``logits`` [B * width, vocab] raw, ``tokens`` [B, width]."""
        want = [(i, self._sampling[chunk.seq.request_id].params.logprobs) for i, chunk in enumerate(chunks)]
        want = [(i, top) for i, top in want if top is not None]
        if not want:
            return {}
        width = tokens.shape[1]
        top = max(k for _, k in want)
        rows = to_device(torch.tensor([i * width + j for i, _ in want for j in range(width)]), logits.device)
        chosen, values, ids = token_logprobs(logits[rows], tokens.reshape(-1)[rows], top)
        # One copy: token ids are exact in float32 (below 2**24).
        parts = [chosen[:, None]] if values is None or ids is None else [chosen[:, None], values, ids.float()]
        host = torch.cat(parts, dim=1).view(len(want), width, -1).tolist()
        out: dict[int, tuple[list[float], list[tuple[tuple[int, float], ...]] | None]] = {}
        for w, (i, k) in enumerate(want):
            alternatives = None
            if top:
                alternatives = [tuple(zip(map(int, row[1 + top : 1 + top + k]), row[1 : 1 + k])) for row in host[w]]
            out[i] = ([row[0] for row in host[w]], alternatives)
        return out

    def _pending_drafts(self, chunks: list[ScheduledChunk], most: int,
                        plan: SamplingPlan) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The chunks' drafts [B, most] (0-padded) and the sampled rows' draft
        distributions [S, most, vocab] (zero where a chunk has fewer)."""
        vocab = self.model.config.vocab_size
        if plan.sampled_rows is None and all(chunk.drafts == most for chunk in chunks):  # the common case
            return torch.stack([self._drafts[chunk.seq.request_id][0][:most] for chunk in chunks]), None
        tokens, probs = [], []
        sampled = set(plan.sampled_rows.tolist()) if plan.sampled_rows is not None else set()
        for i, chunk in enumerate(chunks):
            pending = self._drafts.get(chunk.seq.request_id)
            n = chunk.drafts
            row = torch.zeros(most, dtype=torch.long, device=self.device)
            q = torch.zeros(most, vocab, device=self.device) if i in sampled else None
            if pending is not None and n:
                row[:n] = pending[0][:n]
                if q is not None and pending[1] is not None:
                    q[:n] = pending[1][:n]
            tokens.append(row)
            if q is not None:
                probs.append(q)
        return torch.stack(tokens), torch.stack(probs) if probs else None

    def _draft(self, chunks: list[ScheduledChunk], decoding: set[int]) -> None:
        """The MTP pass: every chunk's MTP rows brought up to its computed tokens,
        and drafts for the requests (ids in ``decoding``) that go on decoding."""
        assert self.drafter is not None
        targets = []
        for chunk in chunks:
            seq = chunk.seq
            room = seq.max_tokens - len(seq.output) - 1  # drafts past max_tokens could never be kept
            drafts = seq.request_id in decoding and room > 0
            targets.append(DraftTarget(seq, self._sampling_row(seq) if drafts else None,
                                       self._spans.get(seq.request_id, ())))
        drafting_ids = [t.seq.request_id for t in targets if t.sampling is not None]
        masker = self._draft_masker(drafting_ids)
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
        drafting = [t for t in targets if t.sampling is not None]
        for i, target in enumerate(drafting):
            seq = target.seq
            probs = result.probs[probs_row[i]] if result.probs is not None and i in probs_row else None
            self._drafts[seq.request_id] = (result.tokens[i], probs)
            seq.num_drafts = min(self.num_speculative, seq.max_tokens - len(seq.output) - 1)

    def _draft_masker(self, drafting_ids: list[int]) -> _DraftMasker | None:
        """Drafts drawn within the requests' grammars (those that have one):
        a draft the grammar would refuse is never proposed, so the verify step
        is not spent on it."""
        rows = [(k, self._matchers[rid]) for k, rid in enumerate(drafting_ids) if rid in self._matchers]
        if not rows:
            return None
        assert self.grammars is not None
        return _DraftMasker(rows, self.grammars.words, frozenset(self.grammars.eos_ids))

    def _sampling_row(self, seq: Sequence) -> SamplingRow:
        sampling = self._sampling[seq.request_id]
        # The token count, not a step count: preemption and recompute draw the same.
        return SamplingRow(sampling.params, sampling.seed, len(seq.output))

    def _isolate(self, chunks: list[ScheduledChunk], exc: Exception) -> list[TokenEvent]:
        # A lost expert-parallel rank fails every forward: no request explains it.
        if isinstance(exc, ExpertParallelError) or self._device_lost():
            raise EngineFault(f"the {self.device} device failed: {type(exc).__name__}: {exc}") from exc
        if len(chunks) == 1:
            return [self._fail(chunks[0].seq, exc)]
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

    def _fail(self, seq: Sequence, exc: Exception) -> TokenEvent:
        log.error("request %d failed", seq.request_id, exc_info=exc)
        self._end(seq, "error")
        return TokenEvent(seq.request_id, -1, "error", error=f"{type(exc).__name__}: {exc}")

    def _logits(self, chunks: list[ScheduledChunk]) -> torch.Tensor | None:
        """Logits of every chunk that samples, in chunk order; None if none does."""
        rows = _sample_rows(chunks)
        step = self.prepare_step(chunks)
        try:
            if isinstance(step.backend, DecodeAttentionBackend):
                self._finish_restores()
                # One row per chunk: the graphs and the compiled forward compute them all.
                logits = self._decode_step(step)
                return logits if len(rows) == logits.shape[0] else (logits[rows] if rows else None)
            if step.backend.before_layer is None:
                self._finish_restores()
            hidden = self._extend_hidden(self.model, step.input_ids, step.positions, step.backend,
                                         step.inputs_embeds)
            return self.model.compute_logits(hidden[rows]) if rows else None
        finally:
            self._finish_restores()  # nothing runs past a step with a restore still on its way

    @staticmethod
    def _bucket_edges(config: EngineConfig, context_tokens: int) -> tuple[int, ...]:
        if config.schedule_bucket_edges is not None:
            return tuple(config.schedule_bucket_edges)
        return LengthBuckets.for_context(context_tokens).edges

    def _finish_restores(self) -> None:
        if self.tier_io is not None:
            self.tier_io.finish_restores()

    def _decode_step(self, step: StepInputs) -> torch.Tensor:
        if self.graphs is not None and step.input_ids.shape[0] <= self.graphs.max_batch:
            return self.graphs.replay(step.input_ids, step.backend.batch)  # type: ignore[union-attr]
        return self._decode_logits(self.model, step.input_ids, step.positions, step.backend)

    def _capture_graphs(self) -> DecodeGraphs | None:
        """CUDA graphs of the decode forward, where it is captured: on CUDA with
        the Triton kernels (the torch path gathers the whole table width)."""
        limit = self.config.cuda_graph_max_batch
        limit = self.config.max_running_requests if limit is None else min(limit, self.config.max_running_requests)
        if self.device.type != "cuda" or limit == 0 or not uses_triton(self.config.attention, self.device):
            return None
        return DecodeGraphs(
            lambda ids, batch: self._decode_logits(self.model, ids, batch.positions,
                                                   DecodeAttentionBackend(self.kv, batch, self.decode_attention_fn)),
            self.kv, graph_batch_sizes(limit), self.block_table.width, self.window, self.device,
        )

    def prepare_step(self, chunks: list[ScheduledChunk]) -> StepInputs:
        """Everything the forward needs, at O(batch + new tokens + W per request)
        host cost: full-pool keys come through the block table, never as lists."""
        if all(chunk.length == 1 for chunk in chunks) and not any(self._touches_span(c) for c in chunks):
            return self.prepare_decode(chunks)
        tokens: list[int] = []
        q_ranges: list[tuple[int, int]] = []
        full_write, swa_slots, swa_write, swa_first = [], [], [], []
        for chunk in chunks:
            seq, start, end = chunk.seq, chunk.start, chunk.start + chunk.rows
            tokens.extend(seq.token_slice(start, start + chunk.length))
            tokens.extend([0] * chunk.drafts)
            q_ranges.append((start, chunk.rows))
            view = seq.view
            full_write.append(page_slots(view.full_pages, 0, view.full_page_size, start, end))
            first = max(0, start - self.window + 1)
            swa_first.append(first)
            swa_slots.append(torch.tensor(view.swa_slots(first, end), dtype=torch.int64))
            swa_write.append(swa_slots[-1][start - first :])
        rows = self.block_table.sync([(chunk.seq.request_id, chunk.seq.view) for chunk in chunks])
        full_batch = PagedBatch.from_block_table(q_ranges, self.block_table.table, rows, torch.cat(full_write),
                                                 self.allocator.full.page_size, self.device)
        swa_batch = PagedBatch.build(q_ranges, swa_slots, swa_first, swa_write, self.device)
        # A compiled forward cannot wait layer by layer: restores finish before it.
        gate = self.tier_io.restore_gate() if self.tier_io is not None and not self.config.compile else None
        backend = PagedAttentionBackend(self.kv, full_batch, swa_batch, self.attention_fn, before_layer=gate)
        input_ids = self._with_drafts(chunks, to_device(torch.tensor(tokens, dtype=torch.long), self.device))
        inputs_embeds = self._embed_with_spans(chunks, input_ids) if self._spans else None
        if inputs_embeds is None and self.config.compile:
            # A compiled extend always takes embeddings: one graph whether or not a batch has media rows.
            inputs_embeds = self.model.model.embed_tokens(input_ids)
        return StepInputs(input_ids, full_batch.q_pos, backend, inputs_embeds)

    def prepare_decode(self, chunks: list[ScheduledChunk]) -> StepInputs:
        """A step of one query per request, as a ``DecodeBatch``: O(batch x W) on
        the host, one host-to-device copy, full-pool pages gathered from the
        device block table."""
        window, rows = self.window, []
        table_rows = self.block_table.sync([(chunk.seq.request_id, chunk.seq.view) for chunk in chunks])
        for chunk, table_row in zip(chunks, table_rows):
            seq = chunk.seq
            view = seq.view
            page = view.full_page_size
            token = seq.token_slice(chunk.start, chunk.start + 1)[0]
            # A verify chunk's rows are queries of their own (drafts filled in below).
            for pos in range(chunk.start, chunk.start + chunk.rows):
                swa = view.swa_slots(max(0, pos + 1 - window), pos + 1)
                rows.append([token if pos == chunk.start else 0, pos,
                             view.full_pages[pos // page] * page + pos % page,
                             len(swa), swa[-1], *swa, *([0] * (window - len(swa))), table_row])
        meta = to_device(torch.tensor(rows, dtype=torch.int64), self.device)
        # Fields as tensors of their own (not views at offsets of one), so the
        # compiled forward sees the same strides and offsets at every step.
        ids, positions, full_write, swa_len, swa_write = (column(meta, i) for i in range(5))
        ids = self._with_drafts(chunks, ids)
        widest = -(-max(chunk.start + chunk.rows for chunk in chunks) // self.allocator.full.page_size)
        # At least two page columns (the kernels read only a request's own
        # pages): a width of 1 would be a compiled graph of its own.
        widest = max(widest, min(2, self.block_table.width))
        batch = DecodeBatch(
            positions=positions,
            full_pages=self.block_table.table[meta[:, -1], :widest],
            full_write=full_write,
            swa_slots=meta[:, 5:-1].clone(memory_format=torch.contiguous_format),
            swa_len=swa_len,
            swa_write=swa_write,
            page_size=self.allocator.full.page_size,
        )
        backend = DecodeAttentionBackend(self.kv, batch, self.decode_attention_fn)
        return StepInputs(ids, positions, backend, None)

    def _with_drafts(self, chunks: list[ScheduledChunk], ids: torch.Tensor) -> torch.Tensor:
        """``ids`` with each verify chunk's draft rows set to its drafts (on the
        device: drafts are never copied to the host before they are verified)."""
        rows, drafts, offset = [], [], 0
        for chunk in chunks:
            if chunk.drafts:
                rows.extend(range(offset + chunk.length, offset + chunk.rows))
                drafts.append(self._drafts[chunk.seq.request_id][0][: chunk.drafts])
            offset += chunk.rows
        if rows:
            ids[to_device(torch.tensor(rows), self.device)] = torch.cat(drafts)
        return ids

    def _touches_span(self, chunk: ScheduledChunk) -> bool:
        start, end = chunk.start, chunk.start + chunk.length
        return any(span.offset < end and start < span.end for span in self._spans.get(chunk.seq.request_id, ()))

    def _embed_with_spans(self, chunks: list[ScheduledChunk], input_ids: torch.Tensor) -> torch.Tensor | None:
        """Token embeddings of the batch with every span position's row taken
        from its span, or None when no chunk touches a span.

        A chunk may start or end inside a span (chunked prefill, a cache hit,
        recompute after preemption): only the overlapping rows are copied.
        """
        placements: list[tuple[int, torch.Tensor]] = []  # (batch row, span rows)
        row = 0
        for chunk in chunks:
            start, end = chunk.start, chunk.start + chunk.length
            for span in self._spans.get(chunk.seq.request_id, ()):
                lo, hi = max(start, span.offset), min(end, span.end)
                if lo < hi:
                    placements.append((row + lo - start, span.embeddings[lo - span.offset : hi - span.offset]))
            row += chunk.rows
        if not placements:
            return None
        # Span positions hold negative cache tokens; any valid id does for the
        # lookup, as those rows are overwritten below.
        embeds = self.model.model.embed_tokens(input_ids.clamp_(min=0))
        for first, rows in placements:
            embeds[first : first + rows.shape[0]] = rows
        return embeds

    def _end(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        self.block_table.release(seq.request_id)
        del self._sampling[seq.request_id]
        del self._sequences[seq.request_id]
        self._spans.pop(seq.request_id, None)
        self._drafts.pop(seq.request_id, None)
        self._matchers.pop(seq.request_id, None)
        self._counts.release(seq.request_id)
        self._export_ids.discard(seq.request_id)
        self._first_events.pop(seq.request_id, None)

    def _tier_stats(self) -> dict[str, Any] | None:
        tiers = self.cache.tiers if self.cache is not None else None
        if tiers is None or self.tier_io is None:
            return None
        io = self.tier_io
        return {**tiers.as_dict(), "restore_seconds_buckets": list(RESTORE_BUCKETS),
                "restore_seconds_counts": list(io.restore_seconds), "restore_seconds_sum": io.restore_seconds_sum,
                "checksum_failures": io.host.checksum_failures
                + (io.disk.checksum_failures + io.disk.missing + io.disk.scan_dropped if io.disk is not None else 0)}

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

    # ----------------------------------------------------------------- stats
    def stats(self) -> dict[str, Any]:
        full, swa = self.allocator.full, self.allocator.swa
        cache = self.cache.stats if self.cache is not None else None
        return {
            "prefix_cache": None if cache is None else {
                "cached_prompt_tokens": cache.cached_prompt_tokens,
                "computed_prompt_tokens": cache.computed_prompt_tokens,
                "hit_rate": round(cache.hit_rate, 4),
                "nodes": self.cache.num_nodes,  # type: ignore[union-attr]
                "swa_slots_cached": self.cache.swa_slots_cached,  # type: ignore[union-attr]
                "cached_tokens_by_tier": dict(cache.cached_tokens_by_tier),
            },
            "kv_tiers": self._tier_stats(),
            "swa_mode": self.config.swa_mode,
            "kv_cache_dtype": str(self.kv.kv_dtype).removeprefix("torch."),
            "full_pool": {
                "capacity_tokens": full.capacity,
                "free_tokens": full.free_slots,
                "bytes_per_token": self.kv.full_bytes_per_token,
            },
            "swa_pool": {
                "capacity_tokens": swa.capacity,
                "free_tokens": swa.free_slots,
                "bytes_per_token": self.kv.swa_bytes_per_token,
            },
            "running_requests": len(self.scheduler.running),
            "waiting_requests": len(self.scheduler.waiting),
            "queued_prompt_tokens": self.scheduler.queued_tokens(),
            "preemptions": self.scheduler.num_preemptions,
            "schedule": self.scheduler.latency_stats(),
            "speculative": self.spec_stats.as_dict(),
        }
