"""The decode and extend forwards are one graph each: torch.compile(fullgraph=True)
traces them without a break, on CPU, for every batch size and context they
meet, and the compiled engine generates what the eager one does."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from llm_core.loading.checkpoint import write_random_checkpoint
from llm_core.model_runner import compiled, compiled_decode_logits, decode_logits, extend_hidden
from llm_core.llm import LLM
from llm_core.kv.attention_backends import DecodeAttentionBackend
from llm_core.model.presets import tiny
from llm_core.sample.params import SamplingParams

PROMPTS = [list(range(20, 45)), list(range(50, 90)), list(range(100, 119))]


@pytest.fixture(scope="module")
def two_layer_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Small enough that inductor compiles it in seconds: one full and one SWA layer, MoE on the second."""
    config = replace(tiny(), num_hidden_layers=2, layer_types=("full", "sliding"), mlp_layer_types=("dense", "sparse"))
    return write_random_checkpoint(tmp_path_factory.mktemp("two_layer") / "model", config, seed=3)


def _in_decode(llm: LLM, prompts: list[list[int]]) -> list:  # noqa: ANN401 - scheduled chunks
    for prompt in prompts:
        llm.add_request(prompt, SamplingParams(max_tokens=20, ignore_eos=True))
    engine = llm.engine
    while not all(seq.in_decode for seq in engine.scheduler.running) or len(engine.scheduler.running) < len(prompts):
        engine.step()
    return engine.scheduler.schedule()


def test_decode_forward_traces_whole_and_does_not_recompile(two_layer_checkpoint: Path) -> None:
    llm = LLM(two_layer_checkpoint)
    engine = llm.engine
    chunks = _in_decode(llm, PROMPTS)
    engine.kv.mark_static()  # as a compiling engine does
    torch._dynamo.reset()
    compiled = compiled_decode_logits(engine.device, backend="aot_eager")
    with torch.inference_mode():
        for batch in (chunks, chunks[:2]):  # two batch sizes, contexts of 19 to 40 tokens
            step = engine.runner.prepare_step(batch)
            assert isinstance(step.backend, DecodeAttentionBackend)
            eager = decode_logits(engine.model, step.input_ids, step.positions, step.backend)
            # fullgraph: a graph break raises; after the first size, a recompile does too.
            with torch._dynamo.config.patch(error_on_recompile=batch is not chunks):
                traced = compiled(engine.model, step.input_ids, step.positions, step.backend)
            torch.testing.assert_close(traced, eager, atol=1e-5, rtol=1e-5)


def test_extend_forward_traces_whole_and_does_not_recompile(two_layer_checkpoint: Path) -> None:
    llm = LLM(two_layer_checkpoint, chunked_prefill_size=16, max_num_batched_tokens=40)
    for prompt in PROMPTS:
        llm.add_request(prompt, SamplingParams(max_tokens=4))
    engine = llm.engine
    engine.kv.mark_static()
    torch._dynamo.reset()
    traced = compiled(extend_hidden, engine.device, backend="aot_eager")
    with torch.inference_mode():
        for step_index in range(2):  # two mixed batches of different sizes and chunk layouts
            chunks = engine.scheduler.schedule()
            step = engine.runner.prepare_step(chunks)
            assert not isinstance(step.backend, DecodeAttentionBackend)
            eager = extend_hidden(engine.model, step.input_ids, step.positions, step.backend, None)
            with torch._dynamo.config.patch(error_on_recompile=step_index > 0):
                out = traced(engine.model, step.input_ids, step.positions, step.backend, None)
            torch.testing.assert_close(out, eager, atol=1e-5, rtol=1e-5)
            engine.scheduler.advance(chunks)
            for chunk in chunks:
                if chunk.samples:
                    chunk.seq.output.append(5)


def test_decode_steps_take_the_tensor_only_path_and_prefill_does_not(hf_checkpoint: Path) -> None:
    llm = LLM(hf_checkpoint, chunked_prefill_size=8)
    llm.add_request(PROMPTS[0], SamplingParams(max_tokens=4))
    engine = llm.engine
    chunks = engine.scheduler.schedule()
    assert chunks[0].length == 8
    assert not isinstance(engine.runner.prepare_step(chunks).backend, DecodeAttentionBackend)


# The compiled engine generating what the eager one does: tests/llm_core/test_warmup.py.
