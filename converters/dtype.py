"""Cast a drafter's weights to another floating-point dtype."""

from __future__ import annotations

from woodcock.errors import DrafterError
from woodcock.ir import Drafter
from woodcock.tensorfile import DTYPES

CASTS = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


def cast(drafter: Drafter, dtype: str) -> Drafter:
    """Tensors already in `dtype` are kept as they are (memory maps stay maps)."""
    if dtype not in CASTS:
        raise DrafterError(f"--dtype {dtype!r}: expected one of {', '.join(CASTS)}")
    target = DTYPES[CASTS[dtype]]
    weights = {
        name: array if array.dtype == target else array.astype(target)
        for name, array in drafter.weights.items()
    }
    return Drafter(drafter.spec, drafter.vocab, weights)
