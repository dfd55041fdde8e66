"""Which benches `swallow bench NAME` runs: a name, the module that owns the
bench's options and run, and a line of help. A bench's module is imported
only when that bench runs, so the command line stays quick to start."""

from __future__ import annotations

import argparse
import importlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any


@dataclass(frozen=True)
class Bench:
    name: str
    module: str  # defines add_arguments(parser) and run(args) -> dict
    help: str

    def load(self) -> ModuleType:
        return importlib.import_module(self.module)


BENCHES: tuple[Bench, ...] = (
    Bench("throughput", "bench.throughput", "offline tokens/s against transformers on the same checkpoint"),
    Bench("serve", "bench.serve", "the served engine against itself offline (and vLLM's server with --peer-vllm)"),
    Bench("load", "bench.load", "a live server under the load mix at rising concurrency"),
    Bench("kv", "bench.kv", "requests of a context a KV budget holds: hybrid SWA pools against full attention"),
    Bench("prefix-cache", "bench.prefix_cache", "window-safe prefix cache hit rate on a trace"),
    Bench("tiers", "bench.tiers", "restoring cached prefixes from host memory and disk against recomputing them"),
    Bench("schedule", "bench.schedule", "schedule policies' TTFT on trace replay"),
    Bench("router", "bench.router", "KV-affinity routing against round robin and least load on trace replay"),
    Bench("stack", "bench.stack", "multi-turn conversations through `swallow stack`, per route policy"),
    Bench("step", "bench.step", "host-side cost of a decode step (the forward excluded) at growing contexts"),
    Bench("mtp", "bench.mtp", "MTP speculative decoding against none on the demo model"),
    Bench("structured", "bench.structured", "what constrained decoding costs against free decoding"),
    Bench("ep", "bench.ep", "expert parallelism: identical tokens and step time per group size"),
    Bench("pd", "bench.pd", "prefill/decode disaggregation: decode streams while long prompts arrive"),
    Bench("fp8", "bench.fp8",
          "the published FP8 checkpoints end to end: identical tokens, memory, KV capacity, the demo eval"),
    Bench("video", "bench.video", "chunked video sampling against the PyAV loop a user writes"),
    Bench("image", "bench.image", "batched image decode and preprocessing against a per-image PIL loop"),
    Bench("encoder", "bench.encoder", "encoder batching across requests, and embedding-cache hits"),
)
BENCHES_BY_NAME = {bench.name: bench for bench in BENCHES}


def bench_parser(name: str) -> argparse.ArgumentParser:
    """The options of bench ``name``, as `swallow bench NAME` takes them."""
    bench = BENCHES_BY_NAME[name]
    parser = argparse.ArgumentParser(prog=f"swallow bench {name}", description=bench.help)
    parser.add_argument("--json", action="store_true", help="one-line JSON")
    bench.load().add_arguments(parser)
    return parser


def run_bench(name: str, argv: Sequence[str]) -> int:
    """`swallow bench NAME ARGV...`: runs it and prints its JSON object."""
    args = bench_parser(name).parse_args(list(argv))
    result: dict[str, Any] = BENCHES_BY_NAME[name].load().run(args)
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


def add_bench_command(commands: Any) -> None:
    """`swallow bench NAME ...` on the command line's sub-commands."""
    parser = commands.add_parser("bench", help="run a benchmark; prints one JSON object",
                                 description="benchmarks: " + "; ".join(f"{b.name}: {b.help}" for b in BENCHES))
    parser.add_argument("name", choices=list(BENCHES_BY_NAME))
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="the bench's own options (NAME --help)")
    parser.set_defaults(func=lambda args: run_bench(args.name, args.bench_args))
