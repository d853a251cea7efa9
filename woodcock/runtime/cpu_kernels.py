"""Softmax attention and SwiGLU for the target's multi-row forwards on MLX's CPU backend.

MLX's CPU backend computes `exp` (and with it softmax and sigmoid) one element at a time, about
13 ns an element on the README's machine, against 0.2 ns for an add. A decoding step has few
such elements, but verifying k tokens multiplies them by k, and for a few dozen rows they cost
more than the matmuls: verifying 32 tokens of the default target spent ~70 ms of ~220 in
attention's softmax and SwiGLU's sigmoid. Here exp is a degree-7 polynomial in a compiled,
fused kernel (about 3 ns an element, relative error below 1e-7 where float32 exp is normal),
and attention folds each group of query heads sharing a key head into one matmul.

`MlxTarget` swaps these in for mlx-lm's own functions in the model's modules while it builds a
forward of more than one row on the CPU; a single row (plain decoding, like the baseline it is
measured against) keeps mlx-lm's kernels. Inputs these do not cover (other dtypes, mask arrays,
attention sinks, quantized caches) go to mlx-lm's functions unchanged.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterator
from functools import lru_cache

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import activations, base

LOG2_E = 1.0 / math.log(2.0)
# ln 2 in two parts (Cody and Waite): n * LN2_HIGH is exact for |n| < 2**15
LN2_HIGH, LN2_LOW = 0.693359375, -2.12194440e-4
# e**r = sum r**i / i! for |r| <= ln(2) / 2: the degree-8 term is below 6e-9 of the sum
EXP_COEFFICIENTS = tuple(1.0 / math.factorial(i) for i in range(8))
# adding and subtracting 1.5 * 2**23 rounds a float32 of magnitude < 2**22 to an integer; floor
# or round would be a libm call per element in the compiled kernel
ROUNDING = 12582912.0


def _exp_parts(x: mx.array) -> tuple[mx.array, mx.array]:
    """exp(x) as (p, bits): p = e**r (|r| <= ln(2) / 2) and bits the float32 bit pattern of 2**n,
    as int32, with x = n ln 2 + r. exp(x) = p * bits.view(float32): the view cannot be in a
    shapeless compiled function. Relative error below 1e-7 for |x| <= 86; saturates near
    2.7e38 above 88.5, and is exactly 0 below -87.7, where float32's exp is subnormal (so
    exp(-inf) = 0)."""
    x = mx.clip(x, -88.5, 88.5)
    n = mx.clip((x * LOG2_E + ROUNDING) - ROUNDING, -127.0, 126.0)  # n = -127: bits 0, exp 0
    r = (x - n * LN2_HIGH) - n * LN2_LOW
    p = EXP_COEFFICIENTS[-1]
    for coefficient in reversed(EXP_COEFFICIENTS[:-1]):
        p = p * r + coefficient
    return p, (n.astype(mx.int32) + 127) << 23


STOCK_ATTENTION = base.scaled_dot_product_attention
STOCK_SWIGLU = activations.swiglu

_exp_parts_compiled = mx.compile(_exp_parts, shapeless=True)
_negated_exp_parts = mx.compile(lambda x: _exp_parts(-x), shapeless=True)
_scaled_exp_parts = mx.compile(lambda s, m, scale: _exp_parts((s - m) * scale), shapeless=True)
_swiglu_from_parts = mx.compile(
    lambda gate, x, p, power: gate * x / (1.0 + p * power), shapeless=True
)


def exp(x: mx.array) -> mx.array:
    """exp of a float32 array (see `_exp_parts` for its range)."""
    p, bits = _exp_parts_compiled(x)
    return p * bits.view(mx.float32)


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """mlx-lm's `swiglu`: silu(gate) * x = gate * x / (1 + exp(-gate))."""
    if gate.dtype != mx.float32 or x.dtype != mx.float32:
        return STOCK_SWIGLU(gate, x)
    p, bits = _negated_exp_parts(gate)
    return _swiglu_from_parts(gate, x, p, bits.view(mx.float32))


@lru_cache(maxsize=8)
def _causal_visibility(rows: int, length: int, groups: int) -> mx.array:
    """[groups * rows, length]: row g * rows + r (query r of the last `rows` positions) sees the
    keys at or before its own position."""
    return mx.tile(base.create_causal_mask(rows, offset=length - rows), (groups, 1))


def scaled_dot_product_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache,
    scale: float,
    mask,
    sinks: mx.array | None = None,
) -> mx.array:
    """mlx-lm's `scaled_dot_product_attention`: queries [B, H, L, D], keys and values
    [B, Hk, S, D] -> [B, H, L, D], for float32, mask None or "causal" (the L queries are the last
    L of the S positions)."""
    batch, heads, rows, width = queries.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    supported = (
        (mask is None or (isinstance(mask, str) and mask == "causal"))
        and sinks is None
        and not hasattr(cache, "bits")
        and queries.dtype == keys.dtype == values.dtype == mx.float32
        and heads % kv_heads == 0
    )
    if not supported:
        return STOCK_ATTENTION(
            queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks
        )
    groups = heads // kv_heads
    # query head h reads key head h // groups: a key head's queries are consecutive heads
    grouped = queries.reshape(batch, kv_heads, groups * rows, width)
    scores = grouped @ keys.swapaxes(-1, -2)  # [B, Hk, groups * L, S]
    if mask is not None:
        scores = mx.where(_causal_visibility(rows, length, groups), scores, -mx.inf)
    p, bits = _scaled_exp_parts(scores, scores.max(axis=-1, keepdims=True), scale)
    weights = p * bits.view(mx.float32)
    out = (weights @ values) / weights.sum(axis=-1, keepdims=True)
    return out.reshape(batch, heads, rows, width)


STOCK_AND_FAST = (
    ("scaled_dot_product_attention", STOCK_ATTENTION, scaled_dot_product_attention),
    ("swiglu", STOCK_SWIGLU, swiglu),
)


def kernel_swaps(model: nn.Module) -> list[tuple[object, str, object]]:
    """(module, name, fast function) for each of mlx-lm's functions above that the modules
    defining the model's layers call under its own name."""
    modules = {sys.modules.get(type(m).__module__) for _, m in model.named_modules()}
    modules.add(sys.modules.get(type(model).__module__))
    return [
        (module, name, fast)
        for module in sorted(filter(None, modules), key=lambda m: m.__name__)
        for name, stock, fast in STOCK_AND_FAST
        if getattr(module, name, None) is stock
    ]


@contextlib.contextmanager
def swapped_in(swaps: list[tuple[object, str, object]]) -> Iterator[None]:
    """The fast functions in place of mlx-lm's while the block runs (building a lazy graph)."""
    stock = [(module, name, getattr(module, name)) for module, name, _ in swaps]
    try:
        for module, name, fast in swaps:
            setattr(module, name, fast)
        yield
    finally:
        for module, name, function in stock:
            setattr(module, name, function)
