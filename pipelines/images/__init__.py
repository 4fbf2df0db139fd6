"""Runtime images: keyed by inputs, built once, normalized to be reproducible, pushed by digest."""
