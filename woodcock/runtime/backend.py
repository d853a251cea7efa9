"""Which MLX backend runs, and whether its fp32 matmuls may use TF32.

MLX's CUDA backend (and Metal's on GPUs with matrix units) multiplies fp32 matrices in TF32
unless MLX_ENABLE_TF32=0. TF32 rounds differently with the number of rows (a one-row step takes
a GEMV kernel that ignores it, a verify of several rows a cuBLASLt GEMM that uses it): on an
H200 the same row's fp32 logits differed by up to 3.5e-2 between a 4-row verify and a one-row
step, and greedy speculative output left plain decoding's on 1-2 of 12 prompts; with TF32 off,
24 of 24 were identical at the same speed. So woodcock turns TF32 off unless asked.

MLX reads the variable once, with getenv, the first time an fp32 matmul-family kernel asks for
it (`env::enable_tf32()`, a function-local static in mlx/utils.h, 0.32.4): setting it before the
first such matmul counts, importing MLX earlier does not matter, and later changes do not count.
This module imports nothing of MLX until `report` asks which backend runs.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

TF32_VARIABLE = "MLX_ENABLE_TF32"
TF32_FLAG = "--allow-tf32"


@dataclass(frozen=True)
class Tf32:
    value: str  # MLX_ENABLE_TF32 as MLX will read it
    source: str  # "default" (woodcock's), TF32_FLAG or "environment" (the user's)

    @property
    def enabled(self) -> bool:
        # MLX parses the value with atoi: a leading integer, else 0
        match = re.match(r"\s*[+-]?\d+", self.value)
        return bool(match and int(match.group()))


_configured: Tf32 | None = None


def configure_tf32(allow: bool | None = None) -> Tf32:
    """Set MLX_ENABLE_TF32 for this process before MLX's first fp32 matmul. allow: True (the
    command line's --allow-tf32) turns TF32 on; False (a command without it) leaves a value the
    user exported and otherwise turns TF32 off; None (a library call) keeps what an earlier
    call configured, else acts as False."""
    global _configured
    current = os.environ.get(TF32_VARIABLE)
    ours = _configured is not None and current == _configured.value
    if allow is None and ours:
        return _configured
    if allow:
        setting = Tf32("1", TF32_FLAG)
    elif current is not None and not ours:
        return Tf32(current, "environment")
    else:
        setting = Tf32("0", "default")
    os.environ[TF32_VARIABLE] = setting.value
    _configured = setting
    return setting


def current_tf32() -> Tf32:
    """What MLX reads (or read), and who set it; changes nothing."""
    value = os.environ.get(TF32_VARIABLE)
    if _configured is not None and value == _configured.value:
        return _configured
    if value is not None:
        return Tf32(value, "environment")
    return Tf32("1", "MLX's default")


def report() -> dict:
    """{"backend": "cpu" | "cuda" | "metal" | "gpu", "tf32": bool, "tf32_source": ...}: what the
    commands print and write next to their results."""
    from woodcock.runtime.machine import mlx_device  # loads MLX

    setting = current_tf32()
    return {
        "backend": mlx_device()["backend"],
        "tf32": setting.enabled,
        "tf32_source": setting.source,
    }


def describe(backend: dict) -> str:
    """`report()` in words: "cpu backend"; on a GPU also whether fp32 matmuls use TF32."""
    text = f"{backend['backend']} backend"
    if backend["backend"] == "cpu":
        return text  # MLX's CPU backend has no TF32 path
    state = "on" if backend["tf32"] else "off"
    source = backend["tf32_source"]
    why = f"{TF32_VARIABLE} from the environment" if source == "environment" else source
    return f"{text}, TF32 {state} ({why})"
