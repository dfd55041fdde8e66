"""``swallow bench structured``: what constrained decoding costs, on the demo
model, in one run.

The same batch of requests decodes twice per round: once held to a JSON
schema (llguidance token masks in the engine's batched sampler, drafts checked
against the grammar), once free. Every request generates exactly
``max_tokens`` tokens either way -- the schema asks for a long array, so it
never completes first, and the free run ignores the end token -- so the two
runs do the same model work and differ only by the grammar's. Rounds
alternate the order; the medians are reported, with every constrained output
checked to be a prefix the schema allows. With MTP drafts (the default) the
constrained run drafts within the grammar, and JSON's forced tokens are
drafted right far more often than free text; ``without_drafts`` repeats the
pair with drafting off, which leaves the grammar's cost alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from api.models import DEMO_MODEL_DIR
from bench import log
from demo.tasks import make_scene
from demo.world import TASKS
from llm_core import LLM, SamplingParams
from llm_core.model.chat import ChatTemplate
from llm_core.sample.grammar import GrammarSpec
from llm_core.sample.speculative import SpeculativeStats

__all__ = ["SCHEMA", "structured_bench"]

# Long enough never to finish within the bench's max_tokens: every request
# generates the same number of tokens as its free twin.
SCHEMA = {
    "type": "object",
    "properties": {
        "objects": {
            "type": "array",
            "minItems": 64,
            "items": {
                "type": "object",
                "properties": {
                    "shape": {"type": "string", "enum": ["circle", "square", "triangle"]},
                    "color": {"type": "string", "enum": ["red", "green", "blue", "yellow", "white"]},
                    "count": {"type": "integer", "minimum": 0, "maximum": 99},
                    "note": {"type": "string", "maxLength": 12},
                },
                "required": ["shape", "color", "count", "note"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["objects"],
    "additionalProperties": False,
}


def _prompts(model_dir: Path, llm: LLM, count: int, seed: int) -> list[list[int]]:
    assert llm.tokenizer is not None
    template = ChatTemplate.from_model_dir(model_dir)
    rng = np.random.default_rng(seed)
    questions = [make_scene(rng, TASKS[i % len(TASKS)])[1] for i in range(count)]
    return [llm.tokenizer.encode(template.render([{"role": "user", "content": f"{q} Answer as JSON."}]))
            for q in questions]


def _run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, list[list[int]]]:
    """Wall seconds to finish every request, and each request's tokens."""
    start = time.perf_counter()
    ids = [llm.engine.add_request(p, s, eos_ids=llm.config.eos_token_ids) for p, s in zip(prompts, params)]
    out: dict[int, list[int]] = {i: [] for i in ids}
    while llm.engine.has_unfinished():
        for event in llm.engine.step():
            if event.error is not None:
                raise RuntimeError(f"request {event.request_id} failed: {event.error}")
            out[event.request_id].append(event.token)
    return time.perf_counter() - start, [out[i] for i in ids]


def _acceptance(llm: LLM) -> float | None:
    """Mean drafts accepted per verify step since the last call (None without drafts)."""
    stats = llm.engine.spec_stats
    llm.engine.spec_stats = SpeculativeStats(llm.engine.num_speculative)  # a fresh count for the next run
    return round(sum(stats.accepted) / stats.verify_steps, 3) if stats.verify_steps else None


def structured_bench(model_dir: str | Path, *, batch: int = 16, max_tokens: int = 96, repeats: int = 3,
                     seed: int = 0, speculative_tokens: int | None = None,
                     log: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """The figures with the engine as configured (MTP drafts by default), and,
    where it drafts, again without drafts: the masks' own cost, apart from
    what drafting within the grammar gains."""
    model_dir = Path(model_dir)
    llm = LLM(model_dir, speculative_tokens=speculative_tokens, enable_prefix_caching=False)
    result: dict[str, Any] = {"bench": "structured", "model": str(model_dir), "batch": batch,
                              "max_tokens": max_tokens, "repeats": repeats}
    result |= _measure(model_dir, llm, batch, max_tokens, repeats, seed, log)
    if llm.engine.num_speculative:
        del llm
        plain = LLM(model_dir, speculative_tokens=0, enable_prefix_caching=False)
        result["without_drafts"] = _measure(model_dir, plain, batch, max_tokens, repeats, seed, log)
    return result


def _measure(model_dir: Path, llm: LLM, batch: int, max_tokens: int, repeats: int, seed: int,
             log: Callable[[str], None]) -> dict[str, Any]:
    grammars = llm.grammars
    if grammars is None:
        raise ValueError(f"{model_dir} has no tokenizer.json: nothing to constrain with")
    prompts = _prompts(model_dir, llm, batch, seed)
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    free = [SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=seed + i, ignore_eos=True)
            for i in range(batch)]
    constrained = [SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=seed + i, grammar=spec)
                   for i in range(batch)]
    _run(llm, prompts[:2], free[:2])  # warm-up: first-call costs out of the timings
    _run(llm, prompts[:2], constrained[:2])
    _acceptance(llm)
    times: dict[str, list[float]] = {"constrained": [], "unconstrained": []}
    acceptance: dict[str, list[float]] = {"constrained": [], "unconstrained": []}
    drafts = llm.engine.num_speculative
    for round_ in range(repeats):
        order = ("constrained", "unconstrained") if round_ % 2 == 0 else ("unconstrained", "constrained")
        for name in order:
            seconds, outputs = _run(llm, prompts, constrained if name == "constrained" else free)
            if any(len(tokens) != max_tokens for tokens in outputs):
                raise RuntimeError(f"{name}: a request ended before max_tokens; the runs would not compare")
            if name == "constrained":
                _check_prefixes(grammars, spec, outputs)
            times[name].append(seconds)
            rate = _acceptance(llm)
            if rate is not None:
                acceptance[name].append(rate)
            log(f"drafts {drafts}, round {round_}: {name} {batch * max_tokens / seconds:.1f} tok/s")
    tokens = batch * max_tokens
    constrained_tok_s = tokens / statistics.median(times["constrained"])
    unconstrained_tok_s = tokens / statistics.median(times["unconstrained"])
    return {
        "speculative_tokens": drafts,
        "constrained_tok_s": round(constrained_tok_s, 1),
        "unconstrained_tok_s": round(unconstrained_tok_s, 1),
        "ratio": round(constrained_tok_s / unconstrained_tok_s, 3),
        "drafts_accepted_per_step": {name: statistics.median(v) if v else None for name, v in acceptance.items()},
        "seconds": {name: [round(t, 3) for t in v] for name, v in times.items()},
    }


def _check_prefixes(grammars: Any, spec: GrammarSpec, outputs: list[list[int]]) -> None:
    """Every constrained output is one the grammar takes, token by token."""
    for tokens in outputs:
        matcher = grammars.matcher(spec)
        if not all(matcher.consume(t) for t in tokens):
            raise RuntimeError(f"a constrained output broke its grammar: {matcher.error}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="checkpoint to serve (default: the demo model)")
    parser.add_argument("--structured-batch", type=int, default=16, help="requests decoded together")
    parser.add_argument("--repeats", type=int, default=2, help="best of N runs")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument("--speculative-tokens", type=int, help="drafts per step when on (default: one per MTP layer)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    return structured_bench(args.model or DEMO_MODEL_DIR, batch=args.structured_batch, repeats=args.repeats,
                            seed=args.seed, speculative_tokens=args.speculative_tokens, log=log)
