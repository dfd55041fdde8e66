"""The committed demo model on clips like the ones users send: drawn here with plain
numpy (not the demo world's renderer), at the frame sizes and rates of everyday
files, encoded by PyAV to H.264 MP4 at an ordinary quality, and asked through the
server's own path (``demo.evaluate.ask_many``: file parts -> PyAV decode ->
embedding cache -> encoders -> chat template -> engine)."""

from __future__ import annotations

from pathlib import Path

import av
import numpy as np
import pytest

from api.models import DEMO_MODEL_DIR
from demo.evaluate import ask_many
from demo.tasks import answer_matches

pytestmark = pytest.mark.skipif(not (DEMO_MODEL_DIR / "config.json").exists(),
                                reason="the demo model is not in this checkout")

# The demo language's colour words, as a user's drawing program might paint them
# (near, not equal to, the world's palette).
PAINT = {"red": (220, 40, 35), "green": (40, 190, 55), "blue": (50, 90, 230), "yellow": (235, 210, 45)}
SHAPES = ("circle", "square", "triangle")
DIRECTIONS = ("left", "right", "up", "down")
# (width, height): HD-ish landscape, 4:3, portrait phone, square, tiny, and more.
SIZES = ((640, 360), (320, 240), (360, 640), (56, 56), (256, 256), (480, 270), (240, 320))
RATES = (30, 24, 15, 10, 25)
SECONDS = 4


def _mask(kind: str, xs: np.ndarray, ys: np.ndarray, cx: float, cy: float, r: float) -> np.ndarray:
    dx, dy = xs - cx, ys - cy
    if kind == "circle":
        return dx * dx + dy * dy <= r * r
    if kind == "square":
        return (np.abs(dx) <= r) & (np.abs(dy) <= r)
    # Apex up: the half-width grows linearly from the top of the box to its bottom.
    depth = dy + r
    return (depth >= 0) & (depth <= 2 * r) & (np.abs(dx) * 2 <= depth)


def draw_clip(path: Path, *, width: int, height: int, fps: int, kind: str, color: str,
              direction: str, rng: np.random.Generator) -> None:
    """A shape gliding most of the way across the frame in `direction`, on black."""
    r = rng.uniform(0.13, 0.2) * min(width, height)  # half the shape's side
    along = width if direction in ("left", "right") else height
    across = height if direction in ("left", "right") else width
    lo, hi = r + 2, along - r - 2
    a = lo + rng.uniform(0, 0.08) * along
    b = hi - rng.uniform(0, 0.08) * along
    if direction in ("left", "up"):
        a, b = b, a
    c = rng.uniform(r + 2, across - r - 2)
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float32) + 0.5
    rgb = np.array(PAINT[color], np.uint8)
    with av.open(str(path), "w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"crf": "20", "preset": "veryfast"}
        n = SECONDS * fps
        for i in range(n):
            pos = a + (b - a) * i / (n - 1)
            cx, cy = (pos, c) if direction in ("left", "right") else (c, pos)
            frame = _mask(kind, xs, ys, cx, cy, r)[..., None] * rgb
            out.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")))
        out.mux(stream.encode())


def test_direction_of_user_drawn_clips(tmp_path: Path) -> None:
    rng = np.random.default_rng(2024)
    questions, expected, labels = [], [], []
    k = 0
    for width, height in SIZES:
        for direction in DIRECTIONS:
            kind, color = SHAPES[k % len(SHAPES)], tuple(PAINT)[(k // 3) % len(PAINT)]
            fps = RATES[k % len(RATES)]
            path = tmp_path / f"clip{k:02d}.mp4"
            draw_clip(path, width=width, height=height, fps=fps, kind=kind, color=color,
                      direction=direction, rng=rng)
            questions.append((f"Which way does the {color} {kind} move?", [path]))
            expected.append(direction)
            labels.append(f"{width}x{height}@{fps} {color} {kind}")
            k += 1
    answers = ask_many(DEMO_MODEL_DIR, questions, max_tokens=4)
    right = [answer_matches(a, e) for a, e in zip(answers, expected)]
    wrong = [(lbl, e, a) for lbl, e, a, ok in zip(labels, expected, answers, right) if not ok]
    accuracy = sum(right) / len(right)
    print(f"\nuser clips: {sum(right)}/{len(right)} right; wrong: {wrong}")
    assert len(right) >= 24
    assert accuracy >= 0.9, wrong
