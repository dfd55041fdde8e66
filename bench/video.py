"""Video sampling benchmark: chunked ``load_video`` vs. the PyAV loop a user writes.

Run: ``python -m bench.video [fps] [threads]``. The test video (5 min,
1280x720, 30 fps H.264, 2 s GOPs) is generated once and cached under
``~/.cache/swallow/bench/``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from fractions import Fraction
from pathlib import Path
from typing import Any

import av
import numpy as np

from media.video import _usable_cores, load_video
from media.video_probe import plan_sampling, probe_video

WIDTH, HEIGHT, RATE = 1280, 720, 30
SEGMENT_SECONDS = 30  # distinct content, encoded once
TOTAL_SECONDS = 300  # the segment's packets repeated (closed GOPs: decodable)
GOP = 60  # 2 s
CACHE_DIR = Path(os.path.expanduser("~/.cache/swallow/bench"))
VIDEO_NAME = "h264_1280x720_30fps_300s_gop60_1slice_v2.mp4"


def _log(msg: str) -> None:
    print(f"[video_bench] {msg}", file=sys.stderr, flush=True)


def _segment_frames(n: int) -> Iterator[np.ndarray]:
    """yuv420p frames [H*3/2, W] of moving content: a scrolling noise texture
    (so motion compensation has real work), a drifting gradient and moving
    shapes. Generated directly in YUV to skip an RGB->YUV conversion."""
    rng = np.random.default_rng(1234)
    # Smooth-ish texture: random blocks upsampled, plus fine noise.
    coarse = rng.integers(0, 160, (HEIGHT // 8 + 2, (WIDTH * 2) // 8 + 2), dtype=np.uint8)
    texture = np.repeat(np.repeat(coarse, 8, axis=0), 8, axis=1)[: HEIGHT + 8, : WIDTH * 2]
    texture = texture + rng.integers(0, 24, texture.shape, dtype=np.uint8)
    ys = np.arange(HEIGHT, dtype=np.float32)[:, None]
    xs = np.arange(WIDTH, dtype=np.float32)[None, :]
    cy = np.arange(HEIGHT // 2, dtype=np.float32)[:, None]
    cx = np.arange(WIDTH // 2, dtype=np.float32)[None, :]
    for i in range(n):
        y = texture[(i // 3) % 8 : (i // 3) % 8 + HEIGHT, (4 * i) % WIDTH : (4 * i) % WIDTH + WIDTH]
        y = y.astype(np.uint16)
        y += ((xs + ys + 6 * i) % 256 / 4).astype(np.uint16)
        for k in range(4):  # moving boxes
            bx = int((WIDTH - 160) * (0.5 + 0.5 * math.sin(0.02 * i * (k + 1) + k)))
            by = int((HEIGHT - 120) * (0.5 + 0.5 * math.cos(0.015 * i * (k + 2) + 2 * k)))
            y[by : by + 120, bx : bx + 160] = 40 + 50 * k
        u = (128 + 60 * np.sin((cx + 2 * i) / 60.0) + 0 * cy).astype(np.uint8)
        v = (128 + 60 * np.cos((cy + i) / 45.0) + 0 * cx).astype(np.uint8)
        yield np.concatenate(
            [np.minimum(y, 255).astype(np.uint8), u.reshape(-1, WIDTH), v.reshape(-1, WIDTH)]
        )


def ensure_video() -> Path:
    """Generate (once) the 5-minute benchmark video; return its path."""
    path = CACHE_DIR / VIDEO_NAME
    if path.exists():
        return path
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    seg_path = CACHE_DIR / (VIDEO_NAME + ".segment.mp4")
    n_seg = SEGMENT_SECONDS * RATE
    t0 = time.perf_counter()
    _log(f"generating + encoding {SEGMENT_SECONDS} s of {WIDTH}x{HEIGHT} (libx264 veryfast) ...")
    with av.open(str(seg_path), "w") as out:
        st = out.add_stream("libx264", rate=RATE)
        st.width, st.height, st.pix_fmt = WIDTH, HEIGHT, "yuv420p"
        # Frame-threaded encoder = one slice per frame, like the ffmpeg CLI,
        # cameras and phones produce. PyAV's default (thread_type SLICE) makes
        # x264 use sliced threads, i.e. 2 slices/frame on 2 cores, which would
        # hand the plain loop (a) slice-parallel decoding most real files lack.
        st.codec_context.thread_type = "FRAME"
        # Fixed 2 s closed GOPs, no scene-cut keyframes: regular chunk boundaries
        # and a segment that starts with an IDR, so copies can be concatenated.
        st.options = {"preset": "veryfast", "crf": "23",
                      "x264-params": f"keyint={GOP}:min-keyint={GOP}:scenecut=0"}
        for i, a in enumerate(_segment_frames(n_seg)):
            f = av.VideoFrame.from_ndarray(a, format="yuv420p")
            f.pts = i
            for p in st.encode(f):
                out.mux(p)
            if (i + 1) % 150 == 0:
                _log(f"  encoded {i + 1}/{n_seg} frames ({time.perf_counter() - t0:.1f} s)")
        for p in st.encode():
            out.mux(p)
    # Repeat the segment's packets with shifted timestamps: 10x the content
    # without 10x the encode time, and still a real, fully decodable 5 min file.
    tmp = path.with_suffix(".tmp.mp4")
    copies = TOTAL_SECONDS // SEGMENT_SECONDS
    with av.open(str(seg_path)) as src, av.open(str(tmp), "w") as out:
        ist = src.streams.video[0]
        ost = out.add_stream_from_template(ist)
        packets = [p for p in src.demux(ist) if p.size]
        seg_ticks = int(Fraction(SEGMENT_SECONDS) / ist.time_base)
        for k in range(copies):
            for p in packets:
                q = av.Packet(bytes(p))
                q.pts, q.dts = p.pts + k * seg_ticks, p.dts + k * seg_ticks
                q.duration, q.time_base = p.duration, p.time_base
                q.is_keyframe = p.is_keyframe
                q.stream = ost
                out.mux(q)
    tmp.replace(path)  # atomic: a crash never leaves a half file to be reused
    seg_path.unlink(missing_ok=True)
    _log(f"wrote {path} ({path.stat().st_size / 1e6:.0f} MB) in {time.perf_counter() - t0:.1f} s")
    return path


def _plain_loop(path: Path, targets: list[float], single_thread: bool) -> int:
    """What a user writes: decode everything, keep the frame on screen at each
    target (same semantics as load_video), convert only those."""
    out = []
    with av.open(str(path)) as c:
        s = c.streams.video[0]
        if single_thread:
            s.codec_context.thread_type = "NONE"
            s.codec_context.thread_count = 1
        prev = None
        k = 0
        for frame in c.decode(s):
            t = frame.time
            while k < len(targets) and targets[k] < t:
                out.append((prev or frame).to_ndarray(format="rgb24"))
                k += 1
            if k == len(targets):
                break
            prev = frame
        while k < len(targets):
            out.append(prev.to_ndarray(format="rgb24"))
            k += 1
    return len(out)


def _best_of(fn: Callable[[], int], runs: int = 2) -> tuple[float, int]:
    best, n = math.inf, 0
    for _ in range(runs):
        t0 = time.perf_counter()
        n = fn()
        best = min(best, time.perf_counter() - t0)
    return best, n


def video_bench(fps: float = 2.0, threads: int | None = None) -> dict:
    """Frames-ready throughput of three ways to sample the benchmark video at
    ``fps``: (a) plain PyAV loop with FFmpeg's default threading, (b) the same
    single-threaded, (c) ``load_video`` (chunked). Best of 2 runs each."""
    path = ensure_video()
    info = probe_video(path)
    targets = plan_sampling(info, fps=fps)
    n_threads = threads or _usable_cores()
    res: dict = {
        "video": str(path),
        "duration_s": info.duration,
        "resolution": f"{info.width}x{info.height}",
        "source_fps": info.fps,
        "sample_fps": fps,
        "frames_sampled": len(targets),
        "threads": n_threads,
        "usable_cores": _usable_cores(),
        "load_avg_1m": os.getloadavg()[0],
    }
    variants: dict[str, Callable[[], int]] = {
        "a_pyav_default_threads": lambda: _plain_loop(path, targets, single_thread=False),
        "b_pyav_single_thread": lambda: _plain_loop(path, targets, single_thread=True),
        "c_load_video_chunked": lambda: len(load_video(path, fps=fps, threads=n_threads).frames),
    }
    for name, fn in variants.items():
        _log(f"fps={fps}: running {name} ...")
        wall, n = _best_of(fn)
        res[name] = {"wall_s": round(wall, 3), "frames": n, "frames_per_s": round(n / wall, 2)}
        _log(f"  {name}: {wall:.2f} s, {n / wall:.1f} frames/s")
    c = res["c_load_video_chunked"]["wall_s"]
    res["speedup_c_over_b"] = round(res["b_pyav_single_thread"]["wall_s"] / c, 2)
    res["speedup_c_over_a"] = round(res["a_pyav_default_threads"]["wall_s"] / c, 2)
    print(
        f"fps={fps}: speedup c/b = {res['speedup_c_over_b']}x, c/a = {res['speedup_c_over_a']}x",
        file=sys.stderr,
    )
    return res


if __name__ == "__main__":
    _fps = float(sys.argv[1]) if len(sys.argv) > 1 else 2.0
    _threads = int(sys.argv[2]) if len(sys.argv) > 2 else None
    print(json.dumps(video_bench(_fps, _threads), indent=2))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fps", type=float, default=2.0, help="sampling rate")
    parser.add_argument("--threads", type=int, help="decode threads (default: usable cores)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    return video_bench(fps=args.fps, threads=args.threads)
