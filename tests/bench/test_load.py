"""200 concurrent streams against a live server: cancellations and bad requests
mixed in must not cost any other request a token, and must leak no KV.

Invariants 1 (determinism under any batch), 4 (nothing leaks) and 5 (bad input
gets a 4xx, the server loses no other request), under load. The mix is the one
`swallow bench load` measures (bench/load_mix.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from swallow.cli import main
from bench.load_mix import (
    GenerationSpec,
    LoadRequest,
    ModelShape,
    StreamRequest,
    build_mix,
    flush_cache,
    output_mismatches,
    pool_leaks,
    run_mix,
    summarize,
    unique_specs,
    wait_idle,
)
from llm_core import LLM, SamplingParams
from tests.api.live import live_server

CONCURRENCY = 200
# One intra-op thread, for the server and the reference: on a small shared machine
# torch's default (one per core) spends most of a tiny model's step fighting for cores.
ONE_THREAD_ENV = os.environ | {"OMP_NUM_THREADS": "1"}


@contextmanager
def _one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def mix(tiny_checkpoint: Path) -> list[LoadRequest]:
    return build_mix(CONCURRENCY, ModelShape.of_checkpoint(tiny_checkpoint), seed=0)


@pytest.fixture(scope="module")
def served_alone(tiny_checkpoint: Path, mix: list[LoadRequest]) -> dict[GenerationSpec, list[int]]:
    """Each unique request generated offline on its own: the tokens a loaded server must match."""
    llm = LLM(tiny_checkpoint)
    with _one_torch_thread():
        return {
            spec: llm.generate([list(spec.prompt)], SamplingParams(max_tokens=spec.max_tokens, ignore_eos=True))[0]
            .token_ids
            for spec in unique_specs(mix)
        }


def test_the_mix_has_what_the_load_test_relies_on(mix: list[LoadRequest]) -> None:
    good = [r for r in mix if isinstance(r, StreamRequest)]
    bad_kinds = {r.kind for r in mix if not isinstance(r, StreamRequest)}
    assert len(bad_kinds) == 5 and len(mix) - len(good) == 10
    assert sum(r.cancel_after_tokens is not None for r in good) == round(0.3 * len(good))
    specs = unique_specs(mix)
    assert len(specs) <= 40 < len(good)  # repeats: the reference stays cheap and cache hits happen
    prefixes = {s.prompt[:32] for s in specs}
    assert len(prefixes) < len(specs)  # some prompts share a prefix


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-prefix-cache", "prefix-cache"])
def test_200_streams_with_cancels_and_bad_requests(
    tiny_checkpoint: Path, mix: list[LoadRequest], served_alone: dict[GenerationSpec, list[int]],
    prefix_caching: bool,
) -> None:
    options = () if prefix_caching else ("--no-prefix-caching",)
    with live_server(tiny_checkpoint, *options, env=ONE_THREAD_ENV) as server:
        started = time.perf_counter()
        results = asyncio.run(run_mix(server.url, mix, CONCURRENCY, time_limit_s=90, request_timeout_s=60))
        summary = summarize(results, time.perf_counter() - started)
        idle = wait_idle(server.url)
        # Without a prefix cache nothing may be held once idle; with one, nothing after a flush.
        settled = flush_cache(server.url) if prefix_caching else idle
        log = server.log()

    assert summary["errors_5xx"] == 0, [(r.index, r.kind, r.status, r.error) for r in results if (r.status or 0) >= 500]
    bad = [r for r in results if r.kind != "stream"]
    answered = [r for r in bad if r.status and 400 <= r.status < 500 and '"message"' in (r.error or "")]
    assert [(r.kind, r.status, r.error) for r in bad if r not in answered] == []  # each a 4xx with a reason
    good = [r for r in results if r.kind == "stream"]
    assert [(r.index, r.status, r.outcome, r.error) for r in good if r.outcome not in ("completed", "cancelled")] == []
    assert summary["cancelled"] == sum(r.cancel_after_tokens is not None for r in mix if isinstance(r, StreamRequest))
    assert output_mismatches(mix, results, served_alone) == []
    assert pool_leaks(settled) == {}, settled
    assert settled["running_requests"] == settled["waiting_requests"] == 0
    if prefix_caching:
        assert idle["prefix_cache"]["cached_prompt_tokens"] > 0  # the shared prefixes were hit
    # A client leaving mid-stream is not a server error: nothing may be logged as one.
    assert "Traceback" not in log, log[-4000:]


def test_bench_load_prints_one_json_object_and_a_plot(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the server subprocess inherits it
    plot = tmp_path / "load.png"
    argv = ["bench", "load", "--model", str(tiny_checkpoint), "--levels", "1,4", "--load-requests", "16",
            "--repeats", "1", "--json", "--plot", str(plot)]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result["levels"]) == {"1", "4"}
    for figures in result["levels"].values():
        assert {"completed", "errors_5xx", "ttft_p50_s", "ttft_p90_s", "itl_p90_s", "output_tok_s",
                "throughput_vs_c1"} <= set(figures)
        assert figures["errors_5xx"] == 0 and figures["token_mismatches"] == 0
        assert figures["kv_held_after_flush"] == {}
    assert result["levels"]["1"]["throughput_vs_c1"] == 1.0
    assert plot.stat().st_size > 10_000
