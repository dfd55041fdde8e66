"""`swallow bench pd`: prefill/decode disaggregation, measured.

Three figures, each against its baseline in the same run:

* **Transfer size.** Bytes a decode worker received per request against what
  a full-attention-style transfer of the same prompts would send (every
  layer's KV for every position): ``transfer_ratio_demo``, from the decode
  worker's own counters during the latency run below; and, through the same
  transfer planning (``llm_core.cluster.disagg.plan_for_config``), the MiMo-V2.5-Pro
  shape at 32K and 128K tokens (``transfer_ratio_pro_32k``,
  ``transfer_ratio_pro_128k``): SWA layers send their window only.
* **Transfer time against bytes.** Each transport (shared memory; gloo
  point-to-point) moves blobs of several sizes from another process; the
  bandwidth achieved is compared with a raw in-process copy of the same
  bytes (``bandwidth``).
* **Decode inter-token latency under long prefills.** Streaming decodes run
  while long prompts keep arriving; p90 of the gaps between a stream's
  tokens with one prefill worker and one decode worker
  (``itl_p90_pd_s``) against two workers doing both
  (``itl_p90_colocated_s``): the same processes and machine, only the roles
  differ. Greedy answers of the decode streams must agree between the two.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch

from api.launch import launch_stack
from api.models import DEMO_MODEL_DIR
from llm_core.cluster.disagg import plan_for_config
from llm_core.cluster.kv_transport import SharedMemoryTransport, TorchDistributedTransport, make_transport
from llm_core.model.presets import get_preset
from llm_core.model.tokenizer import Tokenizer

__all__ = ["PDLoad", "pd_bench", "pro_transfer_ratios", "transport_bandwidth"]

_WORDS = ("red blue green circle square moves left right up down fast slow bird cat dog sound beep frame "
          "clip video image picture small large bright dark the a of and then over under").split()


@dataclass(frozen=True)
class PDLoad:
    decode_streams: int = 4  # concurrent streaming requests whose gaps are measured
    decode_tokens: int = 300  # tokens each generates (EOS ignored)
    prefill_tokens: int = 900  # prompt length of each long prefill
    prefill_interval_s: float = 0.1  # a new long prompt this often while the streams run (open loop)
    seed: int = 0


def pro_transfer_ratios(contexts: Sequence[int] = (32768, 131072)) -> dict[str, Any]:
    """The MiMo-V2.5-Pro shape's planned transfer at each context (BF16 KV,
    64-token pages, MTP on): bytes against a full-attention-style transfer."""
    config = get_preset("mimo-v2.5-pro")
    out: dict[str, Any] = {}
    for n in contexts:
        plan = plan_for_config(config, n)
        out[f"{n // 1024}k"] = {"tokens": n, "bytes": plan.bytes, "full_attention_bytes": plan.full_attention_bytes,
                                "swa_window_tokens": plan.swa_tokens, "ratio": round(plan.ratio, 4)}
    return out


# ------------------------------------------------------------- bandwidth
def _send_loop(name: str, sizes: Sequence[int], conn: Any) -> None:
    transport = make_transport(name)
    blobs = {n: torch.randint(0, 256, (n,), dtype=torch.uint8) for n in sizes}
    while (ticket := conn.recv()) is not None:
        transport.send(ticket, blobs[ticket.nbytes], timeout=60)
        conn.send(ticket.transfer_id)
    time.sleep(0.2)
    transport.close()


def _raw_copy_seconds(n: int, repeats: int) -> float:
    src, dst = torch.randint(0, 256, (n,), dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - started)
    return best


def transport_bandwidth(sizes: Sequence[int] = (1 << 20, 16 << 20, 64 << 20), repeats: int = 5) -> dict[str, Any]:
    """Per transport and size: the best of ``repeats`` transfers from another
    process (from handing the ticket over to holding the bytes) against the
    best raw copy of as many bytes here."""
    out: dict[str, Any] = {"raw_copy": {}}
    for n in sizes:
        seconds = _raw_copy_seconds(n, repeats)
        out["raw_copy"][str(n)] = {"seconds": seconds, "gb_per_s": round(n / seconds / 1e9, 3)}
    context = mp.get_context("spawn")
    for name in ("shm", "torch"):
        receiver = SharedMemoryTransport() if name == "shm" else TorchDistributedTransport(timeout=60)
        here, there = context.Pipe()
        sender = context.Process(target=_send_loop, args=(name, list(sizes), there), daemon=True)
        sender.start()
        rows: dict[str, Any] = {}
        try:
            for n in sizes:
                best = float("inf")
                for _ in range(repeats + 1):  # the first one meets the peer (and maps the buffer)
                    slot = receiver.open_receive(n, peer="bench")
                    started = time.perf_counter()
                    here.send(slot.ticket)
                    here.recv()  # "sent", as a prefill worker's answer says it
                    slot.result(timeout=120)
                    best = min(best, time.perf_counter() - started)
                    slot.close()
                raw = out["raw_copy"][str(n)]["seconds"]
                rows[str(n)] = {"seconds": best, "gb_per_s": round(n / best / 1e9, 3),
                                "of_raw_copy": round(raw / best, 3)}
        finally:
            here.send(None)
            sender.join(30)
            receiver.close()
        out[name] = rows
    return out


# ------------------------------------------------------------- latency
def _long_prompt(tokenizer: Tokenizer, length: int, rng: random.Random) -> str:
    words = [rng.choice(_WORDS) for _ in range(length * 2)]
    text = " ".join(words)
    ids = tokenizer.encode(text)[:length]
    return tokenizer.decode(ids)


async def _decode_stream(client: httpx.AsyncClient, prompt: str, tokens: int) -> tuple[list[float], list[int]]:
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    gaps: list[float] = []
    token_ids: list[int] = []
    last: float | None = None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            payload = json.loads(line.removeprefix("data: "))
            ids = payload["choices"][0].get("token_ids") or []
            if not ids:
                continue
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
            token_ids.extend(ids)
    return gaps, token_ids


async def _timed_prefill(client: httpx.AsyncClient, prompt: str) -> float | None:
    started = time.perf_counter()
    response = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0})
    return time.perf_counter() - started if response.status_code == 200 else None


async def _long_prefills(client: httpx.AsyncClient, prompts: list[str], interval_s: float,
                         running: asyncio.Event) -> list[float]:
    """Long prompts arriving every ``interval_s`` while ``running``: each one's latency (its TTFT)."""
    sent: list[asyncio.Task[float | None]] = []
    for prompt in prompts:
        if not running.is_set():
            break
        sent.append(asyncio.create_task(_timed_prefill(client, prompt)))
        await asyncio.sleep(interval_s)
    done = await asyncio.gather(*sent, return_exceptions=True)
    return [t for t in done if isinstance(t, float)]


async def _run_load(url: str, streams: list[str], prefills: list[str], load: PDLoad) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        # Warm-up: every worker has run a forward of each kind before timing.
        await asyncio.gather(*[client.post("/v1/completions", json={"prompt": p, "max_tokens": 4, "temperature": 0})
                               for p in streams[:2] + prefills[:2]])
        running = asyncio.Event()
        running.set()
        decodes = asyncio.gather(*[_decode_stream(client, p, load.decode_tokens) for p in streams])
        prefilling = asyncio.create_task(_long_prefills(client, prefills[2:], load.prefill_interval_s, running))
        results = await decodes
        running.clear()
        prefill_seconds = await prefilling
        stats = (await client.get("/stats")).json()
    gaps = [g for stream_gaps, _ in results for g in stream_gaps]
    return {"gaps": gaps, "answers": [ids for _, ids in results], "prefill_seconds": prefill_seconds,
            "stats": stats}


def _latency_figures(gaps: Sequence[float]) -> dict[str, float]:
    values = np.asarray(gaps)
    return {"itl_p50_s": round(float(np.percentile(values, 50)), 5),
            "itl_p90_s": round(float(np.percentile(values, 90)), 5),
            "itl_p99_s": round(float(np.percentile(values, 99)), 5), "gaps": int(values.size)}


def _quiet_stdout(fn: Callable[[], Any]) -> Any:
    """``fn()`` with file descriptor 1 pointed at stderr: gloo prints its
    connections there from C++, and this command's stdout is its JSON."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        return fn()
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def pd_bench(model_dir: str | Path, load: PDLoad = PDLoad(), transport: str = "shm",
             bandwidth_sizes: Sequence[int] = (1 << 20, 16 << 20, 64 << 20), worker_threads: int = 1) -> dict[str, Any]:
    tokenizer = Tokenizer.from_model_dir(Path(model_dir))
    rng = random.Random(load.seed)
    streams = [f"Story {i}: " + _long_prompt(tokenizer, 24, rng) for i in range(load.decode_streams)]
    runs = max(8, int(load.decode_tokens * 0.15 / load.prefill_interval_s) + 8)
    prefills = [f"{i} " + _long_prompt(tokenizer, load.prefill_tokens, rng) for i in range(runs + 2)]
    # One core per worker, as each would have its own accelerator: the roles differ, not the hardware.
    threads = ("--torch-threads", str(worker_threads))
    shapes = {"pd": ("--prefill-workers", "1", "--decode-workers", "1", "--kv-transport", transport, *threads),
              "colocated": ("--workers", "2", *threads)}
    measured: dict[str, dict[str, Any]] = {}
    for name, args in shapes.items():
        with launch_stack(model_dir, *args, encoders=0) as stack:
            measured[name] = asyncio.run(_run_load(stack.url, streams, prefills, load))
    decode = next(w for w in measured["pd"]["stats"]["workers"].values() if w.get("role") == "decode")
    moved = decode["disaggregation"]
    pro = pro_transfer_ratios()
    return {
        "transfer_ratio_demo": round(moved["bytes_received"] / moved["full_attention_bytes_received"], 4)
        if moved["full_attention_bytes_received"] else None,
        "transfer_ratio_pro_32k": pro["32k"]["ratio"],
        "transfer_ratio_pro_128k": pro["128k"]["ratio"],
        "itl_p90_pd_s": _latency_figures(measured["pd"]["gaps"])["itl_p90_s"],
        "itl_p90_colocated_s": _latency_figures(measured["colocated"]["gaps"])["itl_p90_s"],
        "decode_answers_identical": measured["pd"]["answers"] == measured["colocated"]["answers"],
        "transfers": {"requests": moved["received"], "bytes": moved["bytes_received"],
                      "full_attention_bytes": moved["full_attention_bytes_received"],
                      "fallbacks": moved["fallbacks"], "transport": transport},
        "pro_shape": pro,
        # The other side of the trade: one prefill worker instead of two serves the long prompts.
        "latency": {name: _latency_figures(run["gaps"]) | {
            "long_prefills": len(run["prefill_seconds"]),
            "long_prefill_p50_s": round(float(np.percentile(run["prefill_seconds"], 50)), 4)
            if run["prefill_seconds"] else None} for name, run in measured.items()},
        "bandwidth": _quiet_stdout(lambda: transport_bandwidth(bandwidth_sizes)),
        "load": load.__dict__ | {"worker_threads": worker_threads},
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="checkpoint to serve (default: the demo model)")
    parser.add_argument("--pd-streams", type=int, default=4, help="streaming decodes measured")
    parser.add_argument("--pd-decode-tokens", type=int, default=300, help="tokens each streaming decode generates")
    parser.add_argument("--pd-prefill-interval", type=float, default=0.1,
                        help="seconds between long prompts arriving while the decodes run")
    parser.add_argument("--kv-transport", default="shm", choices=["shm", "torch"],
                        help="how the decode worker receives KV")


def run(args: argparse.Namespace) -> dict[str, Any]:
    load = PDLoad(decode_streams=args.pd_streams, decode_tokens=args.pd_decode_tokens,
                  prefill_interval_s=args.pd_prefill_interval)
    return pd_bench(args.model or DEMO_MODEL_DIR, load, transport=args.kv_transport)
