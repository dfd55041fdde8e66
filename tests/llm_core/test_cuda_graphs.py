"""CUDA graphs of the decode forward: which batch sizes are captured, and (on
a GPU) that replaying them generates what the eager engine does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llm_core.cuda_graphs import graph_batch_sizes, padded_size
from llm_core.llm import LLM
from llm_core.sample.params import SamplingParams


def test_batch_sizes_cover_every_batch_up_to_the_limit() -> None:
    assert graph_batch_sizes(1) == (1,)
    assert graph_batch_sizes(6) == (1, 2, 4, 6)
    assert graph_batch_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    sizes = graph_batch_sizes(50)
    assert sizes[-1] == 50
    for n in range(1, 51):
        size = padded_size(sizes, n)
        assert size >= n and all(s < n for s in sizes if s < size)
    with pytest.raises(ValueError):
        padded_size(sizes, 51)
    with pytest.raises(ValueError):
        graph_batch_sizes(0)


def test_no_graphs_off_cuda(hf_checkpoint: Path) -> None:
    assert LLM(hf_checkpoint).engine.runner.graphs is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("compile", [False, True])
def test_graph_replay_generates_what_the_eager_engine_does(hf_checkpoint: Path, dtype: str, compile: bool) -> None:
    prompts = [list(range(10, 10 + n)) for n in (5, 17, 33, 40, 3)]
    # Different lengths: the batch shrinks 5 -> 1 and is padded to 8, 4, 2, 1 on the way.
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (30, 12, 7, 22, 3)]
    eager = LLM(hf_checkpoint, device="cuda", dtype=dtype, cuda_graph_max_batch=0)
    graphs = LLM(hf_checkpoint, device="cuda", dtype=dtype, cuda_graph_max_batch=8, compile=compile)
    assert eager.engine.runner.graphs is None and graphs.engine.runner.graphs is not None
    assert graphs.engine.runner.graphs.sizes == (1, 2, 4, 8)
    expected = [o.token_ids for o in eager.generate(prompts, params)]
    assert [o.token_ids for o in graphs.generate(prompts, params)] == expected
    # A batch larger than any graph runs without one.
    many = [list(range(3, 3 + n)) for n in range(4, 16)]
    expected = [o.token_ids for o in eager.generate(many, SamplingParams(max_tokens=6))]
    assert [o.token_ids for o in graphs.generate(many, SamplingParams(max_tokens=6))] == expected
