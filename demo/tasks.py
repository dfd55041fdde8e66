"""Drawing samples of the demo world: random scene parts, one builder per task
(scene, question and answer; ``TASKS``), the thinking-mode reasoning before an
answer, and the sampling API (``make_scene``, ``make_sample``, ``sample_stream``,
``make_eval_set``, ``answer_matches``).

Everything is a pure function of the ``np.random.Generator`` passed in (or the seed):
no global state.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from demo.render import render_audio, render_frames, render_image
from demo.tool_spec import (
    PROPERTY_QUESTIONS,
    VIDEO_PROPERTIES,
    VIDEO_TOOL_NAME,
    question_property,
    tool_call_text,
)
from demo.world import (
    AMPLITUDE,
    AUDIO_EDGE,
    BEEP_SECONDS,
    BLINK_SLOTS,
    CLIP_SECONDS,
    COLORS,
    COMMON_RATES,
    COMMON_SIZE_SHARE,
    COMMON_SIZES,
    DIRECTIONS,
    EDGE_MARGIN,
    MAX_ASPECT,
    MAX_BEEPS,
    MAX_BLINKS,
    MAX_FPS,
    MAX_PITCH_BEEPS,
    MAX_SIDE,
    MIN_FPS,
    MIN_SIDE,
    MIN_SILENCE,
    PITCHES,
    SHAPE_FRACTION,
    SHAPES,
    TASKS,
    TRAVEL_SLACK,
    VIDEO_SECONDS,
    Beeps,
    Sample,
    Scene,
    Shape,
    sampled_frame_times,
)

_COLOR_NAMES = tuple(COLORS)


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
    a call of the video tool (see ``demo.tool_spec.tool_exchange`` for the rest of the
    exchange)."""
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


# ------------------------------------------------------------------------ reasoning

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
_PROPERTY_WORDS = {"frame_rate": "frame rate", "width": "width", "height": "height", "duration": "duration"}


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
