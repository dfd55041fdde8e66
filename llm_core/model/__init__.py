"""The model: its configuration, layers, reference attention, FP8 weights, presets, tokenizer and chat template."""
