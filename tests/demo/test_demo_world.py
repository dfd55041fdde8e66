"""demo.world and what draws and renders it (demo.tasks, demo.render,
demo.tool_spec): the synthetic world's questions/answers, its invariants (shapes inside
the frame, separate blinks, countable beeps), its variety of frame sizes and rates,
reproducibility, speed, and agreement between the in-memory training media and what the
server decodes from written files."""

from __future__ import annotations

import itertools
import json
import math
import time
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from demo import world
from demo.render import render_frames, write_media
from demo.tasks import (
    MediaFormat,
    answer_matches,
    make_eval_set,
    make_sample,
    make_scene,
    reasoning,
    sample_stream,
)
from demo.tool_spec import (
    VIDEO_INFO_TOOL,
    VIDEO_PROPERTIES,
    question_property,
    tool_exchange,
    video_property,
)
from demo.world import (
    COLORS,
    COMMON_RATES,
    COMMON_SIZES,
    DIRECTIONS,
    SAMPLE_FPS,
    SAMPLE_RATE,
    SAMPLED_FRAMES,
    SHAPES,
    TASKS,
    VIDEO_SECONDS,
    Sample,
    sampled_frame_indices,
    sampled_frame_times,
    video_frame_count,
    video_frame_times,
)
from encoders.presets import DEMO_PREPROCESS
from media import (
    MediaError,
    load_audio,
    load_image,
    load_video,
    plan_sampling,
    probe_video,
)

VOCAB: dict[str, set[str]] = {
    "video_direction": set(DIRECTIONS),
    "video_blink": {"1", "2", "3", "4"},
    "video_color": set(COLORS),
    "image_shape": set(SHAPES),
    "image_color": set(COLORS),
    "audio_beeps": {"1", "2", "3", "4", "5"},
    "audio_pitch": {"high", "low"},
    "video_audio_beeps": {"1", "2", "3", "4", "5"},
    "describe": {
        f"a {c} {s} moves {d} on a black background. it does not change colour. there is no sound"
        for c in COLORS
        for s in SHAPES
        for d in DIRECTIONS
    },
    "video_info": {
        f'<tool_call>{{"name": "get_video_info", "arguments": {{"property": "{p}"}}}}</tool_call>'
        for p in VIDEO_PROPERTIES
    },
}
MEDIA = {
    "video_direction": ("video",),
    "video_blink": ("video",),
    "video_color": ("video",),
    "image_shape": ("image",),
    "image_color": ("image",),
    "audio_beeps": ("audio",),
    "audio_pitch": ("audio",),
    "video_audio_beeps": ("video", "audio"),
    "describe": ("video",),
    "video_info": ("video",),
}
VIDEO_TASKS = tuple(t for t in TASKS if "video" in MEDIA[t])
VISUAL_TASKS = tuple(t for t in TASKS if {"video", "image"} & set(MEDIA[t]))
# Every frame rate the world draws: the common ones and the integers in between.
ALL_RATES = sorted({*COMMON_RATES, *(Fraction(r) for r in range(world.MIN_FPS, world.MAX_FPS + 1))})

# Pixels brighter than this in their strongest channel belong to the shape (every
# colour has a channel >= 200; the background is black).
SHAPE_LEVEL = 100
# The light counts as on when at least this many pixels are lit (a 12 px circle ~ 110).
LIGHT_PIXELS = 30
# 20 ms RMS windows; beeps are >= 0.3 amplitude (RMS >= 0.2), the noise floor ~0.003.
RMS_WINDOW = SAMPLE_RATE // 50
BEEP_RMS = 0.05


# ------------------------------------------------------------------- measurements


def shape_mask(frame: np.ndarray) -> np.ndarray:
    return frame.max(axis=-1) > SHAPE_LEVEL


def centroid(frame: np.ndarray) -> tuple[float, float]:
    ys, xs = np.nonzero(shape_mask(frame))
    assert xs.size, "no shape in the frame"
    return float(xs.mean()), float(ys.mean())


def light_on(frames: np.ndarray) -> list[bool]:
    return [bool(shape_mask(f).sum() >= LIGHT_PIXELS) for f in frames]


def nearest_color(frame: np.ndarray) -> str:
    """Name of the colour closest to the shape's mean colour (interior-weighted)."""
    mean = frame[shape_mask(frame)].astype(np.float64).mean(axis=0)
    return min(COLORS, key=lambda c: float(np.sum((mean - np.array(COLORS[c])) ** 2)))


def count_beeps(audio: np.ndarray) -> int:
    n = audio.size // RMS_WINDOW
    rms = np.sqrt(np.mean(audio[: n * RMS_WINDOW].reshape(n, RMS_WINDOW) ** 2, axis=1))
    loud = rms > BEEP_RMS
    return int(loud[0]) + int(np.sum(loud[1:] & ~loud[:-1]))  # rising edges


def dominant_frequency(audio: np.ndarray) -> float:
    spectrum = np.abs(np.fft.rfft(audio))
    return float(np.argmax(spectrum) * SAMPLE_RATE / audio.size)


def assert_same_sample(a: Sample, b: Sample) -> None:
    assert (a.task, a.question, a.answer, a.media, a.scene) == (
        b.task, b.question, b.answer, b.media, b.scene,
    )
    for x, y in ((a.frames, b.frames), (a.image, b.image), (a.audio, b.audio)):
        assert (x is None) == (y is None)
        if x is not None:
            assert np.array_equal(x, y)


def samples_of(task: str, n: int, seed: int = 0, fmt: MediaFormat = MediaFormat()) -> list[Sample]:
    rng = np.random.default_rng([seed, TASKS.index(task)])
    return [make_sample(rng, task, fmt) for _ in range(n)]


def short_side(s: Sample) -> int:
    return min(s.scene.width, s.scene.height)


# ------------------------------------------------------------------------ timing


@pytest.mark.parametrize("fps", ALL_RATES, ids=str)
def test_sampled_frames_are_what_the_server_sampler_shows(fps: Fraction) -> None:
    count = video_frame_count(fps)
    assert count == round(VIDEO_SECONDS * fps)
    info = world.VideoInfo(
        duration=float(count / fps), fps=float(fps), frame_count=count, width=640,
        height=360, codec="h264", rotation=0, keyframe_times=(0.0,), seekable=True,
        container="mp4",
    )
    targets = plan_sampling(info, fps=SAMPLE_FPS, max_frames=SAMPLED_FRAMES)
    assert targets == [0.25, 0.75, 1.25, 1.75, 2.25, 2.75, 3.25, 3.75]
    # The last frame whose (exact) pts k / fps is <= the target.
    expected = tuple(max(k for k in range(count) if Fraction(k) / fps <= Fraction(t)) for t in targets)
    assert sampled_frame_indices(fps) == expected
    times = video_frame_times(fps)
    assert times.shape == (count,) and times[-1] < VIDEO_SECONDS
    np.testing.assert_array_equal(sampled_frame_times(fps), times[list(expected)])
    if fps == 10:
        assert expected == (2, 7, 12, 17, 22, 27, 32, 37)
        np.testing.assert_allclose(sampled_frame_times(fps), np.array(targets) - 0.05)


def test_sampled_times_are_far_from_blink_and_colour_boundaries() -> None:
    for fps in ALL_RATES:
        for t in sampled_frame_times(fps):
            # Blink slots change every 0.5 s, colour at 2.0 s: keep >= 0.15 s away (more
            # than one 10 fps frame), so neither the sampler nor the frame grid can flip them.
            phase = t % world.BLINK_SLOT
            assert min(phase, world.BLINK_SLOT - phase) >= 0.15 - 1e-9, (fps, t)
            assert abs(t - world.COLOR_SWITCH_TIME) >= 0.15 - 1e-9, (fps, t)


def test_generation_is_fast() -> None:
    stream = sample_stream(123)
    next(stream)  # warm-up: first-call costs are not per-sample costs
    n = 200
    start = time.perf_counter()
    for _ in range(n):
        next(stream)
    per_sample_ms = (time.perf_counter() - start) / n * 1e3
    print(f"\nworld generation: {per_sample_ms:.3f} ms per sample (mean of {n})")
    assert per_sample_ms < 5.0


# -------------------------------------------------------------- reproducibility


def test_same_seed_same_samples_different_seed_different() -> None:
    a = [next(s) for s in [sample_stream(7)] for _ in range(60)]
    b = [next(s) for s in [sample_stream(7)] for _ in range(60)]
    for x, y in zip(a, b):
        assert_same_sample(x, y)
    c = [next(s) for s in [sample_stream(8)] for _ in range(60)]
    assert [x.scene for x in a] != [x.scene for x in c]


def test_stream_covers_every_task_roughly_uniformly() -> None:
    stream = sample_stream(1)
    counts = {t: 0 for t in TASKS}
    for _ in range(900):
        counts[next(stream).task] += 1
    assert all(50 <= c <= 150 for c in counts.values()), counts


def test_eval_set_counts_determinism_and_separation() -> None:
    per_task = 5
    ev = make_eval_set(3, per_task)
    assert len(ev) == per_task * len(TASKS)
    assert {t: sum(s.task == t for s in ev) for t in TASKS} == {t: per_task for t in TASKS}
    for x, y in zip(ev, make_eval_set(3, per_task)):
        assert_same_sample(x, y)
    assert [s.scene for s in make_eval_set(4, per_task)] != [s.scene for s in ev]
    # A task's samples don't depend on per_task: the small set is a prefix of the large.
    small = make_eval_set(3, 2)
    for task in TASKS:
        big_t = [s for s in ev if s.task == task][:2]
        for x, y in zip([s for s in small if s.task == task], big_t):
            assert_same_sample(x, y)
    # Not the training stream of the same seed.
    train = {next(s).scene for s in [sample_stream(3)] for _ in range(200)}
    assert not train & {s.scene for s in ev}


def test_unknown_task_raises() -> None:
    with pytest.raises(ValueError, match="unknown task"):
        make_sample(np.random.default_rng(0), "video_speed")


# ---------------------------------------------------------------- sample contents


@pytest.mark.parametrize("task", TASKS)
def test_answers_media_and_arrays(task: str) -> None:
    for s in samples_of(task, 40):
        assert s.task == task
        assert s.answer in VOCAB[task]
        assert s.answer == s.answer.strip().lower() and not s.answer.endswith(".")
        assert s.media == MEDIA[task] == s.scene.media
        assert s.question.endswith("?") or task == "describe"
        w, h = s.scene.width, s.scene.height
        if "video" in s.media:
            assert s.frames is not None and s.frames.dtype == np.uint8
            assert s.frames.shape == (SAMPLED_FRAMES, h, w, 3)
            assert world.MIN_FPS <= s.scene.fps <= world.MAX_FPS
        else:
            assert s.frames is None
        if "image" in s.media:
            assert s.image is not None and s.image.dtype == np.uint8
            assert s.image.shape == (h, w, 3)
        if {"video", "image"} & set(s.media):
            assert world.MIN_SIDE <= min(w, h) and max(w, h) <= world.MAX_SIDE
            assert w % 2 == 0 and h % 2 == 0
        else:
            assert s.image is None and (w, h, s.scene.fps) == (0, 0, None)
        if "image" not in s.media:
            assert s.image is None
        if "audio" in s.media:
            assert s.audio is not None and s.audio.dtype == np.float32 and s.audio.ndim == 1
            assert np.abs(s.audio).max() <= 1.0
        else:
            assert s.audio is None


def test_frame_sizes_and_rates_vary_like_user_files() -> None:
    """Portrait, landscape and square frames from ~48 to 640 px, a good share of them
    everyday sizes; 10-30 fps clips; all small once the server has resized them."""
    scenes = [make_scene(rng, task)[0] for task in VISUAL_TASKS
              for rng in [np.random.default_rng([5, TASKS.index(task)])] for _ in range(150)]
    sizes = [(sc.width, sc.height) for sc in scenes]
    assert all(world.MIN_SIDE <= min(z) and max(z) <= world.MAX_SIDE for z in sizes)
    assert all(max(z) <= world.MAX_ASPECT * min(z) for z in sizes if z not in COMMON_SIZES)
    common = sum(z in COMMON_SIZES for z in sizes) / len(sizes)
    assert 0.35 <= common <= 0.65, common
    assert {(640, 360), (320, 240), (360, 640), (56, 56), (256, 256)} <= set(sizes)
    assert len(set(sizes)) > 200
    shares = [np.mean([cmp(w, h) for w, h in sizes]) for cmp in (int.__gt__, int.__lt__, int.__eq__)]
    assert min(shares) >= 0.08, shares  # landscape, portrait, square
    shorts, longs = [min(z) for z in sizes], [max(z) for z in sizes]
    assert min(shorts) <= 60 and max(longs) >= 600 and np.median(shorts) >= 150
    rates = [sc.fps for sc in scenes if sc.kind == "video"]
    assert set(rates) <= set(ALL_RATES) and len(set(rates)) >= 15
    assert {Fraction(30000, 1001), Fraction(10), Fraction(30)} <= set(rates)
    # The server's resize brings every one of them to 56..84 px a side (4..10 merged
    # tokens per frame pair): the vision token count stays small.
    for w, h in set(sizes):
        th, tw = DEMO_PREPROCESS.target_size(h, w)
        assert th * tw <= DEMO_PREPROCESS.max_pixels and th * tw >= DEMO_PREPROCESS.min_pixels // 2
        assert (th // 28) * (tw // 28) <= 10


def test_media_format_can_be_fixed() -> None:
    rng = np.random.default_rng(0)
    s = make_sample(rng, "video_direction", MediaFormat(size=(640, 360), fps=Fraction(30000, 1001)))
    assert (s.scene.width, s.scene.height, s.scene.fps) == (640, 360, Fraction(30000, 1001))
    assert s.frames.shape == (SAMPLED_FRAMES, 360, 640, 3)
    s = make_sample(rng, "image_shape", MediaFormat(size=(56, 96)))
    assert s.image.shape == (96, 56, 3)
    with pytest.raises(ValueError, match="even"):
        make_sample(rng, "image_shape", MediaFormat(size=(55, 96)))
    with pytest.raises(ValueError, match="fps"):
        make_sample(rng, "video_blink", MediaFormat(fps=5))


def test_video_info_asks_for_a_property_of_the_file() -> None:
    samples = samples_of("video_info", 80)
    assert {question_property(s.question) for s in samples} == set(VIDEO_PROPERTIES)
    assert all(s.scene.beeps is None for s in samples)  # no sound track: one video part
    for s in samples:
        prop = question_property(s.question)
        assert f'"property": "{prop}"' in s.answer
        exchange = tool_exchange(s.scene, prop)
        value = video_property(s.scene, prop)
        assert exchange.arguments == {"property": prop} and json.loads(exchange.result) == {prop: value}
        assert str(value) in exchange.reply and exchange.reply.endswith(".")
    assert VIDEO_INFO_TOOL["function"]["parameters"]["properties"]["property"]["enum"] == list(VIDEO_PROPERTIES)
    with pytest.raises(ValueError, match="not a video_info question"):
        question_property("Describe the video.")


@pytest.mark.parametrize("fps", [Fraction(30000, 1001), Fraction(25), Fraction(13)])
def test_video_properties_are_what_a_prober_reads_from_the_file(fps: Fraction, tmp_path: Path) -> None:
    s = make_sample(np.random.default_rng(4), "video_info", MediaFormat(size=(320, 240), fps=fps))
    info = probe_video(write_media(s, tmp_path, "clip")[0])
    found = {"frame_rate": info.fps, "width": info.width, "height": info.height, "duration": info.duration}
    for prop, value in found.items():
        assert video_property(s.scene, prop) == round(value, 3)
    assert video_property(s.scene, "width") == 320 and isinstance(video_property(s.scene, "width"), int)
    assert tool_exchange(s.scene, "width").reply == "The video is 320 pixels wide."
    assert tool_exchange(s.scene, "frame_rate").result == json.dumps({"frame_rate": round(float(fps), 3)}).replace(
        ".0}", "}")
    with pytest.raises(ValueError, match="about a video"):
        video_property(samples_of("image_shape", 1)[0].scene, "width")
    with pytest.raises(ValueError, match="unknown property"):
        video_property(s.scene, "codec")


def test_reasoning_depends_on_the_kind_of_question_only() -> None:
    for task in TASKS:
        thoughts = {reasoning(s, tools=True) for s in samples_of(task, 30)}
        expected = 4 if task == "video_info" else 1  # the file questions name their property
        assert len(thoughts) == expected, (task, thoughts)
    s = samples_of("video_info", 1)[0]
    assert "get_video_info" in reasoning(s, tools=True) and "no tool" in reasoning(s)
    assert "returned" in reasoning(s, tools=True, tool_result=True)


def test_questions_name_the_shape() -> None:
    for s in samples_of("video_direction", 20):
        assert s.question == f"Which way does the {s.scene.shape.color} {s.scene.shape.kind} move?"
    for s in samples_of("video_color", 20):
        assert s.question == f"What colour does the {s.scene.shape.kind} turn?"
    for s in samples_of("image_color", 20):
        assert s.question == f"What colour is the {s.scene.shape.kind}?"
    assert {s.question for s in samples_of("audio_pitch", 5)} == {"Are the beeps high or low?"}


@pytest.mark.parametrize("task", ["video_direction", "describe"])
def test_motion_is_visible_and_inside_the_frame(task: str) -> None:
    samples = samples_of(task, 8)
    samples += samples_of(task, 4, fmt=MediaFormat(size=(48, 48), fps=11))  # the tightest
    for s in samples:
        shape = s.scene.shape
        direction = s.answer if task == "video_direction" else s.answer.split()[4]
        if task == "describe":
            assert s.answer.startswith(f"a {shape.color} {shape.kind} moves {direction} ")
        # Every frame of the file, not only the sampled ones, keeps a free border.
        full = render_frames(shape, video_frame_times(s.scene.fps), s.scene.width, s.scene.height)
        border = shape_mask(full)
        assert not border[:, 0].any() and not border[:, -1].any()
        assert not border[:, :, 0].any() and not border[:, :, -1].any()
        # The sampled frames are those frames of the file.
        assert np.array_equal(s.frames, full[list(sampled_frame_indices(s.scene.fps))])
        centres = np.array([centroid(f) for f in s.frames])
        axis = 0 if direction in ("left", "right") else 1
        sign = 1 if direction in ("right", "down") else -1
        steps = np.diff(centres[:, axis]) * sign
        # Clearly visible between sampled frames: >= 4 % of the shorter side (>= 2.2 px
        # once resized to 56 px), however the frame rate spaces the sampled frames.
        assert steps.min() >= 0.04 * short_side(s), (s.scene, steps)
        # Edge to edge: the travel covers most of the frame along the motion.
        along = s.scene.width if axis == 0 else s.scene.height
        assert abs(centres[-1, axis] - centres[0, axis]) >= 0.35 * along * (7 / 8)
        assert np.abs(np.diff(centres[:, 1 - axis])).max() < max(0.5, 0.005 * short_side(s))  # a straight line
        assert {nearest_color(f) for f in s.frames} == {shape.color}


def test_blinks_are_separate_on_slots() -> None:
    answers = set()
    for s in samples_of("video_blink", 60):
        on = light_on(s.frames)
        n = int(s.answer)
        answers.add(n)
        assert sum(on) == n
        assert not any(a and b for a, b in itertools.pairwise(on)), on  # never two in a row
        assert on == [i in s.scene.shape.blink_slots for i in range(SAMPLED_FRAMES)]
        assert {nearest_color(f) for f, lit in zip(s.frames, on) if lit} == {s.scene.shape.color}
    assert answers == {1, 2, 3, 4}


def test_colour_switches_at_two_seconds() -> None:
    for s in samples_of("video_color", 40):
        shape = s.scene.shape
        colours = [nearest_color(f) for f in s.frames]
        assert colours == [shape.color] * 4 + [s.answer] * 4
        assert shape.color != s.answer
        assert len({centroid(f) for f in s.frames}) == 1  # static


@pytest.mark.parametrize("task", ["image_shape", "image_color"])
def test_images(task: str) -> None:
    for s in samples_of(task, 40):
        shape = s.scene.shape
        mask = shape_mask(s.image)
        ys, xs = np.nonzero(mask)
        w, h = s.scene.width, s.scene.height
        assert 0 < xs.min() and xs.max() < w - 1 and 0 < ys.min() and ys.max() < h - 1
        assert nearest_color(s.image) == shape.color
        # Sized relative to the picture: 18-24 px of 56.
        assert 18 / 56 - 1e-9 <= shape.size / min(w, h) <= 24 / 56 + 1e-9
        fill = mask.sum() / shape.size**2  # area relative to the bounding box
        expected = {"square": 1.0, "circle": math.pi / 4, "triangle": 0.5}[shape.kind]
        assert abs(fill - expected) < 0.2, (shape.kind, fill)
        answer = shape.kind if task == "image_shape" else shape.color
        assert s.answer == answer


@pytest.mark.parametrize("task", ["audio_beeps", "audio_pitch", "video_audio_beeps"])
def test_beeps_are_countable(task: str) -> None:
    for s in samples_of(task, 40):
        beeps = s.scene.beeps
        seconds = VIDEO_SECONDS if task == "video_audio_beeps" else len(s.audio) / SAMPLE_RATE
        assert s.audio.size == round(seconds * SAMPLE_RATE)
        if task != "video_audio_beeps":
            assert 1.0 <= seconds <= 3.0
        assert count_beeps(s.audio) == len(beeps.onsets)
        if task != "audio_pitch":
            assert s.answer == str(len(beeps.onsets))
        ends = [a + b for a, b in zip(beeps.onsets, beeps.lengths)]
        gaps = [b - a for a, b in zip(ends, beeps.onsets[1:])]
        assert all(g >= 0.12 - 1e-6 for g in gaps) and beeps.onsets[0] > 0 and ends[-1] < seconds
        assert all(0.12 <= x <= 0.2 for x in beeps.lengths)
        pitch = "high" if dominant_frequency(s.audio) > 600 else "low"
        if task == "audio_pitch":
            assert s.answer == pitch
            assert 1 <= len(beeps.onsets) <= 3


def test_answer_matches() -> None:
    assert answer_matches("Left.", "left")
    assert answer_matches("  left ", "left.")
    assert answer_matches("A red  circle moves left.  It does not change colour",
                          "a red circle moves left. it does not change colour")
    assert not answer_matches("right", "left")
    assert not answer_matches("3", "4")
    assert not answer_matches("", "left")


# ------------------------------------------------------------------------- files


def _file_samples(task: str) -> list[Sample]:
    # Two of the mixed task, so both of its scene kinds are likely covered.
    return samples_of(task, 3 if task == "video_audio_beeps" else 1, seed=11)


def _check_video_file(s: Sample, path: Path) -> None:
    """The server's decode of the written file is the training frames (and sound)."""
    w, h, fps = s.scene.width, s.scene.height, s.scene.fps
    info = probe_video(path)
    assert (info.width, info.height) == (w, h)
    assert info.frame_count == video_frame_count(fps) and abs(info.fps - float(fps)) < 1e-6
    assert abs(info.duration - VIDEO_SECONDS) < 0.05
    decoded = load_video(path, fps=SAMPLE_FPS, max_frames=SAMPLED_FRAMES)
    frames = decoded.frames.numpy()
    assert frames.shape == (SAMPLED_FRAMES, h, w, 3)
    diff = np.abs(frames.astype(np.int16) - s.frames.astype(np.int16))
    assert diff.mean(axis=(1, 2, 3)).max() < 4.0
    assert light_on(frames) == light_on(s.frames)
    # The sampler picked the very frames training renders: a neighbour (1/fps earlier
    # or later) of a moving shape would be further off than the codec's error.
    full = render_frames(s.scene.shape, video_frame_times(fps), w, h)
    for got, k in zip(frames, sampled_frame_indices(fps)):
        errors = {j: np.abs(got.astype(np.int16) - full[j]).mean() for j in (k - 1, k, k + 1)
                  if 0 <= j < len(full)}
        assert min(errors, key=errors.get) == k or s.scene.shape.start == s.scene.shape.end
    for got, want in zip(frames, s.frames):
        if shape_mask(want).sum() >= LIGHT_PIXELS:
            gx, gy = centroid(got)
            wx, wy = centroid(want)
            assert abs(gx - wx) <= 1.0 and abs(gy - wy) <= 1.0
            assert nearest_color(got) == nearest_color(want)
    if s.audio is not None:
        track = load_audio(path).numpy()
        assert abs(track.size - s.audio.size) <= 2048  # AAC pads the last frame
        assert count_beeps(track) == count_beeps(s.audio) == int(s.answer)
    else:
        with pytest.raises(MediaError, match="no audio"):
            load_audio(path)


@pytest.mark.parametrize("task", VIDEO_TASKS)
def test_video_files_decode_to_the_training_frames(task: str, tmp_path: Path) -> None:
    for k, s in enumerate(_file_samples(task)):
        paths = write_media(s, tmp_path, f"clip{k}")
        assert [p.suffix for p in paths] == [".mp4"] and paths[0].name == f"clip{k}.mp4"
        _check_video_file(s, paths[0])


@pytest.mark.parametrize(("size", "fps", "task"), [
    ((640, 360), 30, "video_direction"),
    ((360, 640), Fraction(30000, 1001), "video_audio_beeps"),
    ((320, 240), 24, "video_blink"),
    ((56, 56), 10, "describe"),
    ((48, 96), 13, "video_direction"),
    ((256, 256), Fraction(24000, 1001), "video_color"),
    ((600, 250), 25, "video_audio_beeps"),
], ids=str)
def test_video_files_of_every_size_and_rate_decode_to_the_training_frames(
    size: tuple[int, int], fps: Fraction, task: str, tmp_path: Path
) -> None:
    for k, s in enumerate(samples_of(task, 2, seed=12, fmt=MediaFormat(size=size, fps=fps))):
        (path,) = write_media(s, tmp_path, f"clip{k}")
        _check_video_file(s, path)


@pytest.mark.parametrize("task", ["image_shape", "image_color"])
def test_png_files_are_exact(task: str, tmp_path: Path) -> None:
    s = _file_samples(task)[0]
    (path,) = write_media(s, tmp_path, "pic")
    assert path.suffix == ".png"
    image = load_image(path).numpy()  # [3, H, W]
    assert np.array_equal(image.transpose(1, 2, 0), s.image)


@pytest.mark.parametrize("task", ["audio_beeps", "audio_pitch"])
def test_wav_files_match(task: str, tmp_path: Path) -> None:
    s = _file_samples(task)[0]
    (path,) = write_media(s, tmp_path / "nested", "clip")
    assert path.suffix == ".wav"
    audio = load_audio(path).numpy()
    assert audio.shape == s.audio.shape
    assert np.abs(audio - s.audio).max() < 1e-3
