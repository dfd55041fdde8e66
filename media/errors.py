"""One error type for every media problem a user can cause, and the limits."""

from __future__ import annotations

from dataclasses import dataclass


class MediaError(ValueError):
    """Bad, unsupported or oversized media. The message is fit for an API user
    (the server answers it with HTTP 400/413/415)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class MediaLimits:
    max_file_bytes: int = 512 << 20
    max_image_pixels: int = 64_000_000  # decoded width x height (decompression bombs)
    max_video_seconds: float = 4 * 3600.0
    max_video_frames: int = 768  # frames sampled, after the fps plan
    max_audio_seconds: float = 3600.0


DEFAULT_LIMITS = MediaLimits()
