"""Video for the vision encoder: probe, sampling plan and load, the entry points
of the ``media.video_*`` modules.

Sampling semantics (used by every decode path)
----------------------------------------------
A sampling plan is a list of target times ``t`` in seconds, measured from the
stream's start time (``stream.start_time``; the first frame of a normal file is
at ``t = 0``). For a target ``t`` the chosen frame is **the last decoded frame
whose pts <= t** (the frame on screen at time ``t``); a target before the first
frame gets the first frame. Targets are compared in integer stream ticks,
``start_pts + floor(t / time_base)``, so every path makes the same choice.
Streams without timestamps (raw Annex-B ``.h264``) get synthetic pts: frame
``i`` (in output order) is at ``i / frame_rate``.

``plan_sampling`` puts targets at the *centres* of the sampling intervals,
``t_i = (i + 0.5) / fps`` (not at 0): each frame stands for the interval around
it, and the very first frame (often a black fade-in) isn't over-represented.

The work is split by concern: ``video_container`` opens and validates a file,
``video_probe`` scans its packets, ``video_frames`` turns a chosen frame into
pixels, ``video_chunked`` decodes in parallel and ``video_sequential`` is the
reference decode that every other path must match.
"""

from __future__ import annotations

import logging
import os

import av
import av.error

from media.errors import DEFAULT_LIMITS, MediaLimits
from media.video_chunked import PlanMismatch, decode_chunked
from media.video_container import media_error_from_av
from media.video_frames import VideoFrames
from media.video_probe import plan_sampling, scan_video
from media.video_sequential import decode_sequential

log = logging.getLogger(__name__)


def _usable_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def load_video(
    path: str | os.PathLike[str],
    fps: float = 2.0,
    max_frames: int | None = None,
    threads: int | None = None,
    limits: MediaLimits = DEFAULT_LIMITS,
    size: tuple[int, int] | None = None,
) -> VideoFrames:
    """Sample a video at ``fps`` into upright RGB frames.

    Returns ``VideoFrames(frames=uint8 [T, H, W, 3], timestamps=float64 [T])``
    with T even and <= min(max_frames, limits.max_video_frames); ``size=(h, w)``
    resizes (bilinear) during colour conversion. ``threads`` defaults to the
    usable cores. Frames are exactly those ``decode_sequential`` returns for the
    same timestamps. Raises MediaError: 400 corrupt/empty, 413 too long/large,
    415 not a video / unsupported codec.
    """
    index = scan_video(path, limits)
    timestamps = plan_sampling(index.info, fps=fps, max_frames=max_frames, limits=limits)
    n_threads = _usable_cores() if threads is None else max(1, int(threads))
    try:
        if index.info.seekable:
            try:
                return decode_chunked(path, index, timestamps, n_threads, size)
            except PlanMismatch as e:
                log.warning("video %s: chunked decode fell back to sequential (%s)", path, e)
        # No usable timestamps/index: one pass, parallelism from FFmpeg's threads.
        return decode_sequential(path, timestamps, threads=n_threads, size=size, limits=limits)
    except av.error.FFmpegError as e:
        raise media_error_from_av(e) from None
