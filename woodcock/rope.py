"""RoPE inverse frequencies of a decoder layer, in numpy fp32: how a layer's rope_theta and
rope_scaling are read, shared by the MLX runtime and the torch reference (each builds its own
rotation from them).

transformers' formulas and fp32 operation order for the default, "linear" and "llama3" rope
types; anything else is refused rather than guessed. The powers theta ** (2i / d) are the one
step a backend may take its own way (`powers`): torch's vectorised powf, which the reference
uses to equal transformers bit for bit, is not correctly rounded; the default here is.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from woodcock import ir
from woodcock.errors import DrafterError

f32 = np.float32


def rope_parameter(scaling: dict, key: str, rope_type: str) -> float:
    if key not in scaling:
        raise DrafterError(f"rope_scaling.{key} missing: rope_type {rope_type!r} needs it")
    return scaling[key]


def correctly_rounded_powers(theta: float, exponents: np.ndarray) -> np.ndarray:
    """fp32 theta ** exponents, correctly rounded. torch computes pow(fp32(theta), e) in fp32:
    round theta first, then the exact power. torch's own powf differs by one ulp in about 1 %
    of entries (an angle error of the order of fp32's own rounding of position * inv_freq)."""
    return (np.float64(f32(theta)) ** exponents.astype(np.float64)).astype(f32)


def inverse_frequencies(
    layer: ir.DecoderLayer,
    implementer: str,
    powers: Callable[[float, np.ndarray], np.ndarray] = correctly_rounded_powers,
) -> np.ndarray:
    """inv_freq [head_dim / 2] fp32. `implementer` names who rotates with them in the refusals
    ("the MLX runtime"); `powers(theta, exponents)` gives theta ** exponents in fp32. Everything
    after the power (scaling, llama3's blend) is transformers' fp32 arithmetic bit for bit."""
    dim = layer.head_dim
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(f32) / f32(dim)
    inv_freq = f32(1.0) / powers(layer.rope_theta, exponents)
    scaling = layer.rope_scaling
    if scaling is None:
        return inv_freq
    rope_type = scaling.get("rope_type")
    partial_factor = scaling.get("partial_rotary_factor", 1.0)
    if partial_factor != 1.0:
        raise DrafterError(
            f"rope_scaling.partial_rotary_factor = {partial_factor!r}: {implementer} rotates"
            " the whole head (1.0)"
        )
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / f32(rope_parameter(scaling, "factor", rope_type))
    if rope_type == "llama3":
        factor = rope_parameter(scaling, "factor", rope_type)
        low = rope_parameter(scaling, "low_freq_factor", rope_type)
        high = rope_parameter(scaling, "high_freq_factor", rope_type)
        # transformers' docstring: falls back to max_position_embeddings when not given.
        old_context = scaling.get("original_max_position_embeddings", layer.max_position_embeddings)
        low_wavelen, high_wavelen = old_context / low, old_context / high
        # torch's `scalar / tensor` is reciprocal(tensor) * scalar: written that way for the bits.
        wavelen = (f32(1.0) / inv_freq) * f32(2 * math.pi)
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        scaled = np.where(wavelen > low_wavelen, inv_freq / f32(factor), inv_freq)
        smooth = ((f32(1.0) / wavelen) * f32(old_context) - f32(low)) / f32(high - low)
        blended = (f32(1.0) - smooth) * scaled / f32(factor) + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, blended, scaled).astype(f32)
    raise DrafterError(
        f"rope_scaling.rope_type = {rope_type!r}: {implementer} implements default, 'linear'"
        " and 'llama3' RoPE only"
    )
