"""Vision (Qwen2.5-VL family) and audio (Whisper family) encoders, batched across requests.

``VisionEncoder`` / ``AudioEncoder`` encode packed items of any size in one varlen
forward; ``EncoderBatcher`` gathers the items of concurrent requests into those
forwards. Nothing here knows of HTTP.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llm_core.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from encoders.audio import AudioEncoder, AudioEncoderConfig, AudioInput, load_audio_encoder
    from encoders.batcher import BatcherConfig, EncoderBatcher, EncoderQueueFull
    from encoders.vision import VisionEncoder, VisionEncoderConfig, VisionInput, load_vision_encoder

# Loaded on first use: the API process names EncoderQueueFull without loading an encoder (torch).
_EXPORTS = {
    "AudioEncoder": "encoders.audio",
    "AudioEncoderConfig": "encoders.audio",
    "AudioInput": "encoders.audio",
    "load_audio_encoder": "encoders.audio",
    "BatcherConfig": "encoders.batcher",
    "EncoderBatcher": "encoders.batcher",
    "EncoderQueueFull": "encoders.batcher",
    "VisionEncoder": "encoders.vision",
    "VisionEncoderConfig": "encoders.vision",
    "VisionInput": "encoders.vision",
    "load_vision_encoder": "encoders.vision",
}

__all__ = [
    "AudioEncoder",
    "AudioEncoderConfig",
    "AudioInput",
    "BatcherConfig",
    "EncoderBatcher",
    "EncoderQueueFull",
    "VisionEncoder",
    "VisionEncoderConfig",
    "VisionInput",
    "load_audio_encoder",
    "load_vision_encoder",
]

__getattr__ = lazy_exports(__name__, globals(), _EXPORTS)
