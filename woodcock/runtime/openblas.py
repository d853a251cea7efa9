"""Put OpenBLAS under MLX's CPU backend on Linux without LD_PRELOAD.

The `mlx-cpu` wheel's libmlx imports `cblas_sgemm` & co., and the dynamic linker answers an
import from the global scope before libmlx's own dependencies (the bundled reference BLAS; see
`woodcock.runtime.machine`). Opening the system's OpenBLAS with RTLD_GLOBAL before libmlx is
loaded therefore makes every MLX matmul on the CPU call OpenBLAS: 3-18x faster GEMMs, and
verifying a few tokens costs little more than decoding one, which speculative decoding needs.

This module imports nothing of MLX: `load_openblas` must run before `mlx.core` is imported.
Importing `woodcock` calls it (and `warn_if_too_late`), so a script that imports woodcock before
MLX gets the fast BLAS without doing anything. Where MLX computes on a GPU (CUDA, Metal) only
its CPU stream calls BLAS: the library is still opened, and nothing is said about it.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
import warnings
from pathlib import Path

OPT_OUT = "WOODCOCK_OPENBLAS"  # "0": keep the BLAS MLX links against


def find_openblas(machine: str | None = None) -> Path:
    """Where Debian's libopenblas0-pthread puts OpenBLAS (whether it is there or not)."""
    arch = {"x86_64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}.get(
        machine or platform.machine(), machine or platform.machine()
    )
    return Path(f"/usr/lib/{arch}-linux-gnu/openblas-pthread/libopenblas.so.0")


def load_openblas() -> Path | None:
    """Open OpenBLAS into the global scope when that changes what MLX will call: on Linux, before
    MLX is loaded, when OpenBLAS is installed, no BLAS already answers globally (LD_PRELOAD) and
    WOODCOCK_OPENBLAS is not "0". Returns the library opened, else None.

    OPENBLAS_NUM_THREADS (read by OpenBLAS when it is opened) defaults to the cores this process
    may use, written out so that latency profiles are keyed by it: on the README's 2-core machine
    two threads made plain decoding ~1.2x and woodcock ~1.25x faster than one (`woodcock bench`,
    both policies measured)."""
    if platform.system() != "Linux" or os.environ.get(OPT_OUT) == "0":
        return None
    if "mlx.core" in sys.modules:
        return None  # libmlx's imports are bound already
    path = find_openblas()
    if not path.exists() or _global_symbol("cblas_sgemm"):
        return None
    os.environ.setdefault("OPENBLAS_NUM_THREADS", str(usable_cores()))
    try:
        ctypes.CDLL(str(path), mode=os.RTLD_NOW | os.RTLD_GLOBAL)
    except OSError:
        return None  # a broken install: MLX keeps its own BLAS and `woodcock latency` says so
    return path


def usable_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _global_symbol(name: str) -> bool:
    try:
        getattr(ctypes.CDLL(None), name)
    except AttributeError:
        return False
    return True


def warn_if_too_late() -> None:
    """One warning when MLX was imported before woodcock on a Linux machine that has OpenBLAS and
    computes on the CPU: its CPU backend is then bound to the BLAS it bundles, 3-18x slower at
    fp32 matmuls. Silent when MLX's default device is a GPU."""
    if platform.system() != "Linux" or os.environ.get(OPT_OUT) == "0":
        return
    core = sys.modules.get("mlx.core")
    if core is None or _global_symbol("cblas_sgemm"):
        return
    if core.default_device() != core.cpu or not find_openblas().exists():
        return  # on a GPU (CUDA, Metal) MLX's matmuls do not go through the CPU's BLAS
    warnings.warn(
        "mlx was imported before woodcock, so MLX's CPU backend keeps the reference BLAS it"
        " bundles (fp32 matmuls 3-18x slower); import woodcock first, or start Python with"
        f" LD_PRELOAD={find_openblas()}",
        RuntimeWarning,
        stacklevel=3,
    )
