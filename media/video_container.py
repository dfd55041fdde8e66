"""Opening an uploaded video safely, and the facts of its video stream that every
decode path reads the same way.

Files are size-checked before FFmpeg sees them, opened with the ``file``
protocol only, and refused when the demuxer is not a video one; every FFmpeg
failure becomes a ``MediaError`` worded for the API user (400 corrupt, 413 too
large, 415 not a video / unsupported codec).
"""

from __future__ import annotations

import os
from fractions import Fraction

import av
import av.error

from media.errors import MediaError, MediaLimits

# Scan guard: no real video has more packets per second than this; a stream that
# does (or claims absurd timestamps) is rejected instead of looped over forever.
MAX_PACKETS_PER_SECOND = 1000
# Demuxers FFmpeg would happily open that aren't video uploads: text rendered as
# ANSI art (any .txt becomes a "video"), and playlists/references that make
# FFmpeg open *other* files (never follow those for a user upload).
_NOT_VIDEO_FORMATS = frozenset(
    {"tty", "bin", "xbin", "adf", "idf", "hls", "concat", "dash", "ffmetadata", "srt", "ass"}
)


def check_video_file(path: str | os.PathLike[str], limits: MediaLimits) -> None:
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


def open_video(path: str | os.PathLike[str]) -> av.container.InputContainer:
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


def pick_video_stream(container: av.container.InputContainer) -> av.video.stream.VideoStream:
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


def set_decoder_threads(cc: av.video.codeccontext.VideoCodecContext, threads: int) -> None:
    """threads == 1: single-threaded decoder (parallelism comes from chunks).
    threads == 0: FFmpeg's automatic thread count; frame + slice threading."""
    if threads == 1:
        cc.thread_type = "NONE"
        cc.thread_count = 1
    else:
        cc.thread_type = "AUTO"
        cc.thread_count = threads


def media_error_from_av(e: Exception) -> MediaError:
    if isinstance(e, MediaError):
        return e
    if isinstance(e, (av.error.DecoderNotFoundError, av.error.PatchWelcomeError)):
        return MediaError("unsupported video codec", 415)
    return MediaError("video data is corrupt or truncated", 400)


def rotation_quarter_turns(frame: av.VideoFrame | None, stream: av.video.stream.VideoStream) -> int:
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


def nominal_rate(stream: av.video.stream.VideoStream) -> Fraction:
    for r in (stream.guessed_rate, stream.average_rate, stream.base_rate):
        if r is not None and r > 0:
            return Fraction(r)
    return Fraction(25)  # FFmpeg's own default for raw streams
