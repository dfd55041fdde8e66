"""Media decoding and preprocessing (images, video, audio) for the encoders.

Every user-caused problem (corrupt, truncated, oversized, unsupported input)
raises ``MediaError`` with a message fit for an API user and an HTTP status.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from media.audio import audio_features, load_audio
    from media.audio_source import has_audio_track
    from media.errors import DEFAULT_LIMITS, MediaError, MediaLimits
    from media.image import load_images_batch
    from media.image_decode import load_image
    from media.video import load_video
    from media.video_frames import VideoFrames
    from media.video_probe import VideoInfo, plan_sampling, probe_video
    from media.vision_geometry import VIDEO_PREPROCESS, VisionPreprocessConfig
    from media.vision_preprocess import ImageBatch, preprocess_images, preprocess_video

# Where each public name lives. They are loaded on first use: a process that only
# refuses media or counts its tokens (a text-only server, a worker) never imports
# torchvision, which alone costs seconds of every start.
_EXPORTS = {
    "audio_features": "media.audio",
    "has_audio_track": "media.audio_source",
    "load_audio": "media.audio",
    "DEFAULT_LIMITS": "media.errors",
    "MediaError": "media.errors",
    "MediaLimits": "media.errors",
    "load_images_batch": "media.image",
    "load_image": "media.image_decode",
    "load_video": "media.video",
    "plan_sampling": "media.video_probe",
    "probe_video": "media.video_probe",
    "VideoFrames": "media.video_frames",
    "VideoInfo": "media.video_probe",
    "VIDEO_PREPROCESS": "media.vision_geometry",
    "VisionPreprocessConfig": "media.vision_geometry",
    "ImageBatch": "media.vision_preprocess",
    "preprocess_images": "media.vision_preprocess",
    "preprocess_video": "media.vision_preprocess",
}

__all__ = [
    "DEFAULT_LIMITS",
    "ImageBatch",
    "MediaError",
    "MediaLimits",
    "VIDEO_PREPROCESS",
    "VideoFrames",
    "VideoInfo",
    "VisionPreprocessConfig",
    "audio_features",
    "has_audio_track",
    "load_audio",
    "load_image",
    "load_images_batch",
    "load_video",
    "plan_sampling",
    "preprocess_images",
    "preprocess_video",
    "probe_video",
]


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'media' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
