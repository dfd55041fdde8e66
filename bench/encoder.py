"""``swallow bench encoder``: cross-request batching and embedding-cache hits.

Throughput: ``concurrency`` clients each send a stream of single-item requests
(images of a few sizes, short video clips, audio clips) to demo-size vision and
audio encoders. Batched = every request goes through ``EncoderBatcher``;
baseline = the same items encoded one request at a time (one forward each),
which is what a server without cross-request batching does. Inputs are
preprocessed before the clock starts, so only the encoder stage is compared.

Cache: a 1 MiB embedding is stored in a ``SharedEmbeddingStore`` and read back;
hit latency is measured for the store itself and for the whole upload-key hit
path of ``MediaEmbedder.embed_image`` (hash the file, two lookups, copy out).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import statistics
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from encoders.audio import AudioEncoder, AudioInput
from encoders.batcher import BatcherConfig, EncoderBatcher
from encoders.presets import DEMO_AUDIO, DEMO_PREPROCESS, DEMO_VIDEO_MAX_FRAMES, DEMO_VISION
from encoders.vision import VisionEncoder, VisionInput
from media import VisionPreprocessConfig, preprocess_images, preprocess_video

EMBEDDING_BYTES = 1 << 20


@dataclass(frozen=True)
class _Request:
    kind: str  # encoder kind: "vision" | "audio"
    item: Any


def _workload(num_requests: int, seed: int) -> list[_Request]:
    """The demo's traffic: 56..84 px pictures, 8-frame clips of 56 px, 1..3 s sounds."""
    rng = np.random.default_rng(seed)
    out: list[_Request] = []
    for i in range(num_requests):
        choice = i % 4
        if choice in (0, 1):
            h, w = (int(rng.integers(2, 4)) * 28 for _ in range(2))
            img = torch.from_numpy(rng.integers(0, 256, (3, h, w), dtype=np.uint8))
            batch = preprocess_images([img], DEMO_PREPROCESS)
        elif choice == 2:
            frames = torch.from_numpy(rng.integers(0, 256, (DEMO_VIDEO_MAX_FRAMES, 56, 56, 3), dtype=np.uint8))
            batch = preprocess_video(frames, DEMO_PREPROCESS)
        else:
            frames = int(rng.integers(100, 301))  # 10 ms mel frames
            features = torch.from_numpy(rng.standard_normal((1, DEMO_AUDIO.num_mel_bins, DEMO_AUDIO.chunk_frames)))
            out.append(_Request("audio", AudioInput(features.float(), frames)))
            continue
        out.append(_Request("vision", VisionInput(batch.pixel_values, tuple(batch.grid_thw[0].tolist()))))
    return out


def _encoders(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    return {"vision": VisionEncoder(DEMO_VISION).eval(), "audio": AudioEncoder(DEMO_AUDIO).eval()}


async def _serve(
    encoders: dict[str, Any], requests: list[_Request], concurrency: int, config: BatcherConfig
) -> tuple[float, list[torch.Tensor], dict[str, Any]]:
    """``concurrency`` clients, each sending its share of ``requests`` one after another."""
    batcher = EncoderBatcher(encoders, config)
    outs: list[torch.Tensor | None] = [None] * len(requests)

    async def client(c: int) -> None:
        for i in range(c, len(requests), concurrency):
            outs[i] = await batcher.encode(requests[i].kind, requests[i].item)

    start = time.perf_counter()
    await asyncio.gather(*(client(c) for c in range(concurrency)))
    elapsed = time.perf_counter() - start
    stats = {
        kind: {"forwards": s.batches, "items": s.items, "mean_batch": round(s.items / max(1, s.batches), 2)}
        for kind, s in batcher.stats().items()
    }
    await batcher.aclose()
    return elapsed, outs, stats  # type: ignore[return-value]


def _best_run(
    encoders: dict[str, Any], requests: list[_Request], concurrency: int, config: BatcherConfig, repeats: int
) -> tuple[float, list[torch.Tensor], dict[str, Any]]:
    asyncio.run(_serve(encoders, requests[:32], concurrency, config))  # warm up kernels and allocators
    runs = [asyncio.run(_serve(encoders, requests, concurrency, config)) for _ in range(repeats)]
    return min(runs, key=lambda r: r[0])


def _throughput(concurrency: int, num_requests: int, repeats: int, seed: int, max_wait_ms: float) -> dict[str, Any]:
    """Both sides run the same service on the same worker thread; the baseline has one
    request in flight and never waits for company, so each forward encodes one item."""
    encoders = _encoders(seed)
    requests = _workload(num_requests, seed)
    single_s, single_out, single_stats = _best_run(encoders, requests, 1, BatcherConfig(max_wait_ms=0), repeats)
    batched_s, batched_out, stats = _best_run(
        encoders, requests, concurrency, BatcherConfig(max_wait_ms=max_wait_ms), repeats
    )
    max_diff = max(float((a - b).abs().max()) for a, b in zip(single_out, batched_out))
    tokens = sum(int(o.shape[0]) for o in single_out)
    return {
        "requests": num_requests,
        "concurrency": concurrency,
        "mix": {k: sum(r.kind == k for r in requests) for k in ("vision", "audio")},
        "output_tokens": tokens,
        "one_at_a_time_items_per_s": round(num_requests / single_s, 1),
        "batched_items_per_s": round(num_requests / batched_s, 1),
        "speedup": round(single_s / batched_s, 2),
        "batches": stats,
        "baseline_batches": single_stats,
        "max_abs_diff_batched_vs_single": max_diff,
    }


def _size_sweep(concurrency: int, seed: int, max_wait_ms: float) -> list[dict[str, Any]]:
    """How the gain shrinks as items grow: all-image workloads of one size each.
    Batching amortises per-forward overhead; a big item is compute-bound alone."""
    encoders = _encoders(seed)
    rng = np.random.default_rng(seed)
    out = []
    for side in (56, 112, 224):
        cfg = VisionPreprocessConfig(min_pixels=side * side, max_pixels=side * side)
        requests = []
        for _ in range(64):
            img = torch.from_numpy(rng.integers(0, 256, (3, side, side), dtype=np.uint8))
            batch = preprocess_images([img], cfg)
            requests.append(_Request("vision", VisionInput(batch.pixel_values, tuple(batch.grid_thw[0].tolist()))))
        single_s = _best_run(encoders, requests, 1, BatcherConfig(max_wait_ms=0), 1)[0]
        batched_s = _best_run(encoders, requests, concurrency, BatcherConfig(max_wait_ms=max_wait_ms), 1)[0]
        patches = requests[0].item.num_patches
        out.append({"image_px": side, "patches": patches, "speedup": round(single_s / batched_s, 2)})
    return out


def _latency_ms(fn: Any, n: int) -> dict[str, float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    times.sort()
    return {"p50_ms": round(statistics.median(times), 4), "p99_ms": round(times[int(0.99 * (n - 1))], 4)}


def _photo_jpeg(side: int, seed: int) -> bytes:
    """A photo-like JPEG (smooth gradients, soft noise): the size a real upload has."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:side, 0:side]
    base = np.stack([xx * 255 // (side - 1), yy * 255 // (side - 1), (xx + 2 * yy) % 256], -1)
    pixels = (base + rng.integers(-8, 8, (side, side, 3))).clip(0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def _cache_hits(seed: int, n: int) -> dict[str, Any]:
    from embedding_cache.service import MediaEmbedder, MediaEmbedderConfig
    from embedding_cache.store import SharedEmbeddingStore

    store = SharedEmbeddingStore.create(f"swallow-bench-{uuid.uuid4().hex[:12]}", 64 * EMBEDDING_BYTES)
    try:
        value = torch.randn(EMBEDDING_BYTES // (4 * 1024), 1024)
        key = bytes(range(32))
        store.put(key, value)
        assert torch.equal(store.get(key), value)
        store_latency = _latency_ms(lambda: store.get(key), n)

        # An image whose embedding is 1 MiB: 1024 tokens x 256 floats = 4096 patches (896 x 896 px).
        torch.manual_seed(seed)
        encoder = VisionEncoder(DEMO_VISION).eval()
        side = 896
        cfg = MediaEmbedderConfig(image=VisionPreprocessConfig(min_pixels=side * side, max_pixels=side * side))
        data = _photo_jpeg(side, seed)

        async def run() -> dict[str, Any]:
            batcher = EncoderBatcher([encoder])
            embedder = MediaEmbedder(batcher, store, cfg)
            t0 = time.perf_counter()
            miss = await embedder.embed_image(data)
            miss_ms = (time.perf_counter() - t0) * 1000
            times = []
            for _ in range(n):
                t0 = time.perf_counter()
                hit = await embedder.embed_image(data)
                times.append((time.perf_counter() - t0) * 1000)
                assert hit.cached and torch.equal(hit.tensor, miss.tensor)
            await batcher.aclose()
            embedder.close()
            times.sort()
            return {
                "embedding_bytes": miss.tensor.numel() * miss.tensor.element_size(),
                "file_bytes": len(data),
                "miss_ms": round(miss_ms, 1),
                "hit_p50_ms": round(statistics.median(times), 4),
                "hit_p99_ms": round(times[int(0.99 * (n - 1))], 4),
            }

        service = asyncio.run(run())
    finally:
        store.close()
        store.unlink()
    return {
        "embedding_bytes": EMBEDDING_BYTES,
        "store_get": store_latency,
        "embed_image_hit": service,
        "target_ms": 2.0,
    }


def encoder_bench(
    concurrency: int = 16,
    num_requests: int = 256,
    repeats: int = 2,
    seed: int = 0,
    max_wait_ms: float = 5.0,
    threads: int | None = None,
) -> dict[str, Any]:
    """``threads``: torch intra-op threads for the whole run (both sides); default torch's.
    The calling process gets its grad mode and thread count back."""
    threads_before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            throughput = _throughput(concurrency, num_requests, repeats, seed, max_wait_ms)
            throughput["by_image_size"] = _size_sweep(concurrency, seed, max_wait_ms)
            cache = _cache_hits(seed, n=200)
            threads_used = torch.get_num_threads()
    finally:
        torch.set_num_threads(threads_before)
    return {
        "bench": "encoder",
        "torch_threads": threads_used,
        "vision_encoder": {"depth": DEMO_VISION.depth, "hidden": DEMO_VISION.hidden_size},
        "audio_encoder": {"layers": DEMO_AUDIO.encoder_layers, "d_model": DEMO_AUDIO.d_model},
        "throughput": throughput,
        "cache": cache,
        "speedup_target": 2.5,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--concurrency", type=int, default=16, help="concurrent clients")
    parser.add_argument("--encoder-requests", type=int, default=256, help="single-item requests")
    parser.add_argument("--repeats", type=int, default=2, help="best of N runs")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument("--max-wait-ms", type=float, default=5.0, help="batching window")
    parser.add_argument("--torch-threads", type=int, help="torch intra-op threads (default: torch's)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    return encoder_bench(concurrency=args.concurrency, num_requests=args.encoder_requests, repeats=args.repeats,
                         seed=args.seed, max_wait_ms=args.max_wait_ms, threads=args.torch_threads)
