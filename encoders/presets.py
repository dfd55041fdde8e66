"""Encoder shapes used by the demo model and the encoder benchmark."""

from __future__ import annotations

from encoders.audio import AudioEncoderConfig
from encoders.vision import VisionEncoderConfig
from media import VisionPreprocessConfig

# Small enough to train and serve on two CPU cores; the same block structure as
# Qwen2.5-VL (windowed blocks with two full-attention blocks) and Whisper. The
# demo's media are small too: 56-112 px images and frames, 1-3 s sounds.
DEMO_VISION = VisionEncoderConfig(
    depth=4,
    hidden_size=64,
    intermediate_size=128,
    num_heads=2,
    out_hidden_size=256,
    window_size=112,
    fullatt_block_indexes=(1, 3),
)

DEMO_AUDIO = AudioEncoderConfig(
    d_model=64,
    encoder_layers=2,
    encoder_attention_heads=2,
    encoder_ffn_dim=128,
    num_mel_bins=80,
    out_hidden_size=256,
    projector_downsample=2,
    pad_to_full_chunk=False,
)

# The demo's media: pictures and video frames of 56..84 px (2x2 or 3x3 merge
# windows), clips of a few seconds sampled at 2 fps up to 8 frames, sounds of 1..3 s.
DEMO_PREPROCESS = VisionPreprocessConfig(min_pixels=56 * 56, max_pixels=84 * 84)
DEMO_VIDEO_FPS = 2.0
DEMO_VIDEO_MAX_FRAMES = 8

# The same, as the preprocessor_config.json a demo checkpoint carries.
DEMO_PREPROCESSOR_CONFIG = {
    "min_pixels": DEMO_PREPROCESS.min_pixels,
    "max_pixels": DEMO_PREPROCESS.max_pixels,
    "video_min_pixels": DEMO_PREPROCESS.min_pixels,
    "video_max_pixels": DEMO_PREPROCESS.max_pixels,
    "video_fps": DEMO_VIDEO_FPS,
    "video_max_frames": DEMO_VIDEO_MAX_FRAMES,
}
