"""Woodcock: speculative-decoding drafters that load everywhere and run fast on MLX."""

__version__ = "0.1.0"
