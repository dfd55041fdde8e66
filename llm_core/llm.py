"""The offline entry point: ``LLM(model_dir).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from pathlib import Path

import torch

from llm_core.model.config import ModelConfig
from llm_core.device import compute_dtype
from llm_core.cluster.disagg import KVReservation, PrefilledKV
from llm_core.sample.grammar import GrammarCompiler
from llm_core.engine import Engine, EngineConfig, TokenEvent
from llm_core.prompts import Prompt, check_context_length, encode_prompt
from llm_core.ep_engine import EPLeader, LocalGroup, check_engine_config, handshake, launch_local_group
from llm_core.model.expert_parallel import ExpertParallel, ExpertParallelError
from llm_core.kv.kv_events import KVEventLog
from llm_core.model.multimodal import MultimodalSpan, check_spans
from llm_core.sample.params import SamplingParams
from llm_core.model.tokenizer import TOKENIZER_FILE, Tokenizer
from llm_core.warmup import CompileCounter, warm_up
from llm_core.loading.weights import QUANTIZATION_MODES, QuantizationMode, describe_weights, load_model

# Called as on_token(prompt_index, token_id, finish_reason) for every generated token.
TokenCallback = Callable[[int, int, str | None], None]


@dataclass
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str | None  # "stop" (EOS or a stop token), "length", or "error"
    error: str | None = None  # why it failed, with finish_reason "error"


class LLM:
    def __init__(
        self,
        model: str | Path,
        device: str = "cpu",
        dtype: str = "float32",
        kv_events: KVEventLog | None = None,
        ep_size: int = 1,
        ep: ExpertParallel | None = None,
        quantization: QuantizationMode = "auto",
        **engine_options: Any,
    ) -> None:
        """``engine_options`` are ``EngineConfig`` fields: ``kv_budget_bytes``,
        ``swa_mode``, ``max_running_requests``, ``max_num_batched_tokens``,
        ``prefill_batch_tokens`` (no request admitted into a step whose prefill
        holds this many tokens), ``chunked_prefill_size``, ``page_size``, ``attention``,
        ``enable_prefix_caching``, ``checkpoint_interval``, ``compile``
        (torch.compile the decode and extend forwards; every graph is
        compiled here, by a warm-up, so no request waits for one),
        ``cuda_graph_max_batch`` (CUDA graphs of decode batches up to it),
        ``speculative_tokens`` (MTP drafts verified per step; default one per
        MTP layer of the checkpoint, 0 turns speculative decoding off) and
        ``kv_host_bytes``, ``kv_disk_bytes``, ``kv_disk_dir`` (KV tiers under
        the device pools; ``close()`` writes host-only entries to disk) and
        ``kv_restore_layerwise`` (host restores beside the forward, layer by
        layer; default on CUDA). ``kv_events``: the prefix cache records what it
        holds there, for a router (a rebuilt engine starts a new epoch).

        ``ep_size`` > 1: expert parallelism over that many processes on this
        host, this one rank 0 (``llm_core.ep_engine``), eager and without KV
        tiers; ``ep``: this process's rank of a group built elsewhere.

        ``quantization``: FP8 checkpoints keep their weights FP8 in memory where
        FP8 GEMMs run (``"auto"``: CUDA of compute capability 8.9+), always
        (``"fp8"``; a float checkpoint is quantized at load) or never (``"none"``:
        dequantized to ``dtype`` at load, as ``"auto"`` does elsewhere)."""
        torch_dtype = compute_dtype(dtype)
        if quantization not in QUANTIZATION_MODES:
            raise ValueError(f"quantization must be one of {QUANTIZATION_MODES}, got {quantization!r}")
        self.quantization = quantization
        self.model_dir = Path(model)
        self.device = torch.device(device)
        engine_config = EngineConfig(**engine_options)
        if ep is not None or ep_size > 1:
            engine_config = check_engine_config(engine_config)  # before any process starts
        self.kv_events = kv_events
        self._ep_local: LocalGroup | None = None
        if ep is None and ep_size > 1:
            self._ep_local = launch_local_group(ep_size, self.model_dir, device, dtype, engine_options,
                                                quantization=quantization)
            ep = self._ep_local.ep
        self.ep = ep
        self.compiles = CompileCounter()
        try:
            self._build(torch_dtype, engine_config)
        except BaseException:
            self._stop_followers(wait=False)  # a leader that cannot start leaves no rank behind
            raise

    def _build(self, dtype: torch.dtype, engine_config: EngineConfig) -> None:
        self.model = load_model(self.model_dir, self.device, dtype, ep=self.ep, quantization=self.quantization)
        self.config: ModelConfig = self.model.config
        self.weights = describe_weights(self.model, self.model_dir, self.quantization)
        self.tokenizer = Tokenizer.from_model_dir(self.model_dir)
        tokenizer_file = self.model_dir / TOKENIZER_FILE
        # Structured outputs need the tokenizer's vocabulary; a checkpoint without one refuses grammars.
        self.grammars = GrammarCompiler.from_file(tokenizer_file, self.config.vocab_size, self.config.eos_token_ids) \
            if tokenizer_file.exists() and self.config.eos_token_ids else None
        self.engine = Engine(self.model, engine_config, self.device, self.kv_events, self.grammars)
        # What requests and steps go to: the engine, or on rank 0 of a group the
        # leader that records each call for the other ranks (which run ep_engine.follow).
        self.core: Engine | EPLeader = self.engine
        if self.ep is not None and self.ep.leader and self.ep.size > 1:
            self.core = EPLeader(self.ep, self.engine)
            if failed := handshake(self.ep, True):
                raise ExpertParallelError(f"expert-parallel ranks {failed} could not build their engine "
                                          "(see their log)")
        # A compiled engine compiles every graph it will use now, not under its first requests.
        self.warmup = warm_up(self) if engine_config.compile and self.core is self.engine else None
        self.compiles.mark_ready()

    def close(self) -> None:
        """Finish the KV tiers' disk writes (a later process over the same
        ``kv_disk_dir`` restores from them); the other ranks of a group exit."""
        self.core.close()
        self._stop_followers()

    def _stop_followers(self, wait: bool = True) -> None:
        if self._ep_local is not None:
            self._ep_local.close(timeout=30.0 if wait else 0.0)
            self._ep_local = None

    # ------------------------------------------------------------------ input
    def encode_prompt(self, prompt: Prompt) -> list[int]:
        return encode_prompt(prompt, self.tokenizer, self.config.vocab_size, self.model_dir)

    def check_length(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Refuse, with a reason, a request longer than the context or the KV pool."""
        check_context_length(num_prompt_tokens, max_tokens, self.config.max_position_embeddings)
        self.engine.check_fits(num_prompt_tokens, max_tokens)

    # --------------------------------------------------------------- generate
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        on_token: TokenCallback | None = None,
        mm_spans: Sequence[Sequence[MultimodalSpan]] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; all are validated before any is run.

        ``on_token`` streams tokens as they are sampled (prompt index, token,
        finish reason or None). ``mm_spans`` gives each prompt its multimodal
        spans (embedding rows replacing placeholder tokens), one list per prompt.
        """
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(sampling_params, len(prompt_list))
        spans_list = _as_spans_list(mm_spans, len(prompt_list))
        encoded = [self.encode_prompt(p) for p in prompt_list]
        for ids, params, spans in zip(encoded, params_list, spans_list):
            check_spans(spans, len(ids), self.config.hidden_size)
            params.check_vocabulary(self.config.vocab_size)
            self.check_length(len(ids), params.max_tokens)
        ids_of: list[int] = []
        tokens: list[list[int]] = [[] for _ in encoded]
        reasons: list[str | None] = [None] * len(encoded)
        errors: list[str | None] = [None] * len(encoded)
        try:
            for ids, params, spans in zip(encoded, params_list, spans_list):
                ids_of.append(self.add_request(ids, params, spans))
            index_of = {rid: i for i, rid in enumerate(ids_of)}
            while any(r is None for r in reasons):
                for event in self.step():
                    i = index_of[event.request_id]
                    reasons[i] = event.finish_reason
                    if event.error is not None:
                        errors[i] = event.error
                        continue
                    tokens[i].append(event.token)
                    if on_token is not None:
                        on_token(i, event.token, event.finish_reason)
        finally:
            for rid, reason in zip(ids_of, reasons):
                if reason is None:
                    self.abort(rid)
        return [
            RequestOutput(rid, ids, toks, self._decode(toks), reason, error)
            for rid, ids, toks, reason, error in zip(ids_of, encoded, tokens, reasons, errors)
        ]

    # ------------------------------------------------------- engine passthrough
    def add_request(
        self, prompt_ids: list[int], params: SamplingParams, mm_spans: Sequence[MultimodalSpan] = (),
        export_kv: bool = False,
    ) -> int:
        return self.core.add_request(prompt_ids, params, self.config.eos_token_ids, mm_spans, export_kv)

    # Disaggregation: see KVHandoff and Engine.reserve_kv, add_prefilled.
    def take_export(self, request_id: int) -> PrefilledKV | None:
        return self.engine.handoff.take_export(request_id)

    def reserve_kv(self, num_prompt_tokens: int, max_tokens: int) -> KVReservation | None:
        return self.core.reserve_kv(num_prompt_tokens, max_tokens)

    def fill_reservation(self, reservation: KVReservation, blob: torch.Tensor) -> None:
        with torch.inference_mode():
            self.engine.handoff.fill(reservation, blob)

    def cancel_reservation(self, reservation: KVReservation) -> bool:
        return self.engine.handoff.cancel(reservation)

    def add_prefilled(self, reservation: KVReservation, prompt_ids: list[int], params: SamplingParams,
                      prefilled: PrefilledKV, mm_spans: Sequence[MultimodalSpan] = ()) -> int:
        return self.engine.add_prefilled(reservation, prompt_ids, params, prefilled, self.config.eos_token_ids,
                                         mm_spans)

    def step(self) -> list[TokenEvent]:
        with torch.inference_mode():
            return self.core.step()

    def abort(self, request_id: int) -> bool:
        return self.core.abort(request_id)

    def stats(self) -> dict[str, Any]:
        compile_stats = {"enabled": self.engine.config.compile, "recompiles_after_ready": self.compiles.after_ready,
                         "warmup": self.warmup.as_dict() if self.warmup is not None else None}
        stats = self.engine.stats() | {"weights": self.weights, "compile": compile_stats}
        if self.ep is not None:
            stats["expert_parallel"] = {"size": self.ep.size, "rank": self.ep.rank, **self.ep.stats.as_dict()}
        return stats

    def flush_cache(self) -> None:
        self.core.flush_cache()

    def reset_engine(self) -> None:
        """A fresh engine (empty pools and cache) on the same model, after an
        EngineFault: every request of the old one is dropped."""
        config = self.engine.config
        self.engine.close(persist=False)  # disk writes finish; host entries made before the fault are dropped
        del self.engine  # its KV tensors go before the new ones are allocated
        self.engine = Engine(self.model, config, self.device, self.kv_events, self.grammars)
        if isinstance(self.core, EPLeader):
            self.core.reset(self.engine)
        else:
            self.core = self.engine

    def _decode(self, token_ids: list[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(token_ids)


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _as_spans_list(
    spans: Sequence[Sequence[MultimodalSpan]] | None, n: int
) -> list[Sequence[MultimodalSpan]]:
    if spans is None:
        return [()] * n
    spans = list(spans)
    if len(spans) != n:
        raise ValueError(f"got {len(spans)} multimodal span lists for {n} prompts (one list per prompt)")
    if any(isinstance(s, MultimodalSpan) for s in spans):
        raise ValueError("mm_spans takes one list of spans per prompt, not the spans themselves")
    return spans


def _as_params_list(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts")
    return params
