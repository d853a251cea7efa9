"""Woodcock: speculative-decoding drafters that load everywhere and run fast on MLX.

On Linux, importing woodcock before MLX puts the system's OpenBLAS under MLX's CPU backend
(`woodcock.runtime.openblas`); importing it after MLX says once that the slow BLAS stays.
"""

from woodcock.runtime.openblas import load_openblas, warn_if_too_late

__version__ = "0.1.0"

if load_openblas() is None:
    warn_if_too_late()
