"""Media decoding and preprocessing (images, video, audio) for the encoders."""
