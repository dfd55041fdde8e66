"""A seeded synthetic multimodal world for training and evaluating a small demo model.

Short videos of one coloured shape on a black background, still images of one shape,
and tone-beep audio, each with a plain-English question and a short lowercase answer.

One ``Scene`` (a frozen description) is rendered two ways that must agree:

* in memory, for training: ``Sample.frames`` / ``image`` / ``audio``;
* as real files (``write_media``: MP4 with an optional AAC sound track, PNG, WAV) that
  the server decodes with its own pipeline (``media.load_video`` / ``load_image`` /
  ``load_audio``).

Video timing. Files hold ``VIDEO_FRAMES`` frames at ``VIDEO_FPS``, frame ``k`` at
``k / VIDEO_FPS`` s. The server samples at ``SAMPLE_FPS`` with targets at interval
centres (0.25, 0.75, ... s, see ``media.video.plan_sampling``) and shows, for each
target, the last frame whose pts <= target: 0.25 s -> the frame at 0.2 s. Training frames
are the scene rendered at exactly those frame times (``SAMPLED_FRAME_TIMES``, derived
from ``plan_sampling`` itself so the two cannot drift apart). Blink slots change at
multiples of 0.5 s and the colour switch is at 2.0 s; sampled frame times (0.2 + 0.5 k)
are 0.2-0.3 s away from every such boundary, so no sample is ambiguous.

Everything is a pure function of the ``np.random.Generator`` passed in (or the seed):
no global state.
"""

from __future__ import annotations

import math
import wave
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
from PIL import Image

from media.video import VideoInfo, plan_sampling

# ------------------------------------------------------------------------ constants

FRAME = 56  # frame/image side in pixels
VIDEO_SECONDS = 4.0
VIDEO_FPS = 10  # frame rate of written video files
SAMPLE_FPS = 2.0  # the server samples videos at this rate ...
SAMPLED_FRAMES = 8  # ... giving this many frames for a 4 s clip
SAMPLE_RATE = 16000

# Saturated but not at the RGB gamut corners: yuv420p round trips stay unclipped, and
# the four stay far apart after chroma subsampling.
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (230, 30, 30),
    "green": (30, 200, 40),
    "blue": (40, 80, 240),
    "yellow": (240, 220, 30),
}
SHAPES = ("circle", "square", "triangle")
DIRECTIONS = ("left", "right", "up", "down")
TASKS = (
    "video_direction",
    "video_blink",
    "video_color",
    "image_shape",
    "image_color",
    "audio_beeps",
    "audio_pitch",
    "video_audio_beeps",
    "describe",
)

VIDEO_FRAMES = round(VIDEO_SECONDS * VIDEO_FPS)
SHAPE_SIZES = (18, 24)  # inclusive range of a shape's side / diameter, px
EDGE_MARGIN = 1.0  # px kept free between a shape's bounding box and the frame edge
BLINK_SLOT = 0.5  # s; the light is on or off for a whole slot
BLINK_SLOTS = round(VIDEO_SECONDS / BLINK_SLOT)
MAX_BLINKS = 4
COLOR_SWITCH_TIME = 2.0  # s; video_color shows colour B from here on

PITCHES: dict[str, float] = {"high": 1000.0, "low": 300.0}  # Hz
BEEP_SECONDS = (0.12, 0.2)
MIN_SILENCE = 0.12  # s between beeps
FADE_SECONDS = 0.005
AUDIO_EDGE = 0.05  # s of silence kept at both ends: no beep cut off, none in AAC priming
CLIP_SECONDS = (1.0, 3.0)  # standalone clip length
AMPLITUDE = (0.3, 0.6)
NOISE_STD = 0.003
MAX_BEEPS = 5
MAX_PITCH_BEEPS = 3

# Frame times of a written file, and which of them the server's 2 fps sampler shows.
VIDEO_FRAME_TIMES = np.arange(VIDEO_FRAMES) / VIDEO_FPS


def _sampled_frame_indices() -> tuple[int, ...]:
    """Indices of the file's frames that ``media.load_video(fps=SAMPLE_FPS,
    max_frames=SAMPLED_FRAMES)`` returns: the last frame with pts <= each target."""
    info = VideoInfo(
        duration=VIDEO_SECONDS, fps=float(VIDEO_FPS), frame_count=VIDEO_FRAMES,
        width=FRAME, height=FRAME, codec="h264", rotation=0, keyframe_times=(0.0,),
        seekable=True, container="mov,mp4,m4a,3gp,3g2,mj2",
    )
    targets = plan_sampling(info, fps=SAMPLE_FPS, max_frames=SAMPLED_FRAMES)
    # Exact arithmetic, as the decoder compares integer ticks: 0.25 s -> frame 2.
    indices = tuple(min(math.floor(Fraction(t) * VIDEO_FPS), VIDEO_FRAMES - 1) for t in targets)
    assert len(indices) == SAMPLED_FRAMES, indices
    return indices


SAMPLED_FRAME_INDICES = _sampled_frame_indices()
SAMPLED_FRAME_TIMES = VIDEO_FRAME_TIMES[list(SAMPLED_FRAME_INDICES)]

# Pixel centres, shared by every render (float32 keeps the mask maths cheap).
_PIXEL_CENTRES = np.arange(FRAME, dtype=np.float32) + 0.5
# Boundaries are at exact multiples of 0.5 s / 2.0 s; the epsilon only absorbs float
# noise in t so that t == boundary counts as "after" ([a, b) slots).
_TIME_EPS = 1e-9
_RGB = {name: np.array(rgb, dtype=np.uint8) for name, rgb in COLORS.items()}
_COLOR_NAMES = tuple(COLORS)


# --------------------------------------------------------------------------- scenes


@dataclass(frozen=True)
class Shape:
    """One filled shape, moving in a straight line at constant speed.

    The centre is at ``start`` for t = 0 and at ``end`` for t = VIDEO_SECONDS (equal for
    a static shape). ``color`` until COLOR_SWITCH_TIME, ``color_after`` from then on.
    ``blink_slots``: half-second slots in which it is drawn (None: always drawn).
    """

    kind: str  # one of SHAPES
    size: int  # side of the square, diameter of the circle, base and height of the triangle
    start: tuple[float, float]  # (x, y) in px, y down
    end: tuple[float, float]
    color: str
    color_after: str
    blink_slots: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Beeps:
    """A mono clip of sine beeps over a faint noise floor."""

    seconds: float  # clip length
    onsets: tuple[float, ...]  # s, start of each beep (fades included)
    lengths: tuple[float, ...]  # s
    frequency: float  # Hz
    amplitude: float
    noise_seed: int  # the noise floor comes from its own generator: audio = f(scene)


@dataclass(frozen=True)
class Scene:
    """Everything needed to render a sample's media."""

    kind: str  # "video", "image" or "audio"
    shape: Shape | None = None  # the video's or image's shape
    beeps: Beeps | None = None  # a standalone clip ("audio") or a video's sound track

    @property
    def media(self) -> tuple[str, ...]:
        if self.kind == "video" and self.beeps is not None:
            return ("video", "audio")
        return (self.kind,)


@dataclass(frozen=True, eq=False)  # eq=False: == on numpy fields is ill-defined
class Sample:
    task: str
    question: str
    answer: str  # short, lowercase, no trailing period
    media: tuple[str, ...]  # kinds in message order
    frames: np.ndarray | None  # uint8 [SAMPLED_FRAMES, FRAME, FRAME, 3]
    image: np.ndarray | None  # uint8 [FRAME, FRAME, 3]
    audio: np.ndarray | None  # float32 mono at SAMPLE_RATE in [-1, 1]
    scene: Scene


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


def render_frames(shape: Shape, times: np.ndarray) -> np.ndarray:
    """uint8 [T, FRAME, FRAME, 3]: the scene at each time t (seconds), all at once."""
    times = np.asarray(times, dtype=np.float64)
    progress = (times / VIDEO_SECONDS).astype(np.float32)
    cx = shape.start[0] + (shape.end[0] - shape.start[0]) * progress
    cy = shape.start[1] + (shape.end[1] - shape.start[1]) * progress
    dx = _PIXEL_CENTRES[None, None, :] - cx[:, None, None]  # [T, 1, W]
    dy = _PIXEL_CENTRES[None, :, None] - cy[:, None, None]  # [T, H, 1]
    mask = _MASKS[shape.kind](dx, dy, shape.size / 2)  # [T, H, W]
    return mask[..., None] * shape_colors(shape, times)[:, None, None, :]


def render_image(shape: Shape) -> np.ndarray:
    """uint8 [FRAME, FRAME, 3]."""
    return render_frames(shape, np.zeros(1))[0]


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


# ---------------------------------------------------------------- random scene parts


def _pick(rng: np.random.Generator, options: tuple[str, ...]) -> str:
    return options[int(rng.integers(len(options)))]


def _size(rng: np.random.Generator) -> int:
    return int(rng.integers(SHAPE_SIZES[0], SHAPE_SIZES[1] + 1))


def _centre_range(size: int) -> tuple[float, float]:
    """Centre coordinates that keep the whole shape (plus a margin) inside the frame."""
    half = size / 2 + EDGE_MARGIN
    return half, FRAME - half


def _position(rng: np.random.Generator, size: int) -> tuple[float, float]:
    lo, hi = _centre_range(size)
    x, y = rng.uniform(lo, hi, 2)
    return float(x), float(y)


def _static_shape(rng: np.random.Generator) -> Shape:
    size = _size(rng)
    at = _position(rng, size)
    color = _pick(rng, _COLOR_NAMES)
    return Shape(_pick(rng, SHAPES), size, at, at, color, color)


def _moving_shape(rng: np.random.Generator, direction: str) -> Shape:
    """Edge-to-edge travel (give or take 3 px), so consecutive sampled frames are
    >= ~3.5 px apart; linear motion keeps every t in [0, 4] s inside the frame."""
    size = _size(rng)
    lo, hi = _centre_range(size)
    near, far, across = rng.uniform(0, 3), rng.uniform(0, 3), rng.uniform(lo, hi)
    forward = direction in ("right", "down")  # increasing x / y (y points down)
    a, b = (lo + near, hi - far) if forward else (hi - near, lo + far)
    horizontal = direction in ("left", "right")
    start = (a, across) if horizontal else (across, a)
    end = (b, across) if horizontal else (across, b)
    color = _pick(rng, _COLOR_NAMES)
    return Shape(_pick(rng, SHAPES), size, _floats(start), _floats(end), color, color)


def _floats(point: tuple[float, float]) -> tuple[float, float]:
    return float(point[0]), float(point[1])


def _color_change_shape(rng: np.random.Generator) -> Shape:
    size = _size(rng)
    at = _position(rng, size)
    before = int(rng.integers(len(_COLOR_NAMES)))
    after = (before + 1 + int(rng.integers(len(_COLOR_NAMES) - 1))) % len(_COLOR_NAMES)
    return Shape(_pick(rng, SHAPES), size, at, at, _COLOR_NAMES[before], _COLOR_NAMES[after])


def _blink_slots(rng: np.random.Generator, count: int) -> tuple[int, ...]:
    """`count` slots of BLINK_SLOTS, no two adjacent, uniformly over such sets: choose
    from BLINK_SLOTS - count + 1 and spread the i-th choice by i."""
    chosen = np.sort(rng.choice(BLINK_SLOTS - count + 1, size=count, replace=False))
    return tuple(int(c) + i for i, c in enumerate(chosen))


def _beeps(rng: np.random.Generator, count: int, seconds: float | None) -> Beeps:
    """`count` beeps laid out in a clip of `seconds` (None: a random standalone length)."""
    lengths = rng.uniform(*BEEP_SECONDS, count)
    needed = float(lengths.sum()) + (count - 1) * MIN_SILENCE + 2 * AUDIO_EDGE
    if seconds is None:
        seconds = float(rng.uniform(max(CLIP_SECONDS[0], needed), CLIP_SECONDS[1]))
    # Spread the spare time over the count + 1 gaps (before, between, after the beeps):
    # beep i starts after the spare time cut off before it and everything packed before it.
    spare_before = np.sort(rng.uniform(0.0, seconds - needed, count))
    packed_before = np.concatenate(([0.0], np.cumsum(lengths[:-1] + MIN_SILENCE)))
    onsets = AUDIO_EDGE + spare_before + packed_before
    return Beeps(
        seconds=seconds,
        onsets=tuple(float(t) for t in onsets),
        lengths=tuple(float(t) for t in lengths),
        frequency=PITCHES[_pick(rng, tuple(PITCHES))],
        amplitude=float(rng.uniform(*AMPLITUDE)),
        noise_seed=int(rng.integers(2**63)),
    )


# ---------------------------------------------------------------------------- tasks

# A task builds (scene, question, answer); make_sample renders the scene.
_Built = tuple[Scene, str, str]


def _video_direction(rng: np.random.Generator) -> _Built:
    direction = _pick(rng, DIRECTIONS)
    shape = _moving_shape(rng, direction)
    return Scene("video", shape), f"Which way does the {shape.color} {shape.kind} move?", direction


def _video_blink(rng: np.random.Generator) -> _Built:
    count = int(rng.integers(1, MAX_BLINKS + 1))
    size = _size(rng)
    at = _position(rng, size)
    color = _pick(rng, _COLOR_NAMES)
    light = Shape("circle", size, at, at, color, color, _blink_slots(rng, count))
    return Scene("video", light), "How many times does the light blink?", str(count)


def _video_color(rng: np.random.Generator) -> _Built:
    shape = _color_change_shape(rng)
    return Scene("video", shape), f"What colour does the {shape.kind} turn?", shape.color_after


def _image_shape(rng: np.random.Generator) -> _Built:
    shape = _static_shape(rng)
    return Scene("image", shape), "What shape is in the picture?", shape.kind


def _image_color(rng: np.random.Generator) -> _Built:
    shape = _static_shape(rng)
    return Scene("image", shape), f"What colour is the {shape.kind}?", shape.color


def _audio_beeps(rng: np.random.Generator) -> _Built:
    beeps = _beeps(rng, int(rng.integers(1, MAX_BEEPS + 1)), None)
    return Scene("audio", beeps=beeps), "How many beeps do you hear?", str(len(beeps.onsets))


def _audio_pitch(rng: np.random.Generator) -> _Built:
    beeps = _beeps(rng, int(rng.integers(1, MAX_PITCH_BEEPS + 1)), None)
    pitch = "high" if beeps.frequency == PITCHES["high"] else "low"
    return Scene("audio", beeps=beeps), "Are the beeps high or low?", pitch


def _video_audio_beeps(rng: np.random.Generator) -> _Built:
    if rng.integers(2):
        shape = _moving_shape(rng, _pick(rng, DIRECTIONS))
    else:
        shape = _color_change_shape(rng)
    beeps = _beeps(rng, int(rng.integers(1, MAX_BEEPS + 1)), VIDEO_SECONDS)
    return Scene("video", shape, beeps), "How many beeps are in the video?", str(len(beeps.onsets))


def _describe(rng: np.random.Generator) -> _Built:
    direction = _pick(rng, DIRECTIONS)
    shape = _moving_shape(rng, direction)
    sentences = (
        f"a {shape.color} {shape.kind} moves {direction} on a black background",
        "it does not change colour",
        "there is no sound",
    )
    return Scene("video", shape), "Describe the video.", ". ".join(sentences)


_TASK_BUILDERS: dict[str, Callable[[np.random.Generator], _Built]] = {
    "video_direction": _video_direction,
    "video_blink": _video_blink,
    "video_color": _video_color,
    "image_shape": _image_shape,
    "image_color": _image_color,
    "audio_beeps": _audio_beeps,
    "audio_pitch": _audio_pitch,
    "video_audio_beeps": _video_audio_beeps,
    "describe": _describe,
}
assert tuple(_TASK_BUILDERS) == TASKS


# ------------------------------------------------------------------------------ API


def make_sample(rng: np.random.Generator, task: str) -> Sample:
    """One random sample of `task`, with its media rendered in memory."""
    try:
        build = _TASK_BUILDERS[task]
    except KeyError:
        raise ValueError(f"unknown task {task!r}; expected one of {TASKS}") from None
    scene, question, answer = build(rng)
    shape, beeps = scene.shape, scene.beeps
    video = scene.kind == "video"
    return Sample(
        task=task,
        question=question,
        answer=answer,
        media=scene.media,
        frames=render_frames(shape, SAMPLED_FRAME_TIMES) if video and shape else None,
        image=render_image(shape) if scene.kind == "image" and shape else None,
        audio=render_audio(beeps) if beeps is not None else None,
        scene=scene,
    )


def sample_stream(seed: int) -> Iterator[Sample]:
    """Endless training samples, tasks uniformly at random, reproducible from `seed`."""
    rng = np.random.default_rng(seed)
    while True:
        yield make_sample(rng, _pick(rng, TASKS))


# Spawn-key namespace of the eval set: its generators never coincide with the training
# stream's default_rng(seed) (spawn key ()), so eval samples are not training samples.
_EVAL_STREAM = 1


def make_eval_set(seed: int, per_task: int) -> list[Sample]:
    """`per_task` samples of every task, in TASKS order. Each task has its own
    generator, so a task's samples don't depend on the other tasks or their order."""
    samples: list[Sample] = []
    for index, task in enumerate(TASKS):
        seq = np.random.SeedSequence(seed, spawn_key=(_EVAL_STREAM, index))
        rng = np.random.default_rng(seq)
        samples.extend(make_sample(rng, task) for _ in range(per_task))
    return samples


def answer_matches(predicted: str, expected: str) -> bool:
    """Compare answers ignoring case, surrounding/repeated spaces and a final period."""
    return _normalise(predicted) == _normalise(expected)


def _normalise(text: str) -> str:
    return " ".join(text.lower().split()).rstrip(".").rstrip()


# ---------------------------------------------------------------------------- files


def write_media(sample: Sample, directory: Path, stem: str) -> list[Path]:
    """Files for the sample's media in the order of ``sample.media``: a video (with its
    sound track muxed into the same file) -> ``stem.mp4``; an image -> ``stem.png``; a
    standalone clip -> ``stem.wav`` (16-bit PCM)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    scene = sample.scene
    if scene.kind == "video":
        assert scene.shape is not None
        path = directory / f"{stem}.mp4"
        _write_mp4(path, render_frames(scene.shape, VIDEO_FRAME_TIMES), sample.audio)
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
        # Single-threaded: a 56x56 frame gains nothing from threads, and the output
        # is then reproducible.
        return "libx264", {"crf": "4", "preset": "ultrafast", "threads": "1"}
    return "mpeg4", {"qmin": "1", "qmax": "2", "b": "4M"}


def _write_mp4(path: Path, frames: np.ndarray, sound: np.ndarray | None) -> None:
    codec, options = _video_codec()
    samples_per_frame = SAMPLE_RATE // VIDEO_FPS
    with av.open(str(path), "w", format="mp4") as out:
        video = out.add_stream(codec, rate=VIDEO_FPS)
        video.width = video.height = FRAME
        video.pix_fmt = "yuv420p"
        video.options = options
        audio = None
        if sound is not None:
            audio = out.add_stream("aac", rate=SAMPLE_RATE, layout="mono")
        for i, rgb in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
            frame.pts = i
            out.mux(video.encode(frame))
            if audio is not None:  # interleave: the sound of this frame's 0.1 s
                chunk = sound[i * samples_per_frame : (i + 1) * samples_per_frame]
                _encode_audio(out, audio, chunk, i * samples_per_frame)
        out.mux(video.encode())
        if audio is not None:
            rest = sound[len(frames) * samples_per_frame :]
            if rest.size:
                _encode_audio(out, audio, rest, len(frames) * samples_per_frame)
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
