"""The seeded synthetic multimodal world the demo model is trained and evaluated
on: its constants, the frame timing of its videos, and the frozen records a sample
is made of (``Shape``, ``Beeps``, ``Scene``, ``Sample``).

Short videos of one coloured shape on a black background, still images of one shape,
and tone-beep audio, each with a plain-English question and a short lowercase answer
(the tasks, ``TASKS``, are drawn in ``demo.tasks``; a scene is rendered by
``demo.render``). One task (``video_info``) asks about the video file itself (its
frame rate, size or duration), which the frames cannot tell: its answer is a call of
the one tool the demo knows (``demo.tool_spec``).

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
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from media.video_probe import VideoInfo, plan_sampling

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
