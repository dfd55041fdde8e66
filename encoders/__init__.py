"""Vision (Qwen2.5-VL family) and audio (Whisper family) encoders."""
