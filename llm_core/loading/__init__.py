"""Checkpoints: reading safetensors, loading weights into the model, writing test checkpoints."""
