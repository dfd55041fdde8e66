"""The offline entry point: ``LLM(model_dir).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from llm_core.config import ModelConfig
from llm_core.kv_cache import ContiguousAttention, RequestKVCache, Segment
from llm_core.sampling import SamplingParams, make_generator, sample_token
from llm_core.tokenizer import Tokenizer
from llm_core.weights import load_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
Prompt = str | Sequence[int]
# Called as on_token(prompt_index, token_id, finish_reason) for every generated token.
TokenCallback = Callable[[int, int, str | None], None]


@dataclass
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str | None  # "stop" (EOS or a stop token) or "length"


@dataclass
class _Request:
    request_id: int
    prompt: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    generator: torch.Generator | None
    cache: RequestKVCache = field(default_factory=RequestKVCache)
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None

    num_computed: int = 0  # tokens whose KV is in the cache

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    def pending_tokens(self) -> list[int]:
        """Tokens still to run through the model (a prompt tail, or the last output)."""
        if self.num_computed < len(self.prompt):
            return self.prompt[self.num_computed :]
        return self.output[self.num_computed - len(self.prompt) :]


class LLM:
    def __init__(
        self,
        model: str | Path,
        device: str = "cpu",
        dtype: str = "float32",
        max_num_batched_tokens: int = 4096,
    ) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        self.model_dir = Path(model)
        self.device = torch.device(device)
        self.model = load_model(self.model_dir, self.device, DTYPES[dtype])
        self.config: ModelConfig = self.model.config
        self.tokenizer = Tokenizer.from_model_dir(self.model_dir)
        self.max_num_batched_tokens = max_num_batched_tokens
        self._next_id = 0

    # ------------------------------------------------------------------ input
    def encode_prompt(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"text prompts need a tokenizer.json in {self.model_dir}; pass token ids instead"
                )
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(
                f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.config.vocab_size})"
            )
        return ids

    def check_length(self, num_prompt_tokens: int, max_tokens: int) -> None:
        limit = self.config.max_position_embeddings
        if num_prompt_tokens + max_tokens > limit:
            raise ValueError(
                f"prompt of {num_prompt_tokens} tokens plus max_tokens={max_tokens} exceeds "
                f"the model's context length of {limit} tokens"
            )

    # --------------------------------------------------------------- generate
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        on_token: TokenCallback | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; all are validated before any is run.

        ``on_token`` streams tokens as they are sampled (prompt index, token,
        finish reason or None).
        """
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(sampling_params, len(prompt_list))
        requests = [self._make_request(p, sp) for p, sp in zip(prompt_list, params_list)]
        index_of = {r.request_id: i for i, r in enumerate(requests)}
        with torch.inference_mode():
            while active := [r for r in requests if r.finish_reason is None]:
                for request, token in self._step(active):
                    if on_token is not None:
                        on_token(index_of[request.request_id], token, request.finish_reason)
        return [self._to_output(r) for r in requests]

    def _make_request(self, prompt: Prompt, params: SamplingParams) -> _Request:
        ids = self.encode_prompt(prompt)
        self.check_length(len(ids), params.max_tokens)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= set(self.config.eos_token_ids)
        request = _Request(
            request_id=self._next_id,
            prompt=ids,
            params=params,
            stop_ids=frozenset(stop_ids),
            generator=make_generator(params, self.device),
        )
        self._next_id += 1
        return request

    def _step(self, active: list[_Request]) -> list[tuple[_Request, int]]:
        """One forward over every active request: decodes first, then prompt chunks."""
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[_Request, list[int]]] = []
        for request in sorted(active, key=lambda r: r.num_computed < len(r.prompt)):
            tokens = request.pending_tokens()[: max(budget, 0)]
            if tokens:
                scheduled.append((request, tokens))
                budget -= len(tokens)
        segments = [Segment(r.cache, r.num_computed, len(t)) for r, t in scheduled]
        input_ids = torch.tensor([t for _, ts in scheduled for t in ts], device=self.device)
        positions = torch.cat(
            [torch.arange(s.start, s.start + s.length, device=self.device) for s in segments]
        )
        hidden = self.model(input_ids, positions, ContiguousAttention(segments, self.device))

        rows, sampling = [], []
        offset = 0
        for request, tokens in scheduled:
            offset += len(tokens)
            request.num_computed += len(tokens)
            if request.num_computed == request.num_tokens:
                rows.append(offset - 1)
                sampling.append(request)
        sampled: list[tuple[_Request, int]] = []
        if rows:
            logits = self.model.compute_logits(hidden[rows])
            for request, row in zip(sampling, logits):
                token = sample_token(row, request.params, request.generator)
                self._append_token(request, token)
                sampled.append((request, token))
        return sampled

    @staticmethod
    def _append_token(request: _Request, token: int) -> None:
        request.output.append(token)
        if token in request.stop_ids:
            request.finish_reason = "stop"
        elif len(request.output) >= request.params.max_tokens:
            request.finish_reason = "length"

    def _to_output(self, request: _Request) -> RequestOutput:
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(request.output)
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt,
            token_ids=request.output,
            text=text,
            finish_reason=request.finish_reason,
        )


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


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
