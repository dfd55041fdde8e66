"""Rendering the demo world: a ``Scene`` as pixels and sound in memory, and a
``Sample`` as real files. The two must agree:

* in memory, for training: ``Sample.frames`` / ``image`` / ``audio``;
* as real files (``write_media``: MP4 with an optional AAC sound track, PNG, WAV) that
  the server decodes with its own pipeline (``media.load_video`` / ``load_image`` /
  ``load_audio``).
"""

from __future__ import annotations

import math
import wave
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
from PIL import Image

from demo.world import (
    BLINK_SLOT,
    COLOR_SWITCH_TIME,
    COLORS,
    FADE_SECONDS,
    NOISE_STD,
    SAMPLE_RATE,
    VIDEO_SECONDS,
    Beeps,
    Sample,
    Shape,
    video_frame_times,
)

# Boundaries are at exact multiples of 0.5 s / 2.0 s; the epsilon only absorbs float
# noise in t so that t == boundary counts as "after" ([a, b) slots).
_TIME_EPS = 1e-9
_RGB = {name: np.array(rgb, dtype=np.uint8) for name, rgb in COLORS.items()}


# ------------------------------------------------------------------------ rendering


def _circle(dx: np.ndarray, dy: np.ndarray, half: float) -> np.ndarray:
    return dx * dx + dy * dy <= half * half


def _square(dx: np.ndarray, dy: np.ndarray, half: float) -> np.ndarray:
    return (np.abs(dx) <= half) & (np.abs(dy) <= half)


def _triangle(dx: np.ndarray, dy: np.ndarray, half: float) -> np.ndarray:
    # Apex at the top of the bounding box, base at the bottom: the half-width grows
    # from 0 to `half` over the height 2 * half.
    down = dy + half
    return (down >= 0) & (down <= 2 * half) & (np.abs(dx) <= 0.5 * down)


_MASKS: dict[str, Callable[[np.ndarray, np.ndarray, float], np.ndarray]] = {
    "circle": _circle,
    "square": _square,
    "triangle": _triangle,
}


def shape_colors(shape: Shape, times: np.ndarray) -> np.ndarray:
    """uint8 [T, 3]: the shape's colour at each time, black where it is not drawn."""
    after = times >= COLOR_SWITCH_TIME - _TIME_EPS
    rgb = np.where(after[:, None], _RGB[shape.color_after], _RGB[shape.color])
    if shape.blink_slots is not None:
        slots = np.floor(times / BLINK_SLOT + _TIME_EPS).astype(np.int64)
        rgb = rgb * np.isin(slots, shape.blink_slots)[:, None].astype(np.uint8)
    return rgb


def render_frames(shape: Shape, times: np.ndarray, width: int, height: int) -> np.ndarray:
    """uint8 [T, height, width, 3]: the scene at each time t (seconds).

    A pixel is the shape's colour when its centre is inside the shape. Only the
    shape's bounding box (plus a pixel) is evaluated: a 640x360 frame costs what the
    shape covers, not the whole frame."""
    times = np.asarray(times, dtype=np.float64)
    progress = (times / VIDEO_SECONDS).astype(np.float32)
    cx = np.float32(shape.start[0]) + np.float32(shape.end[0] - shape.start[0]) * progress
    cy = np.float32(shape.start[1]) + np.float32(shape.end[1] - shape.start[1]) * progress
    colors = shape_colors(shape, times)
    half = shape.size / 2
    reach = math.ceil(half) + 1
    out = np.zeros((times.size, height, width, 3), dtype=np.uint8)
    mask_of = _MASKS[shape.kind]
    for i in range(times.size):
        if not colors[i].any():
            continue  # a blinking light that is off
        x0, x1 = max(0, math.floor(cx[i]) - reach), min(width, math.floor(cx[i]) + reach + 1)
        y0, y1 = max(0, math.floor(cy[i]) - reach), min(height, math.floor(cy[i]) + reach + 1)
        dx = (np.arange(x0, x1, dtype=np.float32) + np.float32(0.5)) - cx[i]  # [w]
        dy = (np.arange(y0, y1, dtype=np.float32) + np.float32(0.5)) - cy[i]  # [h]
        mask = mask_of(dx[None, :], dy[:, None], half)  # [h, w]
        out[i, y0:y1, x0:x1] = mask[..., None] * colors[i]
    return out


def render_image(shape: Shape, width: int, height: int) -> np.ndarray:
    """uint8 [height, width, 3]."""
    return render_frames(shape, np.zeros(1), width, height)[0]


def render_audio(beeps: Beeps) -> np.ndarray:
    """float32 [round(seconds * SAMPLE_RATE)] in [-1, 1]."""
    n = round(beeps.seconds * SAMPLE_RATE)
    noise = np.random.default_rng(beeps.noise_seed).standard_normal(n, dtype=np.float32)
    out = noise * np.float32(NOISE_STD)
    fade = FADE_SECONDS * SAMPLE_RATE
    for onset, length in zip(beeps.onsets, beeps.lengths):
        first, count = round(onset * SAMPLE_RATE), round(length * SAMPLE_RATE)
        i = np.arange(count, dtype=np.float32)
        # Linear fades in and out: no clicks, which would read as extra onsets.
        envelope = np.minimum(np.minimum(i, count - 1 - i) / fade, 1.0)
        tone = np.sin(i * np.float32(2 * math.pi * beeps.frequency / SAMPLE_RATE))
        out[first : first + count] += np.float32(beeps.amplitude) * envelope * tone
    return np.clip(out, -1.0, 1.0, out=out)


# ---------------------------------------------------------------------------- files


def write_media(sample: Sample, directory: Path, stem: str) -> list[Path]:
    """Files for the sample's media in the order of ``sample.media``: a video (with its
    sound track muxed into the same file) -> ``stem.mp4``; an image -> ``stem.png``; a
    standalone clip -> ``stem.wav`` (16-bit PCM)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    scene = sample.scene
    if scene.kind == "video":
        assert scene.shape is not None and scene.fps is not None
        path = directory / f"{stem}.mp4"
        frames = render_frames(scene.shape, video_frame_times(scene.fps), scene.width, scene.height)
        _write_mp4(path, frames, scene.fps, sample.audio)
    elif scene.kind == "image":
        assert sample.image is not None
        path = directory / f"{stem}.png"
        Image.fromarray(sample.image, mode="RGB").save(path, format="PNG")
    else:
        assert sample.audio is not None
        path = directory / f"{stem}.wav"
        _write_wav(path, sample.audio)
    return [path]


def _video_codec() -> tuple[str, dict[str, str]]:
    """Near-lossless settings: the server's frames must match the training frames."""
    if "libx264" in av.codecs_available:
        # Single-threaded: frames this small gain little from threads, and the output
        # is then reproducible.
        return "libx264", {"crf": "4", "preset": "ultrafast", "threads": "1"}
    return "mpeg4", {"qmin": "1", "qmax": "2", "b": "4M"}


def _write_mp4(path: Path, frames: np.ndarray, fps: Fraction, sound: np.ndarray | None) -> None:
    codec, options = _video_codec()
    # Sound sample at which frame i's interval starts (exact: NTSC rates are fractions).
    sound_at = [math.floor(i * SAMPLE_RATE / fps) for i in range(len(frames) + 1)]
    with av.open(str(path), "w", format="mp4") as out:
        video = out.add_stream(codec, rate=fps)  # time base 1 / fps: pts i is frame i
        video.width, video.height = frames.shape[2], frames.shape[1]
        video.pix_fmt = "yuv420p"
        video.options = options
        audio = None
        if sound is not None:
            audio = out.add_stream("aac", rate=SAMPLE_RATE, layout="mono")
        for i, rgb in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
            frame.pts = i
            out.mux(video.encode(frame))
            if audio is not None:  # interleave: the sound of this frame's interval
                chunk = sound[sound_at[i] : sound_at[i + 1]]
                if chunk.size:
                    _encode_audio(out, audio, chunk, sound_at[i])
        out.mux(video.encode())
        if audio is not None:
            rest = sound[sound_at[-1] :]
            if rest.size:
                _encode_audio(out, audio, rest, sound_at[-1])
            out.mux(audio.encode())


def _encode_audio(
    out: av.container.OutputContainer, stream: av.AudioStream, chunk: np.ndarray, pts: int
) -> None:
    frame = av.AudioFrame.from_ndarray(
        np.ascontiguousarray(chunk, dtype=np.float32)[None, :], format="fltp", layout="mono"
    )
    frame.sample_rate = SAMPLE_RATE
    frame.pts = pts
    frame.time_base = Fraction(1, SAMPLE_RATE)
    out.mux(stream.encode(frame))


def _write_wav(path: Path, audio: np.ndarray) -> None:
    pcm = np.round(np.clip(audio, -1.0, 1.0) * 32767.0).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(SAMPLE_RATE)
        w.writeframes(pcm.tobytes())
