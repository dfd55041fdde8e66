"""Probing a video: one demux pass over every packet of its video stream (decoding
only up to the first frame), validated against the limits, giving the public
``VideoInfo`` and the ``PacketIndex`` (pts, dts, keyframes in decode order)
that the chunked decode plans with.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from fractions import Fraction

import av
import av.error

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

# Frames decoded in the scan before giving up on getting a first frame out.
_FIRST_FRAME_PACKETS = 512
# A stream of one of these codecs with a single frame is a still image (an
# animated GIF/WebP/APNG with several frames is accepted as a video).
_IMAGE_CODECS = frozenset({"png", "apng", "mjpeg", "bmp", "tiff", "webp", "gif", "jpegxl"})


@dataclass(frozen=True)
class VideoInfo:
    """What ``probe_video`` learns about the first video stream.

    ``width``/``height`` are those of the *upright* frames (after rotation),
    i.e. the shape ``load_video`` returns without ``size``.
    """

    duration: float  # seconds, first frame to end of last frame
    fps: float  # average: frames / duration (VFR-safe)
    frame_count: int | None  # packets in the stream (one frame each); None if unknown
    width: int
    height: int
    codec: str  # canonical codec name ("h264", "hevc", "vp9", "av1", ...)
    rotation: int  # degrees counter-clockwise applied to make frames upright: 0/90/180/270
    keyframe_times: tuple[float, ...]  # seconds from start, presentation order
    seekable: bool  # chunked parallel decode possible (all packets have unique pts)
    container: str  # demuxer name


@dataclass(frozen=True)
class PacketIndex:
    """Packet table from the scan plus what decode paths need to agree on."""

    info: VideoInfo
    stream_index: int
    time_base: Fraction
    start_pts: int
    pkt_pts: tuple[int, ...]  # decode order; empty when not seekable
    pkt_dts: tuple[int | None, ...]
    key_idx: tuple[int, ...]  # decode-order indices of keyframe packets
    frame_width: int  # decoded (pre-rotation) size of the first frame
    frame_height: int
    rot_k: int  # np.rot90 count (counter-clockwise quarter turns)
    decoder: str


def _declared_duration(
    container: av.container.InputContainer, stream: av.video.stream.VideoStream
) -> float | None:
    """The stream's duration as written in the header, where formats store an
    exact one (MP4 track duration, Matroska's per-track DURATION tag). Others
    (MPEG-TS, FLV) only estimate it, so they return None."""
    name = container.format.name
    if "mp4" in name or "mov" in name:
        if stream.duration and stream.time_base:
            return float(stream.duration * stream.time_base)
    elif "matroska" in name:
        tag = stream.metadata.get("DURATION")
        if tag:
            try:
                h, m, sec = tag.split(":")
                return int(h) * 3600 + int(m) * 60 + float(sec)
            except ValueError:
                return None
    return None


def scan_video(path: str | os.PathLike[str], limits: MediaLimits) -> PacketIndex:
    check_video_file(path, limits)
    container = open_video(path)
    try:
        return _scan_open(container, limits)
    except av.error.FFmpegError as e:
        raise media_error_from_av(e) from None
    except (ValueError, RuntimeError) as e:
        if isinstance(e, MediaError):
            raise
        raise MediaError("video file is corrupt or unsupported", 400) from None
    finally:
        container.close()


def _scan_open(container: av.container.InputContainer, limits: MediaLimits) -> PacketIndex:
    stream = pick_video_stream(container)
    cc = stream.codec_context
    if cc is None or stream.codec is None:
        raise MediaError("unsupported video codec", 415)
    codec = stream.codec.canonical_name or stream.codec.name
    # Early 413 from the header, before reading a huge file.
    if container.duration is not None and container.duration > limits.max_video_seconds * 1e6:
        raise MediaError(
            f"video is too long ({container.duration / 1e6:.0f} s, limit "
            f"{limits.max_video_seconds:.0f} s)",
            413,
        )
    set_decoder_threads(cc, 1)
    time_base = Fraction(stream.time_base) if stream.time_base else None
    start = stream.start_time
    limit_ticks: int | None = None
    if time_base is not None and start is not None:
        limit_ticks = start + math.ceil(Fraction(limits.max_video_seconds) / time_base)
    max_packets = int(limits.max_video_seconds * MAX_PACKETS_PER_SECOND) + 1000

    pts: list[int | None] = []
    dts: list[int | None] = []
    durs: list[int] = []
    keys: list[int] = []
    first: av.VideoFrame | None = None
    decoded_packets = 0
    for p in container.demux(stream):
        if p.size == 0:  # PyAV's end-of-stream flush packet, or empty filler
            continue
        if len(pts) >= max_packets:
            raise MediaError("video is too long (too many frames)", 413)
        ppts = p.pts
        if limit_ticks is not None and ppts is not None and ppts > limit_ticks:
            raise MediaError(
                f"video is too long (limit {limits.max_video_seconds:.0f} s)", 413
            )
        if p.is_keyframe:
            keys.append(len(pts))
        pts.append(ppts)
        dts.append(p.dts)
        durs.append(p.duration or 0)
        # Decode only until the first frame: validates the codec/bitstream and
        # gives rotation + real frame size, for the price of one GOP prefix.
        if first is None and decoded_packets < _FIRST_FRAME_PACKETS:
            decoded_packets += 1
            try:
                frames = cc.decode(p)
            except av.error.InvalidDataError:
                frames = []  # e.g. leading non-decodable packets; judged below
            if frames:
                first = frames[0]
    if not pts:
        raise MediaError("video stream contains no frames", 400)
    if codec in _IMAGE_CODECS and len(pts) <= 1:
        raise MediaError("file is an image, not a video", 415)
    if first is None:
        try:
            frames = cc.decode(None)  # drain: short clips may still be buffered
        except av.error.InvalidDataError:
            frames = []
        first = frames[0] if frames else None
    if first is None:
        raise MediaError("video stream has no decodable frames", 400)
    # Index says N frames but the file stops early: truncated.
    if stream.frames and len(pts) < stream.frames:
        raise MediaError("video file is truncated", 400)
    declared = _declared_duration(container, stream)

    frame_w, frame_h = first.width, first.height
    if frame_w <= 0 or frame_h <= 0:
        raise MediaError("video has invalid dimensions", 400)
    if frame_w * frame_h > limits.max_image_pixels:
        raise MediaError(f"video frames are too large ({frame_w}x{frame_h})", 413)
    rot_k = rotation_quarter_turns(first, stream)
    rate = nominal_rate(stream)
    n = len(pts)

    have_pts = all(x is not None for x in pts)
    if time_base is None:
        time_base = 1 / rate
    if have_pts:
        ipts: list[int] = pts  # type: ignore[assignment]
        start_pts = start if start is not None else min(ipts)
        last = max(range(n), key=ipts.__getitem__)
        spts = sorted(ipts)
        gaps = [b - a for a, b in zip(spts, spts[1:]) if b > a]
        last_dur = durs[last] or (sorted(gaps)[len(gaps) // 2] if gaps else 0)
        if not last_dur:
            last_dur = max(1, round(1 / (rate * time_base)))
        duration = float((ipts[last] + last_dur - start_pts) * time_base)
        key_times = tuple(sorted(float((ipts[k] - start_pts) * time_base) for k in keys))
    else:
        # No timestamps: frame i is at i / rate. With closed GOPs a keyframe's
        # decode index equals its presentation index.
        start_pts = 0
        duration = float(n / rate)
        key_times = tuple(float(k / rate) for k in keys)
    if duration > limits.max_video_seconds:
        raise MediaError(
            f"video is too long ({duration:.0f} s, limit {limits.max_video_seconds:.0f} s)", 413
        )
    # Header promises more than the packets deliver: the tail is missing (e.g. a
    # Matroska upload cut short). Tolerance for rounding of the header value.
    if declared is not None and duration < declared * 0.95 - 0.1:
        raise MediaError("video file is truncated", 400)

    seekable = (
        have_pts
        and start is not None
        and bool(keys)
        and keys[0] == 0  # packets before the first keyframe can't be planned
        and len(set(pts)) == n  # pts identify packets
        and all(pts[a] < pts[b] for a, b in zip(keys, keys[1:]))  # type: ignore[operator]
    )
    up_w, up_h = (frame_h, frame_w) if rot_k % 2 else (frame_w, frame_h)
    info = VideoInfo(
        duration=duration,
        fps=(n / duration) if duration > 0 else float(rate),
        frame_count=n,
        width=up_w,
        height=up_h,
        codec=codec,
        rotation=rot_k * 90,
        keyframe_times=key_times,
        seekable=seekable,
        container=container.format.name,
    )
    return PacketIndex(
        info=info,
        stream_index=stream.index,
        time_base=time_base,
        start_pts=start_pts,
        pkt_pts=tuple(pts) if seekable else (),  # type: ignore[arg-type]
        pkt_dts=tuple(dts) if seekable else (),
        key_idx=tuple(keys),
        frame_width=frame_w,
        frame_height=frame_h,
        rot_k=rot_k,
        decoder=cc.name,
    )


def probe_video(
    path: str | os.PathLike[str], limits: MediaLimits = DEFAULT_LIMITS
) -> VideoInfo:
    """Duration, fps, size, codec, rotation and keyframe times of a video.

    One demux pass over the packets (no decoding, except the first frame for
    validation and rotation). Raises MediaError (400/413/415)."""
    return scan_video(path, limits).info


def plan_sampling(
    info: VideoInfo,
    fps: float = 2.0,
    max_frames: int | None = None,
    limits: MediaLimits = DEFAULT_LIMITS,
) -> list[float]:
    """Target times (seconds from start) for sampling at ``fps``.

    Targets are interval centres ``(i + 0.5) / fps`` for every such time before
    the end of the video. If that's more than the cap (``max_frames`` and
    ``limits.max_video_frames``, rounded down to even), the cap is spread evenly:
    ``(i + 0.5) * duration / cap``. The count is always even (the vision encoder
    patches 2 frames in time): an odd count is padded by repeating the last
    target. At least 2 targets, even for a one-frame video.
    """
    if not (isinstance(fps, (int, float)) and math.isfinite(fps) and fps > 0):
        raise MediaError("fps must be a positive number", 400)
    if info.duration > limits.max_video_seconds:
        raise MediaError(
            f"video is too long ({info.duration:.0f} s, limit "
            f"{limits.max_video_seconds:.0f} s)",
            413,
        )
    cap = limits.max_video_frames
    if max_frames is not None:
        cap = min(cap, max_frames)
    if cap < 2:
        raise MediaError("max_frames must be at least 2", 400)
    cap -= cap % 2
    d = max(0.0, float(info.duration))
    # Number of centres (i + 0.5) / fps strictly inside [0, d); the epsilon keeps
    # float noise from adding a target exactly at the end.
    n = max(1, math.ceil(d * fps - 0.5 - 1e-9))
    if n <= cap:
        ts = [(i + 0.5) / fps for i in range(n)]
        if ts[-1] >= d:  # one target for a clip shorter than half an interval
            ts = [d / 2]
    else:
        n = cap
        ts = [(i + 0.5) * d / n for i in range(n)]
    if len(ts) % 2:
        ts.append(ts[-1])
    return ts
