"""Prefix-cache hit rates on real workload traces, through the cache simulator.

Traces record block hash ids instead of text: each block id becomes a fixed
run of token ids (unique to that id), so two requests share exactly the
leading blocks the trace says they share. Partial last blocks and outputs get
fresh tokens that nothing else shares.

With host and disk tiers (``host_tokens``, ``disk_tokens``: budgets in
tokens of full-layer KV) the cache demotes what the device evicts and
restores it on a hit; a checkpoint window's SWA positions are charged at
the model's SWA-to-full byte ratio (``swa_token_cost``).
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llm_core.sched.cache_sim import POLICIES, CacheSimulator, Policy

MIMO_WINDOW = 129  # keys a MiMo-V2 SWA query sees (W = 128 plus itself)


@dataclass(frozen=True)
class TraceRequest:
    arrival: float  # seconds
    blocks: tuple[tuple[str, int], ...]  # (scope, hash id) of each full block
    block_size: int
    input_tokens: int
    output_tokens: int
    # Requests of one agent session ("" for none): each is sent only once the
    # previous one is answered (replays with a clock keep that order).
    session: str = ""


def load_trace(path: str | Path, stagger_s: float = 60.0) -> list[TraceRequest]:
    """Agentic session files (a directory: sessions start ``stagger_s`` apart
    and interleave by time) or a Mooncake-style JSONL file."""
    path = Path(path)
    requests: list[TraceRequest] = []
    if path.is_dir():
        for k, file in enumerate(sorted(path.glob("*.json"))):
            data = json.loads(file.read_text())
            scope = file.stem if data.get("hash_id_scope", "local") == "local" else ""
            bs = int(data["block_size"])
            for r in data["requests"]:
                requests.append(TraceRequest(k * stagger_s + float(r["t"]),
                                             tuple((scope, h) for h in r["hash_ids"][: r["in"] // bs]),
                                             bs, int(r["in"]), int(r["out"]), file.stem))
    else:
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            r = json.loads(line)
            bs = 512
            n_full = r["input_length"] // bs
            requests.append(TraceRequest(r["timestamp"] / 1000.0, tuple(("", h) for h in r["hash_ids"][:n_full]),
                                         bs, int(r["input_length"]), int(r["output_length"])))
    requests.sort(key=lambda q: q.arrival)
    return requests


class TokenFactory:
    """Token ids for trace blocks (stable per block) and fresh ones (never shared)."""

    def __init__(self) -> None:
        self._block_ids: dict[tuple[str, int], int] = {}
        self._fresh = itertools.count(-1, -1)

    def block(self, key: tuple[str, int], size: int) -> range:
        uid = self._block_ids.setdefault(key, len(self._block_ids))
        return range(uid * size, (uid + 1) * size)

    def fresh(self, n: int) -> list[int]:
        return [next(self._fresh) for _ in range(n)]

    def request(self, req: TraceRequest) -> tuple[list[int], list[int]]:
        prompt: list[int] = []
        for key in req.blocks:
            prompt.extend(self.block(key, req.block_size))
        prompt.extend(self.fresh(req.input_tokens - len(prompt)))
        return prompt, self.fresh(max(req.output_tokens, 1))


def trace_page_size(requests: list[TraceRequest]) -> int:
    """Pages are the trace's blocks: sharing is only known block by block."""
    sizes = {r.block_size for r in requests}
    if len(sizes) != 1:
        raise ValueError(f"trace mixes block sizes {sorted(sizes)}")
    return sizes.pop()


def upper_bound(requests: list[TraceRequest]) -> float:
    """Hit rate of an infinite cache with page-aligned prefix matching."""
    page_size = trace_page_size(requests)
    factory = TokenFactory()
    # A page's tokens are determined by its first one (blocks are page-aligned).
    children: dict[tuple[int, int], int] = {}
    cached = total = 0
    for req in requests:
        prompt, output = factory.request(req)
        tokens = prompt + output
        node, hit = 0, 0
        limit = (len(prompt) - 1) // page_size
        for i in range(len(tokens) // page_size):
            key = (node, tokens[i * page_size])
            child = children.get(key)
            if child is None:
                child = children[key] = len(children) + 1
            elif i == hit and i < limit:
                hit += 1
            node = child
        cached += hit * page_size
        total += len(prompt)
    return cached / total if total else 0.0


def swa_token_cost(preset: str = "mimo-v2-flash") -> float:
    """Bytes of one position of SWA (and MTP) KV over one of full-layer KV."""
    import torch

    from llm_core.kv.paged_attention import KVCacheTensors
    from llm_core.model.presets import get_preset

    tensors = KVCacheTensors(get_preset(preset), 0, 0, torch.bfloat16, "meta")
    return tensors.swa_bytes_per_token / tensors.full_bytes_per_token


def simulate(
    requests: list[TraceRequest],
    policy: Policy,
    full_tokens: int,
    swa_tokens: int,
    window: int = MIMO_WINDOW,
    checkpoint_interval: int | None = None,
    host_tokens: int = 0,
    disk_tokens: int = 0,
    swa_cost: float = 1.0,
) -> dict[str, Any]:
    page_size = trace_page_size(requests)
    interval = checkpoint_interval if policy == "window" else None
    sim = CacheSimulator(page_size, window, full_tokens, swa_tokens, policy, checkpoint_interval=interval,
                         verify=True, page_identity="first_token", host_tokens=host_tokens,
                         disk_tokens=disk_tokens, swa_token_cost=swa_cost)
    factory = TokenFactory()
    for req in requests:
        sim.run(*factory.request(req))
    r = sim.result
    tiers = sim.tier_stats()
    return {
        "policy": policy,
        "hit_rate": round(r.hit_rate, 4),
        "hit_rate_by_tier": {t: round(n / r.prompt_tokens, 4) if r.prompt_tokens else 0.0
                             for t, n in r.cached_tokens_by_tier.items()},
        "host_tokens": host_tokens,
        "disk_tokens": disk_tokens,
        "tiers": tiers,
        "full_pool_tokens": full_tokens,
        "swa_pool_tokens": swa_tokens,
        "peak_full_tokens": r.peak_full_tokens,
        "peak_swa_tokens": r.peak_swa_tokens,
        "failed_requests": r.failed,
        "hits_verified": r.verified_hits,
        "false_hits": r.false_hits,
    }


def prefix_cache_bench(
    trace: str | Path,
    full_tokens: int = 4_000_000,
    swa_fraction: float = 0.05,
    window: int = MIMO_WINDOW,
    checkpoint_interval: int | None = 4096,
    limit: int | None = None,
    host_tokens: int = 0,
    disk_tokens: int = 0,
    preset: str = "mimo-v2-flash",
) -> dict[str, Any]:
    """The window-safe cache (with tiers when ``host_tokens``) against the
    baselines, and the infinite-cache bound, on one trace."""
    requests = load_trace(trace)[:limit]
    swa_tokens = int(full_tokens * swa_fraction)
    cost = swa_token_cost(preset)
    ours = simulate(requests, "window", full_tokens, swa_tokens, window, checkpoint_interval,
                    host_tokens, disk_tokens, cost)
    baselines = {}
    if host_tokens:
        device = simulate(requests, "window", full_tokens, swa_tokens, window, checkpoint_interval)
        baselines["window_device_only"] = device
    baselines["keep_all_swa_full_size_pool"] = simulate(requests, "keep_all", full_tokens, full_tokens, window)
    baselines["tombstones_no_checkpoints_no_fallback"] = simulate(requests, "no_checkpoints", full_tokens,
                                                                  swa_tokens, window)
    bound = upper_bound(requests)
    tiers = {"host_tokens": host_tokens, "disk_tokens": disk_tokens, "swa_token_cost": round(cost, 4),
             "hit_rate_by_tier": ours["hit_rate_by_tier"], "stats": ours["tiers"],
             "hit_rate_device_only": baselines["window_device_only"]["hit_rate"]} if host_tokens else {}
    return {
        "trace": str(trace),
        "requests": len(requests),
        "prompt_tokens": sum(r.input_tokens for r in requests),
        "page_size": trace_page_size(requests),
        "window": window - 1,
        "checkpoint_interval": checkpoint_interval,
        "hit_rate": ours["hit_rate"],
        "hit_rate_by_tier": ours["hit_rate_by_tier"],
        "upper_bound": round(bound, 4),
        "gap_to_upper_bound": round(bound - ours["hit_rate"], 4),
        "false_hits": ours["false_hits"],
        "hits_verified": ours["hits_verified"],
        "peak_full_tokens": ours["peak_full_tokens"],
        "peak_swa_tokens": ours["peak_swa_tokens"],
        "swa_pool_tokens": swa_tokens,
        **tiers,
        "baselines": baselines,
        "policy": ours,
    }


def sweep(
    trace: str | Path,
    fractions: list[float],
    full_tokens: int = 4_000_000,
    window: int = MIMO_WINDOW,
    checkpoint_interval: int | None = 4096,
    limit: int | None = None,
) -> Iterator[dict[str, Any]]:
    """Hit rate against SWA pool size (fraction of the full pool), per policy."""
    requests = load_trace(trace)[:limit]
    for fraction in fractions:
        for policy in POLICIES:
            swa = int(full_tokens * fraction)
            yield {"swa_fraction": fraction,
                   **simulate(requests, policy, full_tokens, swa, window, checkpoint_interval)}


def plot_sweep(points: list[dict[str, Any]], bound: float, out: str | Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {
        "window": "window-safe checkpoints + fallback (Swallow)",
        "keep_all": "SWA kept for every cached token",
        "no_checkpoints": "tombstones, no checkpoints, no fallback",
    }
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for policy in POLICIES:
        xs = [p["swa_fraction"] * 100 for p in points if p["policy"] == policy]
        ys = [p["hit_rate"] for p in points if p["policy"] == policy]
        ax.plot(xs, ys, marker="o", label=labels[policy])
    _finish_plot(fig, ax, bound, "SWA pool size (% of full pool)", title, out)


def _finish_plot(fig: Any, ax: Any, bound: float, xlabel: str, title: str, out: str | Path) -> None:
    """The bound line, log x axis, labels and legend, saved as a PNG."""
    import matplotlib.pyplot as plt

    ax.axhline(bound, color="grey", linestyle="--", label=f"upper bound (infinite cache) {bound:.3f}")
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("prompt-token hit rate")
    ax.set_ylim(0, 1)
    ax.set_title(title)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def tier_sweep(
    trace: str | Path,
    host_sizes: list[int],
    full_tokens: int = 4_000_000,
    swa_fraction: float = 0.05,
    disk_tokens: int = 0,
    window: int = MIMO_WINDOW,
    checkpoint_interval: int | None = 4096,
    limit: int | None = None,
    preset: str = "mimo-v2-flash",
) -> Iterator[dict[str, Any]]:
    """Hit rate (and its part per tier) against the host tier's size."""
    requests = load_trace(trace)[:limit]
    cost = swa_token_cost(preset)
    for host in host_sizes:
        point = simulate(requests, "window", full_tokens, int(full_tokens * swa_fraction), window,
                         checkpoint_interval, host, disk_tokens if host else 0, cost)
        yield {k: point[k] for k in ("host_tokens", "disk_tokens", "hit_rate", "hit_rate_by_tier", "false_hits")}


def plot_tier_sweep(points: list[dict[str, Any]], bound: float, device_tokens: int, out: str | Path,
                    title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    tiered = [p for p in points if p["host_tokens"]]
    xs = [p["host_tokens"] / 1e6 for p in tiered]
    ax.plot(xs, [p["hit_rate"] for p in tiered], marker="o", label="hit rate (device + host)")
    ax.plot(xs, [p["hit_rate_by_tier"]["host"] for p in tiered], marker=".", linestyle=":",
            label="of which restored from host memory")
    for p in points:
        if not p["host_tokens"]:
            ax.axhline(p["hit_rate"], color="tab:red", linestyle=":", label=f"device pool alone {p['hit_rate']:.3f}")
    _finish_plot(fig, ax, bound, f"host tier size (M tokens of full-layer KV; device pool {device_tokens / 1e6:g}M)",
                 title, out)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", required=True, help="agentic session directory or Mooncake .jsonl")
    parser.add_argument("--full-pool-tokens", type=int, default=4_000_000, help="full pool")
    parser.add_argument("--swa-fraction", type=float, default=0.05, help="SWA pool / full pool")
    parser.add_argument("--checkpoint-interval", type=int, default=4096, help="0 for none")
    parser.add_argument("--limit", type=int, help="first N requests only")
    parser.add_argument("--plot", help="also sweep SWA pool sizes and save a PNG here")
    parser.add_argument("--sweep", default="0.005,0.01,0.02,0.05,0.1,0.25,1.0", help="SWA pool fractions for --plot")
    parser.add_argument("--host-tokens", type=int, default=0,
                        help="host-memory tier, in tokens of full-layer KV (0: none)")
    parser.add_argument("--disk-tokens", type=int, default=0, help="disk tier, in tokens of full-layer KV (0: none)")
    parser.add_argument("--tier-plot", help="also sweep host tier sizes (no disk) and save a PNG here")
    parser.add_argument("--host-sweep", default="0,4e6,8e6,16e6,32e6,64e6,128e6,256e6",
                        help="host tier sizes (tokens) for --tier-plot")


def run(args: argparse.Namespace) -> dict[str, Any]:
    interval = args.checkpoint_interval or None
    result = prefix_cache_bench(args.trace, args.full_pool_tokens, args.swa_fraction, checkpoint_interval=interval,
                                limit=args.limit, host_tokens=args.host_tokens, disk_tokens=args.disk_tokens)
    if args.tier_plot:
        sizes = [int(float(x)) for x in args.host_sweep.split(",")]
        # Host memory alone at each size: the curve is what host memory buys.
        points = list(tier_sweep(args.trace, sizes, args.full_pool_tokens, args.swa_fraction, 0,
                                 checkpoint_interval=interval, limit=args.limit))
        plot_tier_sweep(points, result["upper_bound"], args.full_pool_tokens, args.tier_plot,
                        f"{Path(args.trace).name}: hit rate vs host tier")
        result["tier_sweep"] = points
        result["tier_plot"] = args.tier_plot
    if args.plot:
        fractions = [float(f) for f in args.sweep.split(",")]
        points = list(sweep(args.trace, fractions, args.full_pool_tokens, checkpoint_interval=interval,
                            limit=args.limit))
        plot_sweep(points, result["upper_bound"], args.plot, f"{Path(args.trace).name}: hit rate vs SWA pool")
        result["sweep"] = [{k: p[k] for k in ("swa_fraction", "policy", "hit_rate", "failed_requests")}
                           for p in points]
        result["plot"] = args.plot
    return result
