"""Softmax attention and SwiGLU for the target's multi-row forwards on MLX's CPU backend.

MLX's CPU backend computes `exp` (and with it softmax and sigmoid) one element at a time, about
13 ns an element on the README's machine, against 0.2 ns for an add. A decoding step has few
such elements, but verifying k tokens multiplies them by k, and for a few dozen rows they cost
more than the matmuls: verifying 32 tokens of the default target spent ~70 ms of ~220 in
attention's softmax and SwiGLU's sigmoid. Here exp is a degree-7 polynomial in a compiled,
fused kernel (about 3 ns an element, relative error below 1e-7 where float32 exp is normal),
and attention folds each group of query heads sharing a key head into one matmul.

`install_kernels` gives the attention and MLP modules of the model families in `FAST_FORWARDS`
a forward that computes what mlx-lm's does with these kernels, used only inside `kernels_in_use`:
`MlxTarget` enters it while it builds a forward of more than one row on the CPU. The module's
parameters and mlx-lm's modules are left as they are, and the choice is the calling thread's
own (a context variable), so any other forward of the model, in this thread or another, runs
mlx-lm's kernels: a single row (plain decoding, like the baseline it is measured against), a
prompt of plain mlx-lm, training's feature runner. Other families keep mlx-lm's kernels; inputs
these do not cover (other dtypes, additive or per-head masks, attention sinks, quantized caches)
go to mlx-lm's functions unchanged.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator
from functools import lru_cache

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import activations, base, llama, qwen2, qwen3

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
    [B, Hk, S, D] -> [B, H, L, D], for float32, mask None, "causal" (the L queries are the last
    L of the S positions) or a boolean array [B, 1, L, S] (True: the query sees the key)."""
    batch, heads, rows, width = queries.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    boolean_mask = (
        isinstance(mask, mx.array)
        and mask.dtype == mx.bool_
        and mask.ndim == 4
        and mask.shape[1] == 1
    )
    supported = (
        (mask is None or (isinstance(mask, str) and mask == "causal") or boolean_mask)
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
    if boolean_mask:  # [B, 1, L, S], one per batch row (woodcock.runtime.batch)
        scores = mx.where(mx.tile(mask, (1, 1, groups, 1)), scores, -mx.inf)
    elif mask is not None:
        scores = mx.where(_causal_visibility(rows, length, groups), scores, -mx.inf)
    p, bits = _scaled_exp_parts(scores, scores.max(axis=-1, keepdims=True), scale)
    weights = p * bits.view(mx.float32)
    out = (weights @ values) / weights.sum(axis=-1, keepdims=True)
    return out.reshape(batch, heads, rows, width)


def _attention(module: nn.Module, x: mx.array, mask, cache, query_norm, key_norm) -> mx.array:
    """mlx-lm's llama, qwen2 and qwen3 `Attention.__call__` (qwen3: an RMS norm on each head's
    queries and keys before RoPE), with the attention above."""
    batch, rows, _ = x.shape
    queries = module.q_proj(x).reshape(batch, rows, module.n_heads, -1)
    keys = module.k_proj(x).reshape(batch, rows, module.n_kv_heads, -1)
    values = module.v_proj(x).reshape(batch, rows, module.n_kv_heads, -1).transpose(0, 2, 1, 3)
    if query_norm is not None:
        queries, keys = query_norm(queries), key_norm(keys)
    queries, keys = queries.transpose(0, 2, 1, 3), keys.transpose(0, 2, 1, 3)
    if cache is not None:
        queries = module.rope(queries, offset=cache.offset)
        keys = module.rope(keys, offset=cache.offset)
        keys, values = cache.update_and_fetch(keys, values)
    else:
        queries, keys = module.rope(queries), module.rope(keys)
    output = scaled_dot_product_attention(
        queries, keys, values, cache=cache, scale=module.scale, mask=mask
    )
    return module.o_proj(output.transpose(0, 2, 1, 3).reshape(batch, rows, -1))


def _llama_attention(module: nn.Module, x: mx.array, mask=None, cache=None) -> mx.array:
    return _attention(module, x, mask, cache, None, None)


def _qwen3_attention(module: nn.Module, x: mx.array, mask=None, cache=None) -> mx.array:
    return _attention(module, x, mask, cache, module.q_norm, module.k_norm)


def _mlp(module: nn.Module, x: mx.array) -> mx.array:
    """mlx-lm's llama, qwen2 and qwen3 `MLP.__call__`, with the SwiGLU above."""
    return module.down_proj(swiglu(module.gate_proj(x), module.up_proj(x)))


# mlx-lm's classes whose forward is known (as of mlx-lm 0.32), and that forward on these kernels
FAST_FORWARDS: dict[type, Callable] = {
    llama.Attention: _llama_attention,  # also mistral's
    qwen2.Attention: _llama_attention,
    qwen3.Attention: _qwen3_attention,
    llama.MLP: _mlp,
    qwen2.MLP: _mlp,
    qwen3.MLP: _mlp,
}

_in_use = contextvars.ContextVar("woodcock_cpu_kernels_in_use", default=False)


class _Routed:
    """Mixed into one of FAST_FORWARDS' classes by `install_kernels`: inside `kernels_in_use`,
    in the thread (or task) that entered it, the forward on these kernels, else the family's."""

    fast: Callable

    def __call__(self, *args, **kwargs):
        if _in_use.get():
            return self.fast(*args, **kwargs)
        return super().__call__(*args, **kwargs)


@lru_cache(maxsize=len(FAST_FORWARDS))
def _routed_class(stock: type) -> type:
    return type(stock.__name__, (_Routed, stock), {"fast": FAST_FORWARDS[stock]})


def install_kernels(model: nn.Module) -> int:
    """Give each of the model's modules of a class in FAST_FORWARDS (in place: the same
    instance, parameters and attributes, a subclass that adds the routing) a forward on these
    kernels for `kernels_in_use`. Returns how many modules have it (any installed before
    count); installing again changes nothing."""
    routed = 0
    for _, module in model.named_modules():
        if type(module) in FAST_FORWARDS:
            module.__class__ = _routed_class(type(module))
        routed += isinstance(module, _Routed)
    return routed


@contextlib.contextmanager
def kernels_in_use(active: bool = True) -> Iterator[None]:
    """While the block runs (building a lazy graph), in this thread or task only, the modules
    given a forward by `install_kernels` compute with these kernels where `active`."""
    token = _in_use.set(active)
    try:
        yield
    finally:
        _in_use.reset(token)
