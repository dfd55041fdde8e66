"""The reference video decode: every frame from the start, in one pass, picking
the frame on screen at each sampling target (semantics in ``media.video``).

``load_video`` falls back to it for files the chunked decode can't plan (no
timestamps, no keyframe index), and tests and benchmarks compare against it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from fractions import Fraction

import av
import av.error
import numpy as np
import torch

from media.errors import DEFAULT_LIMITS, MediaError, MediaLimits
from media.video_container import (
    MAX_PACKETS_PER_SECOND,
    check_video_file,
    media_error_from_av,
    nominal_rate,
    open_video,
    pick_video_stream,
    rotation_quarter_turns,
    set_decoder_threads,
)
from media.video_frames import VideoFrames, convert_frame, output_geometry, target_pts


def decode_sequential(
    path: str | os.PathLike[str],
    timestamps: Sequence[float],
    threads: int = 1,
    size: tuple[int, int] | None = None,
    limits: MediaLimits = DEFAULT_LIMITS,
) -> VideoFrames:
    """The reference: decode every frame from the start, in one pass, and pick
    the frame on screen at each target (semantics in ``media.video``).

    ``threads`` is the FFmpeg decoder thread count (1 = single-threaded,
    0 = automatic). Used as the fallback for files that can't be planned
    (no timestamps, no keyframe index) and by tests/benchmarks."""
    check_video_file(path, limits)
    container = open_video(path)
    try:
        return _decode_sequential_open(container, list(timestamps), threads, size, limits)
    except av.error.FFmpegError as e:
        raise media_error_from_av(e) from None
    finally:
        container.close()


def _decode_sequential_open(
    container: av.container.InputContainer,
    timestamps: list[float],
    threads: int,
    size: tuple[int, int] | None,
    limits: MediaLimits,
) -> VideoFrames:
    stream = pick_video_stream(container)
    cc = stream.codec_context
    if cc is None:
        raise MediaError("unsupported video codec", 415)
    set_decoder_threads(cc, threads)
    rate = nominal_rate(stream)
    time_base = Fraction(stream.time_base) if stream.time_base else 1 / rate
    step = max(1, round(1 / (rate * time_base)))  # synthetic pts increment
    start: int | None = stream.start_time
    n_out = len(timestamps)
    order: list[int] = []  # slots sorted by target, filled once start is known
    tps: list[int] = []
    k = 0
    out: np.ndarray | None = None
    rot_k = 0
    conv_w = conv_h = 0
    prev: av.VideoFrame | None = None
    prev_pts: int | None = None
    prev_arr: np.ndarray | None = None  # prev converted (several targets may share it)
    limit_ticks: int | None = None
    n_frames = 0
    max_frames = int(limits.max_video_seconds * MAX_PACKETS_PER_SECOND) + 1000

    def assign(slot: int, frame: av.VideoFrame, is_prev: bool) -> None:
        nonlocal prev_arr
        assert out is not None
        if is_prev:
            if prev_arr is None:
                prev_arr = convert_frame(frame, conv_w, conv_h, rot_k)
            out[slot] = prev_arr
        else:
            out[slot] = convert_frame(frame, conv_w, conv_h, rot_k)

    for frame in container.decode(stream):
        n_frames += 1
        if n_frames > max_frames:
            raise MediaError("video is too long (too many frames)", 413)
        if out is None:  # first frame: fixes geometry, rotation and the time origin
            if frame.width * frame.height > limits.max_image_pixels:
                raise MediaError(f"video frames are too large ({frame.width}x{frame.height})", 413)
            rot_k = rotation_quarter_turns(frame, stream)
            out_h, out_w, conv_w, conv_h = output_geometry(frame.width, frame.height, rot_k, size)
            out = np.empty((n_out, out_h, out_w, 3), dtype=np.uint8)
            if start is None:
                start = frame.pts if frame.pts is not None else 0
            tps = [target_pts(t, time_base, start) for t in timestamps]
            order = sorted(range(n_out), key=tps.__getitem__)
            limit_ticks = start + math.ceil(Fraction(limits.max_video_seconds) / time_base)
        if frame.pts is not None:
            fpts = frame.pts
        else:
            fpts = prev_pts + step if prev_pts is not None else start  # type: ignore[operator]
        if fpts > limit_ticks:  # type: ignore[operator]
            raise MediaError(f"video is too long (limit {limits.max_video_seconds:.0f} s)", 413)
        # Targets strictly before this frame belong to the previous one (or to
        # this one when there is no previous: target before the first frame).
        while k < n_out and tps[order[k]] < fpts:
            if prev is None:
                assign(order[k], frame, False)
            else:
                assign(order[k], prev, True)
            k += 1
        if k == n_out:
            break  # every target is before this frame: nothing more to pick
        prev, prev_pts, prev_arr = frame, fpts, None
    if out is None or prev is None and k < n_out:
        raise MediaError("video stream has no decodable frames", 400)
    while k < n_out:  # targets at/after the last frame
        assign(order[k], prev, True)  # type: ignore[arg-type]
        k += 1
    return VideoFrames(
        frames=torch.from_numpy(out),
        timestamps=torch.tensor(timestamps, dtype=torch.float64),
    )
