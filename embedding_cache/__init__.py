"""Content-addressed multimodal embedding cache."""
