"""Opening an audio source for FFmpeg, size-checked, and asking whether it
holds a sound track: what the API process needs (a clip's sound track becomes
an audio item) without the decoder's torch and torchaudio."""

from __future__ import annotations

import io
import os
from typing import BinaryIO

import av
import av.error

from media.errors import DEFAULT_LIMITS, MediaError, MediaLimits

__all__ = ["OPEN_OPTIONS", "has_audio_track", "open_audio_source"]

# FFmpeg options for every input we open. An empty protocol whitelist stops
# demuxers that open *other* resources by name (concat, HLS playlists, ...)
# from reading local files or URLs named inside user data. Our own input is a
# Python file object, which needs no protocol, so normal files are unaffected.
OPEN_OPTIONS = {"protocol_whitelist": "none"}


def has_audio_track(source: str | os.PathLike[str] | bytes, *, limits: MediaLimits = DEFAULT_LIMITS) -> bool:
    """Whether ``source`` holds an audio stream (e.g. a video's sound track).
    Unreadable input is simply ``False``: decoding it reports the real problem."""
    try:
        with open_audio_source(source, limits) as fileobj:
            with av.open(fileobj, mode="r", container_options=OPEN_OPTIONS) as container:
                return bool(container.streams.audio)
    except (MediaError, av.error.FFmpegError, OSError):
        return False


def open_audio_source(source: str | os.PathLike[str] | bytes, limits: MediaLimits) -> BinaryIO:
    """A seekable binary file for ``source``, after the empty / size checks
    (done before FFmpeg sees a byte, so an oversized upload costs nothing)."""
    fileobj: BinaryIO
    if isinstance(source, (bytes, bytearray, memoryview)):
        size = memoryview(source).nbytes
        _check_size(size, limits)
        fileobj = io.BytesIO(source)
    elif isinstance(source, (str, os.PathLike)):
        fileobj = open(os.fspath(source), "rb")  # noqa: SIM115 - closed by the caller's `with`
        try:
            _check_size(os.fstat(fileobj.fileno()).st_size, limits)
        except BaseException:
            fileobj.close()
            raise
    else:
        raise TypeError(f"audio source must be bytes or a path, got {type(source).__name__}")
    return fileobj


def _check_size(size: int, limits: MediaLimits) -> None:
    if size == 0:
        raise MediaError("The audio file is empty.", status=400)
    if size > limits.max_file_bytes:
        raise MediaError(
            f"The audio file is too large ({size} bytes; the limit is {limits.max_file_bytes} bytes).",
            status=413,
        )
