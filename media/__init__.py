"""Media decoding and preprocessing (images, video, audio) for the encoders.

Every user-caused problem (corrupt, truncated, oversized, unsupported input)
raises ``MediaError`` with a message fit for an API user and an HTTP status.
"""

from media.audio import audio_features, has_audio_track, load_audio
from media.errors import DEFAULT_LIMITS, MediaError, MediaLimits
from media.image import load_images_batch
from media.image_decode import load_image
from media.vision_preprocess import (
    VIDEO_PREPROCESS,
    ImageBatch,
    VisionPreprocessConfig,
    preprocess_images,
    preprocess_video,
)
from media.video import load_video, plan_sampling, probe_video
from media.video_frames import VideoFrames
from media.video_probe import VideoInfo

__all__ = [
    "DEFAULT_LIMITS",
    "VIDEO_PREPROCESS",
    "ImageBatch",
    "MediaError",
    "MediaLimits",
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
