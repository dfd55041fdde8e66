"""Video decoding for the vision encoder: probe, sampling plan, parallel decode.

Sampling semantics (used by every decode path in this module)
---------------------------------------------------------------
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

Decode strategy
---------------
``probe``/``_scan`` demux every packet of the stream once, without decoding
(cheap next to decoding), recording pts and keyframe flags in decode order.
With that packet table the chosen frame of every target is known up front: the
packet with the largest pts <= target. Each chosen packet needs a decode *run*
starting at the nearest keyframe before it in decode order (one keyframe further
back if the chosen frame is a leading picture of that keyframe, e.g. a HEVC
RASL frame of an open GOP); overlapping runs merge. Packets outside any run are
never decoded (tails of GOPs after the last sample, whole GOPs with no sample:
this is what makes sparse sampling cheap). Runs are grouped into chunks balanced
by packets to decode, ~3 chunks per thread, and every chunk is decoded in its
own thread with its own container and single-threaded codec context (PyAV
releases the GIL in demux/decode/sws_scale, so chunks really run in parallel).
For H.264/HEVC, packets that cannot be a chosen frame are fed with
``skip_frame = "NONREF"`` so the decoder drops non-reference pictures (nothing
depends on them and they are never chosen).

Each chunk *verifies* the plan: every chosen pts must come out of the decoder
and the output pts must increase. If anything disagrees (odd demuxer seeking,
decoders that drop or invent frames, ...), the whole request falls back to a
plain sequential decode, which *is* the reference semantics, so results are
always exactly those of ``decode_sequential``.
"""

from __future__ import annotations

import bisect
import functools
import logging
import math
import os
import threading
from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from fractions import Fraction

import av
import av.error
import numpy as np
import torch

from media.errors import DEFAULT_LIMITS, MediaError, MediaLimits

log = logging.getLogger(__name__)

# Decoders that honour ``skip_frame`` per packet (checked per slice / picture),
# so it can be toggled between packets. dav1d reads it only at open, vp9 only
# distinguishes key/non-key: those are decoded in full.
_SKIP_NONREF_DECODERS = frozenset({"h264", "hevc"})
# Chunks per thread: more than one so a slow chunk (complex content, I-frame
# heavy GOPs) doesn't leave the other threads idle at the end.
_CHUNKS_PER_THREAD = 3
# Between two runs of one chunk, re-seek instead of demuxing through the gap
# when the gap is longer than this many packets (demuxing is cheap, but not free
# for large packets of high-bitrate video).
_SEEK_GAP_PACKETS = 240
# Scan guard: no real video has more packets per second than this; a stream that
# does (or claims absurd timestamps) is rejected instead of looped over forever.
_MAX_PACKETS_PER_SECOND = 1000
# Frames decoded in the scan before giving up on getting a first frame out.
_FIRST_FRAME_PACKETS = 512
# Demuxers FFmpeg would happily open that aren't video uploads: text rendered as
# ANSI art (any .txt becomes a "video"), and playlists/references that make
# FFmpeg open *other* files (never follow those for a user upload).
_NOT_VIDEO_FORMATS = frozenset(
    {"tty", "bin", "xbin", "adf", "idf", "hls", "concat", "dash", "ffmetadata", "srt", "ass"}
)
# A stream of one of these codecs with a single frame is a still image (an
# animated GIF/WebP/APNG with several frames is accepted as a video).
_IMAGE_CODECS = frozenset({"png", "apng", "mjpeg", "bmp", "tiff", "webp", "gif", "jpegxl"})
# Resize filter for ``size=``: cheap, and fine for downscaling by < 2x, which
# is what the encoder's resize to a patch grid mostly does.
_INTERPOLATION = "BILINEAR"


# --------------------------------------------------------------------------- types


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


@dataclass
class VideoFrames:
    frames: torch.Tensor  # uint8 [T, H, W, 3], upright RGB
    timestamps: torch.Tensor  # float64 [T], the sampling targets in seconds from start


@dataclass(frozen=True)
class _Index:
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


@dataclass
class _Run:
    """Decode packets [start, end] (decode order) continuously, then drain."""

    start: int
    end: int
    chosen: dict[int, list[int]] = field(default_factory=dict)  # pts -> output slots

    @property
    def cost(self) -> int:
        return self.end - self.start + 1


class _PlanMismatch(Exception):
    """The decoder didn't behave as the packet table predicted; use the reference."""


# ------------------------------------------------------------------ small helpers


def _usable_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def _check_file(path: str | os.PathLike[str], limits: MediaLimits) -> None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise MediaError("video file not found", 400) from None
    except OSError as e:
        raise MediaError(f"cannot read video file: {e.strerror}", 400) from None
    if st.st_size == 0:
        raise MediaError("video file is empty", 400)
    if st.st_size > limits.max_file_bytes:
        raise MediaError(
            f"video file is too large ({st.st_size} bytes, limit {limits.max_file_bytes})", 413
        )


def _looks_like_container(path: str | os.PathLike[str]) -> bool:
    """Magic-number sniff, used only to word an open failure: a known container
    signature that FFmpeg can't open is corrupt/truncated (400), anything else
    isn't a video at all (415)."""
    try:
        with open(path, "rb") as f:
            head = f.read(400)
    except OSError:
        return False
    return (
        head[4:8] in (b"ftyp", b"moov", b"mdat", b"free", b"wide", b"skip")  # MP4/MOV
        or head.startswith(b"\x1a\x45\xdf\xa3")  # Matroska/WebM
        or (head.startswith(b"RIFF") and head[8:12] == b"AVI ")
        or head.startswith((b"FLV\x01", b"OggS", b"\x00\x00\x01\xba", b"\x00\x00\x01\xb3"))
        or head.startswith((b"\x00\x00\x00\x01", b"\x00\x00\x01"))  # Annex-B
        # MPEG-TS: sync byte every 188 bytes (one 'G' alone is just text).
        or (len(head) >= 377 and head[0] == head[188] == head[376] == 0x47)
    )


def _open(path: str | os.PathLike[str]) -> av.container.InputContainer:
    try:
        # metadata_errors="ignore": junk in tags must not fail the whole file.
        # protocol_whitelist: a file may only read itself (no network, no
        # nested URLs from inside a crafted container).
        return av.open(
            str(path), mode="r", metadata_errors="ignore", options={"protocol_whitelist": "file"}
        )
    except av.error.FFmpegError:
        if _looks_like_container(path):
            raise MediaError("video file is corrupt or truncated", 400) from None
        raise MediaError("file is not a recognised video format", 415) from None


def _pick_stream(container: av.container.InputContainer) -> av.video.stream.VideoStream:
    if container.format.name in _NOT_VIDEO_FORMATS:
        raise MediaError("file is not a recognised video format", 415)
    for s in container.streams.video:
        # Cover art in audio files is a one-frame "video" stream: not a video.
        if s.disposition & av.stream.Disposition.attached_pic:
            continue
        return s
    if not container.streams.audio and not container.streams.subtitles:
        # A video container that opened but holds no media at all: its header survived, the rest is damaged.
        raise MediaError("video file is corrupt: it holds no video or audio stream", 400)
    raise MediaError("file contains no video stream", 415)


def _configure(cc: av.video.codeccontext.VideoCodecContext, threads: int) -> None:
    """threads == 1: single-threaded decoder (parallelism comes from chunks).
    threads == 0: FFmpeg's automatic thread count; frame + slice threading."""
    if threads == 1:
        cc.thread_type = "NONE"
        cc.thread_count = 1
    else:
        cc.thread_type = "AUTO"
        cc.thread_count = threads


def _media_error_from_av(e: Exception) -> MediaError:
    if isinstance(e, MediaError):
        return e
    if isinstance(e, (av.error.DecoderNotFoundError, av.error.PatchWelcomeError)):
        return MediaError("unsupported video codec", 415)
    return MediaError("video data is corrupt or truncated", 400)


def _rotation_k(frame: av.VideoFrame | None, stream: av.video.stream.VideoStream) -> int:
    """Quarter turns counter-clockwise (np.rot90's k) that make frames upright.

    FFmpeg attaches the display matrix (MP4 ``tkhd`` matrix, Matroska projection)
    to every decoded frame; ``frame.rotation`` is its counter-clockwise angle.
    Old files may only carry the legacy ``rotate`` tag, which is clockwise."""
    deg = 0.0
    if frame is not None:
        try:
            deg = float(frame.rotation)
        except (AttributeError, TypeError, ValueError):
            deg = 0.0
    if deg == 0.0:
        try:
            deg = -float(stream.metadata.get("rotate", 0))
        except (TypeError, ValueError):
            deg = 0.0
    # Only quarter turns are meaningful for pixel grids; round anything else.
    return int(round(deg / 90.0)) % 4


def _target_pts(t: float, time_base: Fraction, start_pts: int) -> int:
    # Exact (Fraction of the float) so every path floors identically.
    return start_pts + math.floor(Fraction(t) / time_base)


def _nominal_rate(stream: av.video.stream.VideoStream) -> Fraction:
    for r in (stream.guessed_rate, stream.average_rate, stream.base_rate):
        if r is not None and r > 0:
            return Fraction(r)
    return Fraction(25)  # FFmpeg's own default for raw streams


def _convert(frame: av.VideoFrame, conv_w: int, conv_h: int, rot_k: int) -> np.ndarray:
    """RGB24 at (conv_w, conv_h) (the pre-rotation size), then rotated upright.

    Always passing the size also normalises mid-stream resolution changes."""
    arr = frame.to_ndarray(
        format="rgb24", width=conv_w, height=conv_h, interpolation=_INTERPOLATION
    )
    return np.rot90(arr, rot_k) if rot_k else arr


def _output_geometry(
    frame_w: int, frame_h: int, rot_k: int, size: tuple[int, int] | None
) -> tuple[int, int, int, int]:
    """-> (out_h, out_w, conv_w, conv_h): upright output size and the size to
    convert to before rotating (swapped for quarter turns)."""
    if rot_k % 2:
        up_h, up_w = frame_w, frame_h
    else:
        up_h, up_w = frame_h, frame_w
    if size is not None:
        out_h, out_w = int(size[0]), int(size[1])
        if out_h <= 0 or out_w <= 0:
            raise MediaError("size must be positive", 400)
    else:
        out_h, out_w = up_h, up_w
    conv_w, conv_h = (out_h, out_w) if rot_k % 2 else (out_w, out_h)
    return out_h, out_w, conv_w, conv_h


# ------------------------------------------------------------------------- probe


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


def _scan(path: str | os.PathLike[str], limits: MediaLimits) -> _Index:
    _check_file(path, limits)
    container = _open(path)
    try:
        return _scan_open(container, limits)
    except av.error.FFmpegError as e:
        raise _media_error_from_av(e) from None
    except (ValueError, RuntimeError) as e:
        if isinstance(e, MediaError):
            raise
        raise MediaError("video file is corrupt or unsupported", 400) from None
    finally:
        container.close()


def _scan_open(container: av.container.InputContainer, limits: MediaLimits) -> _Index:
    stream = _pick_stream(container)
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
    _configure(cc, 1)
    time_base = Fraction(stream.time_base) if stream.time_base else None
    start = stream.start_time
    limit_ticks: int | None = None
    if time_base is not None and start is not None:
        limit_ticks = start + math.ceil(Fraction(limits.max_video_seconds) / time_base)
    max_packets = int(limits.max_video_seconds * _MAX_PACKETS_PER_SECOND) + 1000

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
    rot_k = _rotation_k(first, stream)
    rate = _nominal_rate(stream)
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
    return _Index(
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
    return _scan(path, limits).info


# -------------------------------------------------------------------------- plan


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


# ------------------------------------------------------------ sequential (reference)


def decode_sequential(
    path: str | os.PathLike[str],
    timestamps: Sequence[float],
    threads: int = 1,
    size: tuple[int, int] | None = None,
    limits: MediaLimits = DEFAULT_LIMITS,
) -> VideoFrames:
    """The reference: decode every frame from the start, in one pass, and pick
    the frame on screen at each target (see module docstring).

    ``threads`` is the FFmpeg decoder thread count (1 = single-threaded,
    0 = automatic). Used as the fallback for files that can't be planned
    (no timestamps, no keyframe index) and by tests/benchmarks."""
    _check_file(path, limits)
    container = _open(path)
    try:
        return _decode_sequential_open(container, list(timestamps), threads, size, limits)
    except av.error.FFmpegError as e:
        raise _media_error_from_av(e) from None
    finally:
        container.close()


def _decode_sequential_open(
    container: av.container.InputContainer,
    timestamps: list[float],
    threads: int,
    size: tuple[int, int] | None,
    limits: MediaLimits,
) -> VideoFrames:
    stream = _pick_stream(container)
    cc = stream.codec_context
    if cc is None:
        raise MediaError("unsupported video codec", 415)
    _configure(cc, threads)
    rate = _nominal_rate(stream)
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
    max_frames = int(limits.max_video_seconds * _MAX_PACKETS_PER_SECOND) + 1000

    def assign(slot: int, frame: av.VideoFrame, is_prev: bool) -> None:
        nonlocal prev_arr
        assert out is not None
        if is_prev:
            if prev_arr is None:
                prev_arr = _convert(frame, conv_w, conv_h, rot_k)
            out[slot] = prev_arr
        else:
            out[slot] = _convert(frame, conv_w, conv_h, rot_k)

    for frame in container.decode(stream):
        n_frames += 1
        if n_frames > max_frames:
            raise MediaError("video is too long (too many frames)", 413)
        if out is None:  # first frame: fixes geometry, rotation and the time origin
            if frame.width * frame.height > limits.max_image_pixels:
                raise MediaError(f"video frames are too large ({frame.width}x{frame.height})", 413)
            rot_k = _rotation_k(frame, stream)
            out_h, out_w, conv_w, conv_h = _output_geometry(frame.width, frame.height, rot_k, size)
            out = np.empty((n_out, out_h, out_w, 3), dtype=np.uint8)
            if start is None:
                start = frame.pts if frame.pts is not None else 0
            tps = [_target_pts(t, time_base, start) for t in timestamps]
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


# --------------------------------------------------------------- chunked (parallel)


def _plan_runs(index: _Index, tps: list[int]) -> list[_Run]:
    """Chosen packet per target -> merged decode runs (see module docstring)."""
    pts = index.pkt_pts
    order = sorted(range(len(pts)), key=pts.__getitem__)
    sorted_pts = [pts[i] for i in order]
    keys = index.key_idx
    spans: dict[int, tuple[int, int]] = {}  # chosen packet -> (run start, chosen)
    chosen_slots: dict[int, list[int]] = {}
    for slot, tp in enumerate(tps):
        j = bisect.bisect_right(sorted_pts, tp) - 1
        c = order[max(j, 0)]  # before the first frame -> the first frame
        chosen_slots.setdefault(c, []).append(slot)
        if c in spans:
            continue
        kp = bisect.bisect_right(keys, c) - 1
        # A leading picture (pts before its keyframe's) depends on the previous GOP.
        while kp >= 0 and pts[keys[kp]] > pts[c]:
            kp -= 1
        if kp < 0:
            raise _PlanMismatch("chosen frame precedes every keyframe")
        spans[c] = (keys[kp], c)
    runs: list[_Run] = []
    for s, c in sorted(spans.values()):
        # Merge when overlapping or adjacent: continuing costs nothing extra.
        if runs and s <= runs[-1].end + 1:
            runs[-1].end = max(runs[-1].end, c)
        else:
            runs.append(_Run(start=s, end=c))
        runs[-1].chosen[pts[c]] = chosen_slots[c]
    return runs


def _split_chunks(runs: list[_Run], n_chunks: int) -> list[list[_Run]]:
    """Consecutive runs in n_chunks groups of about equal decode cost (packets)."""
    n_chunks = max(1, min(n_chunks, len(runs)))
    if n_chunks == 1:
        return [runs]
    prefix = [0]
    for r in runs:
        prefix.append(prefix[-1] + r.cost)
    total = prefix[-1]
    cuts = [0]
    for k in range(1, n_chunks):
        ideal = total * k / n_chunks
        i = bisect.bisect_left(prefix, ideal)
        # Closest run boundary to the ideal split, keeping every chunk non-empty.
        if i > 0 and (i >= len(prefix) or ideal - prefix[i - 1] < prefix[i] - ideal):
            i -= 1
        i = min(max(i, cuts[-1] + 1), len(runs) - (n_chunks - k))
        cuts.append(i)
    cuts.append(len(runs))
    return [runs[a:b] for a, b in zip(cuts, cuts[1:]) if b > a]


class _Cursor:
    """Demux position over the packet table: ``goto(i)`` makes packet i (decode
    order) the next one, by reading forward or by seeking; ``next()`` returns it."""

    def __init__(
        self,
        container: av.container.InputContainer,
        stream: av.video.stream.VideoStream,
        index: _Index,
        pos_of: dict[int, int],
    ) -> None:
        self.container = container
        self.stream = stream
        self.index = index
        self.pos_of = pos_of
        self.it = container.demux(stream)
        self.pending: av.Packet | None = None
        self.next_pos = 0  # decode-order index the next read would return (hint)
        self.fresh = True  # nothing read yet: the demuxer is at the file start

    def _read(self) -> tuple[av.Packet, int] | None:
        if self.pending is not None:
            p, self.pending = self.pending, None
        else:
            p = None
            for q in self.it:
                if q.size:
                    p = q
                    break
            if p is None:
                return None
        i = self.pos_of.get(p.pts) if p.pts is not None else None
        if i is None:
            raise _PlanMismatch("demuxed a packet that the scan did not see")
        return p, i

    def _seek(self, i: int) -> None:
        pts, dts = self.index.pkt_pts[i], self.index.pkt_dts[i]
        # MP4 seeks on dts, Matroska/TS on pts; dts <= pts, so seeking to the
        # smaller can only land early (read forward), not late.
        target = pts if dts is None else min(pts, dts)
        self.container.seek(target, stream=self.stream, backward=True, any_frame=False)
        self.it = self.container.demux(self.stream)
        self.pending = None

    def goto(self, i: int) -> None:
        fresh, self.fresh = self.fresh, False
        if fresh and i == 0:
            pass  # already at the start
        elif fresh or i < self.next_pos or i - self.next_pos > _SEEK_GAP_PACKETS:
            keys = self.index.key_idx
            kp = bisect.bisect_left(keys, i)  # i is a keyframe index
            for attempt in range(3):
                self._seek(keys[max(kp - attempt, 0)])
                got = self._read()
                if got is None:
                    raise _PlanMismatch("seek ran past the end")
                if got[1] <= i:
                    self.pending = got[0]
                    break
            else:
                raise _PlanMismatch("seek keeps landing after the target")
        while True:  # read forward to packet i
            got = self._read()
            if got is None:
                raise _PlanMismatch("stream ended before a planned packet")
            p, j = got
            if j == i:
                self.pending = p
                self.next_pos = i
                return
            if j > i:
                raise _PlanMismatch("demuxer skipped a planned packet")

    def next(self) -> tuple[av.Packet, int] | None:
        got = self._read()
        if got is not None:
            self.next_pos = got[1] + 1
        return got


def _decode_chunk(
    path: str | os.PathLike[str],
    index: _Index,
    runs: list[_Run],
    pos_of: dict[int, int],
    out: np.ndarray,
    conv: tuple[int, int],
    dec_threads: int,
    skip_nonref: bool,
    cancel: threading.Event,
) -> int:
    """Decode one chunk's runs into ``out``; returns packets fed to the decoder."""
    container = _open(path)
    fed = 0
    try:
        stream = container.streams[index.stream_index]
        cc = stream.codec_context
        _configure(cc, dec_threads)
        cursor = _Cursor(container, stream, index, pos_of)
        conv_w, conv_h = conv
        pts_tab = index.pkt_pts
        for run in runs:
            if cancel.is_set():
                return fed
            cursor.goto(run.start)
            start_pts = pts_tab[run.start]
            remaining = set(run.chosen)
            last = start_pts - 1
            skipping = False

            def handle(frames: list[av.VideoFrame]) -> None:
                nonlocal last
                for f in frames:
                    fp = f.pts
                    if fp is None:
                        raise _PlanMismatch("decoder produced a frame without pts")
                    if fp < start_pts:
                        continue  # leading picture of the run's keyframe: not ours
                    if fp <= last:
                        raise _PlanMismatch("decoder output pts not increasing")
                    last = fp
                    if fp in remaining:
                        arr = _convert(f, conv_w, conv_h, index.rot_k)
                        for slot in run.chosen[fp]:
                            out[slot] = arr
                        remaining.discard(fp)

            for _ in range(run.cost):
                got = cursor.next()
                if got is None:
                    raise _PlanMismatch("stream ended inside a run")
                p, _j = got
                if skip_nonref:
                    # A packet that isn't a chosen frame is never output to the
                    # user; if it's also non-reference nothing needs it at all.
                    want_skip = p.pts not in run.chosen
                    if want_skip != skipping:
                        cc.skip_frame = "NONREF" if want_skip else "DEFAULT"
                        skipping = want_skip
                handle(cc.decode(p))
                fed += 1
            if skipping:
                cc.skip_frame = "DEFAULT"
            handle(cc.decode(None))  # drain: the run's last frames are buffered
            cc.flush_buffers()  # resets the drained decoder for the next run
            if remaining:
                raise _PlanMismatch(f"{len(remaining)} planned frames were not output")
        return fed
    finally:
        container.close()


def _decode_chunked(
    path: str | os.PathLike[str],
    index: _Index,
    timestamps: list[float],
    threads: int,
    size: tuple[int, int] | None,
    skip_nonref: bool | None = None,
) -> VideoFrames:
    tps = [_target_pts(t, index.time_base, index.start_pts) for t in timestamps]
    runs = _plan_runs(index, tps)
    n_chunks = 1 if threads == 1 else threads * _CHUNKS_PER_THREAD
    chunks = _split_chunks(runs, n_chunks)
    # Too few chunks to keep every thread busy (e.g. one long GOP): give each
    # chunk's decoder FFmpeg threads instead. Output is identical either way.
    dec_threads = max(1, threads // len(chunks))
    if skip_nonref is None:
        skip_nonref = index.decoder in _SKIP_NONREF_DECODERS
    out_h, out_w, conv_w, conv_h = _output_geometry(
        index.frame_width, index.frame_height, index.rot_k, size
    )
    out = np.empty((len(timestamps), out_h, out_w, 3), dtype=np.uint8)
    pos_of = {p: i for i, p in enumerate(index.pkt_pts)}
    cancel = threading.Event()
    run_chunk = functools.partial(
        _decode_chunk, path, index, pos_of=pos_of, out=out, conv=(conv_w, conv_h),
        dec_threads=dec_threads, skip_nonref=skip_nonref, cancel=cancel,
    )
    if len(chunks) == 1:
        run_chunk(chunks[0])
    else:
        with ThreadPoolExecutor(max_workers=min(threads, len(chunks))) as pool:
            futs = [pool.submit(run_chunk, ch) for ch in chunks]
            wait(futs, return_when=FIRST_EXCEPTION)
            errors = [f.exception() for f in futs if f.done() and f.exception() is not None]
            if errors:
                cancel.set()  # stop the other chunks at their next run
                wait(futs)
                # A MediaError/FFmpeg error (bad data) beats a plan mismatch:
                # the reference decode would hit the same bad data.
                for e in errors:
                    if not isinstance(e, _PlanMismatch):
                        raise e
                raise errors[0]
    return VideoFrames(
        frames=torch.from_numpy(out),
        timestamps=torch.tensor(timestamps, dtype=torch.float64),
    )


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
    index = _scan(path, limits)
    timestamps = plan_sampling(index.info, fps=fps, max_frames=max_frames, limits=limits)
    n_threads = _usable_cores() if threads is None else max(1, int(threads))
    try:
        if index.info.seekable:
            try:
                return _decode_chunked(path, index, timestamps, n_threads, size)
            except _PlanMismatch as e:
                log.warning("video %s: chunked decode fell back to sequential (%s)", path, e)
        # No usable timestamps/index: one pass, parallelism from FFmpeg's threads.
        return decode_sequential(path, timestamps, threads=n_threads, size=size, limits=limits)
    except av.error.FFmpegError as e:
        raise _media_error_from_av(e) from None
