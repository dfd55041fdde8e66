"""A seeded synthetic multimodal world for training and evaluating a small demo model.

Short videos of one coloured shape on a black background, still images of one shape,
and tone-beep audio, each with a plain-English question and a short lowercase answer.
One task (``video_info``) asks about the video file itself (its frame rate, size or
duration), which the frames cannot tell: its answer is a call of the one tool the
demo knows (``VIDEO_INFO_TOOL``), and ``tool_exchange`` gives the tool's result and
the answer in words that follows it. ``reasoning`` is what the model thinks before
answering in thinking mode.

One ``Scene`` (a frozen description) is rendered two ways that must agree:

* in memory, for training: ``Sample.frames`` / ``image`` / ``audio``;
* as real files (``write_media``: MP4 with an optional AAC sound track, PNG, WAV) that
  the server decodes with its own pipeline (``media.load_video`` / ``load_image`` /
  ``load_audio``).

Input variety. Users send pictures and clips of every size, so each visual scene has
its own frame size (``Scene.width`` x ``Scene.height``, 48..640 px a side, even,
landscape, portrait and square, often one of ``COMMON_SIZES``) and each video its own
frame rate (``Scene.fps``, 10..30 fps, NTSC rates included). Shapes are sized relative
to the frame (``SHAPE_FRACTION`` of its shorter side) and move edge to edge, so after
the server's resize (``media.preprocess_*``: 56..84 px a side for the demo) every
scene looks alike whatever it was drawn at.

Video timing. Files hold ``video_frame_count(fps)`` frames (``VIDEO_SECONDS`` long),
frame ``k`` at ``k / fps`` s. The server samples at ``SAMPLE_FPS`` with targets at
interval centres (0.25, 0.75, ... s, see ``media.video.plan_sampling``) and shows, for
each target, the last frame whose pts <= target: at 10 fps 0.25 s -> the frame at
0.2 s. Training frames are the scene rendered at exactly those frame times
(``sampled_frame_indices(fps)``, derived from ``plan_sampling`` itself so the two
cannot drift apart). Blink slots change at multiples of 0.5 s and the colour switch is
at 2.0 s; a sampled frame time lies in (target - 1/fps, target], so at >= 10 fps it is
0.15-0.25 s away from every such boundary and no sample is ambiguous.

Everything is a pure function of the ``np.random.Generator`` passed in (or the seed):
no global state.
"""

from __future__ import annotations

import functools
import json
import math
import wave
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import av
import numpy as np
from PIL import Image

from media.video import VideoInfo, plan_sampling

# ------------------------------------------------------------------------ constants

REFERENCE_FRAME = 56  # px: the side the shape sizes and margins were first set for
MIN_SIDE, MAX_SIDE = 48, 640  # frame/image sides, px (even: yuv420p needs it)
MAX_ASPECT = 2.4  # longer side / shorter side of a drawn (non-common) size
# (width, height) that files in the wild often have; half the scenes use one of them.
COMMON_SIZES: tuple[tuple[int, int], ...] = (
    (640, 360), (320, 240), (360, 640), (256, 256), (56, 56), (480, 270), (240, 320),
    (640, 480), (128, 128), (176, 144), (480, 480), (270, 480), (64, 64), (96, 96),
)
COMMON_SIZE_SHARE = 0.5
VIDEO_SECONDS = 4.0
# Frame rates of written video files: NTSC rates are exact fractions, as in real files.
COMMON_RATES: tuple[Fraction, ...] = tuple(
    Fraction(r) for r in (10, 12, 15, 20, 24, 25, 30, Fraction(24000, 1001), Fraction(30000, 1001))
)
MIN_FPS, MAX_FPS = 10, 30
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
    "video_info",  # last: the eval set's other tasks keep their generators (spawn key = index)
)

# A shape's side / diameter as a fraction of the frame's shorter side: 18..24 px of 56.
SHAPE_FRACTION = (18 / REFERENCE_FRAME, 24 / REFERENCE_FRAME)
EDGE_MARGIN = 1.0  # px kept free between a shape's bounding box and the frame edge
TRAVEL_SLACK = 3 / REFERENCE_FRAME  # motion stops up to this fraction of the shorter side short of an edge
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


def video_frame_count(fps: Fraction) -> int:
    """Frames in a written file of VIDEO_SECONDS at `fps`."""
    return round(VIDEO_SECONDS * fps)


@functools.cache
def video_frame_times(fps: Fraction) -> np.ndarray:
    """float64 [video_frame_count(fps)]: the pts of each frame of a file, in seconds
    (each the float nearest to k / fps; read-only, shared)."""
    times = np.array([float(k / fps) for k in range(video_frame_count(fps))])
    times.flags.writeable = False
    return times


@functools.cache
def sampled_frame_indices(fps: Fraction) -> tuple[int, ...]:
    """Indices of the file's frames that ``media.load_video(fps=SAMPLE_FPS,
    max_frames=SAMPLED_FRAMES)`` returns: the last frame with pts <= each target."""
    count = video_frame_count(fps)
    info = VideoInfo(
        duration=float(count / fps), fps=float(fps), frame_count=count,
        width=REFERENCE_FRAME, height=REFERENCE_FRAME, codec="h264", rotation=0, keyframe_times=(0.0,),
        seekable=True, container="mov,mp4,m4a,3gp,3g2,mj2",
    )
    targets = plan_sampling(info, fps=SAMPLE_FPS, max_frames=SAMPLED_FRAMES)
    # Exact arithmetic, as the decoder compares integer ticks: 0.25 s at 10 fps -> frame 2.
    indices = tuple(min(math.floor(Fraction(t) * fps), count - 1) for t in targets)
    assert len(indices) == SAMPLED_FRAMES, indices
    return indices


def sampled_frame_times(fps: Fraction) -> np.ndarray:
    """float64 [SAMPLED_FRAMES]: the pts of the frames the server's sampler shows."""
    return video_frame_times(fps)[list(sampled_frame_indices(fps))]

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
    size: float  # px: side of the square, diameter of the circle, base and height of the triangle
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
    width: int = 0  # px, of a video's frames or an image (0: audio only)
    height: int = 0
    fps: Fraction | None = None  # frame rate of a video's file

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
    frames: np.ndarray | None  # uint8 [SAMPLED_FRAMES, height, width, 3]: what the server samples
    image: np.ndarray | None  # uint8 [height, width, 3]
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


# ---------------------------------------------------------------- random scene parts


def _pick(rng: np.random.Generator, options: tuple[str, ...]) -> str:
    return options[int(rng.integers(len(options)))]


def _even(x: float) -> int:
    return 2 * round(x / 2)


def frame_size(rng: np.random.Generator) -> tuple[int, int]:
    """(width, height) of a picture or clip: a common size half of the time, otherwise
    sides drawn independently in [MIN_SIDE, MAX_SIDE] (even, aspect <= MAX_ASPECT)."""
    if rng.random() < COMMON_SIZE_SHARE:
        return COMMON_SIZES[int(rng.integers(len(COMMON_SIZES)))]
    while True:
        w, h = (_even(v) for v in rng.uniform(MIN_SIDE, MAX_SIDE, 2))
        if max(w, h) <= MAX_ASPECT * min(w, h):
            return w, h


def frame_rate(rng: np.random.Generator) -> Fraction:
    """A video file's frame rate: a common one half of the time, else an integer in
    [MIN_FPS, MAX_FPS]."""
    if rng.random() < 0.5:
        return COMMON_RATES[int(rng.integers(len(COMMON_RATES)))]
    return Fraction(int(rng.integers(MIN_FPS, MAX_FPS + 1)))


@dataclass(frozen=True)
class _Frame:
    width: int
    height: int

    @property
    def short(self) -> int:
        return min(self.width, self.height)


def _size(rng: np.random.Generator, frame: _Frame) -> float:
    return float(rng.uniform(*SHAPE_FRACTION)) * frame.short


def _centre_range(size: float, side: int) -> tuple[float, float]:
    """Centre coordinates along a side of `side` px that keep the whole shape (plus a
    margin) inside the frame."""
    half = size / 2 + EDGE_MARGIN
    return half, side - half


def _position(rng: np.random.Generator, size: float, frame: _Frame) -> tuple[float, float]:
    (xlo, xhi), (ylo, yhi) = _centre_range(size, frame.width), _centre_range(size, frame.height)
    return float(rng.uniform(xlo, xhi)), float(rng.uniform(ylo, yhi))


def _static_shape(rng: np.random.Generator, frame: _Frame) -> Shape:
    size = _size(rng, frame)
    at = _position(rng, size, frame)
    color = _pick(rng, _COLOR_NAMES)
    return Shape(_pick(rng, SHAPES), size, at, at, color, color)


def _moving_shape(rng: np.random.Generator, direction: str, frame: _Frame) -> Shape:
    """Edge-to-edge travel (give or take TRAVEL_SLACK), so consecutive sampled frames are
    >= ~5 % of the shorter side apart; linear motion keeps every t in [0, 4] s inside
    the frame."""
    size = _size(rng, frame)
    horizontal = direction in ("left", "right")
    along, across_side = (frame.width, frame.height) if horizontal else (frame.height, frame.width)
    lo, hi = _centre_range(size, along)
    slack = TRAVEL_SLACK * frame.short
    near, far = rng.uniform(0, slack, 2)
    across = rng.uniform(*_centre_range(size, across_side))
    forward = direction in ("right", "down")  # increasing x / y (y points down)
    a, b = (lo + near, hi - far) if forward else (hi - near, lo + far)
    start = (a, across) if horizontal else (across, a)
    end = (b, across) if horizontal else (across, b)
    color = _pick(rng, _COLOR_NAMES)
    return Shape(_pick(rng, SHAPES), size, _floats(start), _floats(end), color, color)


def _floats(point: tuple[float, float]) -> tuple[float, float]:
    return float(point[0]), float(point[1])


def _color_change_shape(rng: np.random.Generator, frame: _Frame) -> Shape:
    size = _size(rng, frame)
    at = _position(rng, size, frame)
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


# ------------------------------------------------------------ the tool, and reasoning

# The one tool the demo model learns: a property of the user's video file. The frames
# the model sees are resized and resampled, so the file's own numbers must come from
# the client's side of the exchange.
VIDEO_TOOL_NAME = "get_video_info"
VIDEO_PROPERTIES = ("frame_rate", "width", "height", "duration")
VIDEO_INFO_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": VIDEO_TOOL_NAME,
        "description": "Get a property of the video file: its frame rate, width, height or duration.",
        "parameters": {
            "type": "object",
            "properties": {"property": {"type": "string", "enum": list(VIDEO_PROPERTIES)}},
            "required": ["property"],
        },
    },
}
PROPERTY_QUESTIONS: dict[str, str] = {
    "frame_rate": "What is the frame rate of this video?",
    "width": "What is the width of this video?",
    "height": "What is the height of this video?",
    "duration": "What is the duration of this video?",
}
# Asked without the tool, the model says so instead of calling a tool it was not given.
NO_TOOL_ANSWER = "i cannot tell from the frames alone"
_PROPERTY_WORDS = {"frame_rate": "frame rate", "width": "width", "height": "height", "duration": "duration"}
_REPLIES = {
    "frame_rate": "The video has {} frames per second.",
    "width": "The video is {} pixels wide.",
    "height": "The video is {} pixels high.",
    "duration": "The video lasts {} seconds.",
}

# Thinking mode: a short reasoning before the answer that depends on the kind of
# question only, so the model learns the habit, not a second way to perceive.
REASONING: dict[str, str] = {
    "video_direction": "The question asks which way the shape moves, so I follow it from frame to frame.",
    "video_blink": "The question asks how many times the light blinks, so I count the flashes.",
    "video_color": "The question asks which colour the shape turns, so I compare the first and last frames.",
    "image_shape": "The question asks for the shape, so I look at its outline in the picture.",
    "image_color": "The question asks for the colour of the shape, so I look at the picture.",
    "audio_beeps": "The question asks how many beeps there are, so I count them in the sound.",
    "audio_pitch": "The question asks whether the beeps are high or low, so I listen to their pitch.",
    "video_audio_beeps": "The question asks how many beeps the video has, so I count them in its sound track.",
    "describe": "The question asks for a description, so I say what moves, where, and what I hear.",
}


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """A call as the model writes it (and the chat template renders it back): one
    ``<tool_call>`` block holding JSON with exactly ``name`` then ``arguments``."""
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def video_property(scene: Scene, prop: str) -> int | float:
    """What ``get_video_info`` returns for a written file of the scene: frame rates as
    a number of frames per second (NTSC rates to 3 decimals), sides in pixels, the
    duration in seconds; whole numbers as integers."""
    if scene.kind != "video" or scene.fps is None:
        raise ValueError("get_video_info is about a video")
    values: dict[str, float] = {
        "frame_rate": float(scene.fps),
        "width": scene.width,
        "height": scene.height,
        "duration": video_frame_count(scene.fps) / scene.fps,
    }
    try:
        return tool_value(values[prop])
    except KeyError:
        raise ValueError(f"unknown property {prop!r}; expected one of {VIDEO_PROPERTIES}") from None


def tool_value(value: float) -> int | float:
    """A property as ``get_video_info`` reports it: to 3 decimals, whole numbers as integers."""
    rounded = round(float(value), 3)
    return int(rounded) if rounded.is_integer() else rounded


@dataclass(frozen=True)
class ToolExchange:
    """The rest of a ``video_info`` conversation once the model has called the tool."""

    prop: str
    arguments: dict[str, Any]
    result: str  # the tool message's content: JSON, e.g. {"frame_rate": 25}
    reply: str  # the model's answer in words after reading the result


def tool_exchange(scene: Scene, prop: str) -> ToolExchange:
    value = video_property(scene, prop)
    return ToolExchange(prop, {"property": prop}, json.dumps({prop: value}), _REPLIES[prop].format(value))


def question_property(question: str) -> str:
    """The property a ``video_info`` question asks for."""
    for prop, asked in PROPERTY_QUESTIONS.items():
        if asked == question:
            return prop
    raise ValueError(f"not a video_info question: {question!r}")


def reasoning(sample: Sample, *, tools: bool = False, tool_result: bool = False) -> str:
    """The thinking-mode reasoning before the answer: fixed per kind of question; for
    the file questions it names the property and says what the tool is for."""
    if sample.task != "video_info":
        return REASONING[sample.task]
    words = _PROPERTY_WORDS[question_property(sample.question)]
    if tool_result:
        return f"The tool returned the {words} of the file, so I report it."
    if tools:
        return f"The question asks for the {words} of the file, so I call {VIDEO_TOOL_NAME}."
    return f"The question asks for the {words} of the file, and I have no tool to read it."


# ---------------------------------------------------------------------------- tasks

# A task builds (scene, question, answer); make_sample renders the scene.
_Built = tuple[Scene, str, str]


@dataclass(frozen=True)
class MediaFormat:
    """Fixed media formats for ``make_sample`` (None: drawn from the generator)."""

    size: tuple[int, int] | None = None  # (width, height) of a picture or clip
    fps: Fraction | int | None = None  # a clip's frame rate


def _video(rng: np.random.Generator, fmt: MediaFormat) -> tuple[_Frame, Callable[..., Scene]]:
    """A clip's frame size and rate, and a Scene maker with them filled in."""
    frame = _Frame(*(frame_size(rng) if fmt.size is None else fmt.size))
    fps = frame_rate(rng) if fmt.fps is None else Fraction(fmt.fps)
    return frame, functools.partial(Scene, "video", width=frame.width, height=frame.height, fps=fps)


def _image(rng: np.random.Generator, fmt: MediaFormat) -> tuple[_Frame, Callable[..., Scene]]:
    frame = _Frame(*(frame_size(rng) if fmt.size is None else fmt.size))
    return frame, functools.partial(Scene, "image", width=frame.width, height=frame.height)


def _video_direction(rng: np.random.Generator, fmt: MediaFormat) -> _Built:
    frame, scene = _video(rng, fmt)
    direction = _pick(rng, DIRECTIONS)
    shape = _moving_shape(rng, direction, frame)
    return scene(shape), f"Which way does the {shape.color} {shape.kind} move?", direction


def _video_blink(rng: np.random.Generator, fmt: MediaFormat) -> _Built:
    frame, scene = _video(rng, fmt)
    count = int(rng.integers(1, MAX_BLINKS + 1))
    size = _size(rng, frame)
    at = _position(rng, size, frame)
    color = _pick(rng, _COLOR_NAMES)
    light = Shape("circle", size, at, at, color, color, _blink_slots(rng, count))
    return scene(light), "How many times does the light blink?", str(count)


def _video_color(rng: np.random.Generator, fmt: MediaFormat) -> _Built:
    frame, scene = _video(rng, fmt)
    shape = _color_change_shape(rng, frame)
    return scene(shape), f"What colour does the {shape.kind} turn?", shape.color_after


def _image_shape(rng: np.random.Generator, fmt: MediaFormat) -> _Built:
    frame, scene = _image(rng, fmt)
    shape = _static_shape(rng, frame)
    return scene(shape), "What shape is in the picture?", shape.kind


def _image_color(rng: np.random.Generator, fmt: MediaFormat) -> _Built:
    frame, scene = _image(rng, fmt)
    shape = _static_shape(rng, frame)
    return scene(shape), f"What colour is the {shape.kind}?", shape.color


def _audio_beeps(rng: np.random.Generator, fmt: MediaFormat) -> _Built:
    beeps = _beeps(rng, int(rng.integers(1, MAX_BEEPS + 1)), None)
    return Scene("audio", beeps=beeps), "How many beeps do you hear?", str(len(beeps.onsets))


def _audio_pitch(rng: np.random.Generator, fmt: MediaFormat) -> _Built:
    beeps = _beeps(rng, int(rng.integers(1, MAX_PITCH_BEEPS + 1)), None)
    pitch = "high" if beeps.frequency == PITCHES["high"] else "low"
    return Scene("audio", beeps=beeps), "Are the beeps high or low?", pitch


def _video_audio_beeps(rng: np.random.Generator, fmt: MediaFormat) -> _Built:
    frame, scene = _video(rng, fmt)
    if rng.integers(2):
        shape = _moving_shape(rng, _pick(rng, DIRECTIONS), frame)
    else:
        shape = _color_change_shape(rng, frame)
    beeps = _beeps(rng, int(rng.integers(1, MAX_BEEPS + 1)), VIDEO_SECONDS)
    return scene(shape, beeps), "How many beeps are in the video?", str(len(beeps.onsets))


def _describe(rng: np.random.Generator, fmt: MediaFormat) -> _Built:
    frame, scene = _video(rng, fmt)
    direction = _pick(rng, DIRECTIONS)
    shape = _moving_shape(rng, direction, frame)
    return scene(shape), "Describe the video.", description(shape, direction)


def description(shape: Shape, direction: str) -> str:
    """The describe answer for a silent clip of ``shape`` moving ``direction``."""
    return ". ".join((f"a {shape.color} {shape.kind} moves {direction} on a black background",
                      "it does not change colour", "there is no sound"))


def _video_info(rng: np.random.Generator, fmt: MediaFormat) -> _Built:
    """A question about the file itself, which the frames cannot answer: the answer is
    a call of the video tool (see ``tool_exchange`` for the rest of the exchange)."""
    frame, scene = _video(rng, fmt)
    if rng.integers(2):
        shape = _moving_shape(rng, _pick(rng, DIRECTIONS), frame)
    else:
        shape = _static_shape(rng, frame)
    prop = _pick(rng, VIDEO_PROPERTIES)
    return scene(shape), PROPERTY_QUESTIONS[prop], tool_call_text(VIDEO_TOOL_NAME, {"property": prop})


_TASK_BUILDERS: dict[str, Callable[[np.random.Generator, MediaFormat], _Built]] = {
    "video_direction": _video_direction,
    "video_blink": _video_blink,
    "video_color": _video_color,
    "image_shape": _image_shape,
    "image_color": _image_color,
    "audio_beeps": _audio_beeps,
    "audio_pitch": _audio_pitch,
    "video_audio_beeps": _video_audio_beeps,
    "describe": _describe,
    "video_info": _video_info,
}
assert tuple(_TASK_BUILDERS) == TASKS


# ------------------------------------------------------------------------------ API


_DRAWN = MediaFormat()


def make_scene(rng: np.random.Generator, task: str, fmt: MediaFormat = _DRAWN) -> tuple[Scene, str, str]:
    """(scene, question, answer) of one random sample of `task`, nothing rendered:
    consumes `rng` exactly as ``make_sample`` does."""
    try:
        build = _TASK_BUILDERS[task]
    except KeyError:
        raise ValueError(f"unknown task {task!r}; expected one of {TASKS}") from None
    if fmt.size is not None:
        w, h = fmt.size
        if not (w > 0 and h > 0 and w % 2 == 0 and h % 2 == 0):
            raise ValueError(f"frame size must be positive and even, got {fmt.size}")
    if fmt.fps is not None and not MIN_FPS <= fmt.fps <= MAX_FPS:
        raise ValueError(f"fps must be in [{MIN_FPS}, {MAX_FPS}], got {fmt.fps}")
    return build(rng, fmt)


def make_sample(rng: np.random.Generator, task: str, fmt: MediaFormat = _DRAWN) -> Sample:
    """One random sample of `task`, with its media rendered in memory. ``fmt`` fixes the
    frame size / rate instead of drawing them (the rest is drawn as usual)."""
    scene, question, answer = make_scene(rng, task, fmt)
    shape, beeps = scene.shape, scene.beeps
    frames = image = None
    if scene.kind == "video" and shape is not None:
        assert scene.fps is not None
        frames = render_frames(shape, sampled_frame_times(scene.fps), scene.width, scene.height)
    elif scene.kind == "image" and shape is not None:
        image = render_image(shape, scene.width, scene.height)
    return Sample(
        task=task,
        question=question,
        answer=answer,
        media=scene.media,
        frames=frames,
        image=image,
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
