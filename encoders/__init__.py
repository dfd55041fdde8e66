"""Vision (Qwen2.5-VL family) and audio (Whisper family) encoders, batched across requests.

``VisionEncoder`` / ``AudioEncoder`` encode packed items of any size in one varlen
forward; ``EncoderBatcher`` gathers the items of concurrent requests into those
forwards. Nothing here knows of HTTP.
"""

from encoders.audio import AudioEncoder, AudioEncoderConfig, AudioInput, load_audio_encoder
from encoders.batcher import BatcherConfig, EncoderBatcher, EncoderQueueFull
from encoders.vision import VisionEncoder, VisionEncoderConfig, VisionInput, load_vision_encoder

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
