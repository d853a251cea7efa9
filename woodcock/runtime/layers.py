"""MLX decoder pieces with the torch reference's (Hugging Face's) numerics, for one sequence.

Shared by the EAGLE-3 chain drafter and the block drafters: a layer reads keys/values from a
`KVCache`, from extra `prefix` keys/values placed before its own rows (DFlash's projected
context), or both, under a boolean or additive mask, and can compute its output for only the
trailing rows while still producing keys/values for all of them (a chain needs the last row's
output only; every row's keys are cached).

Module attribute names are the checkpoint's, so `module.load_weights(list(canonical.items()))`
loads a drafter with no rename table. Everything runs in the activation dtype given at load
(fp32 by default: on the CPU backend fp16/bf16 matmuls have no BLAS path and are several times
slower); RMSNorm statistics are fp32 as in transformers whatever that dtype is.
"""

from __future__ import annotations

from functools import partial

import ml_dtypes
import mlx.core as mx
import mlx.nn as nn
import numpy as np

from woodcock import ir, rope

# ---------------------------------------------------------------------------------------------
# numpy -> MLX


def to_mx(array: np.ndarray, dtype: mx.Dtype = mx.float32) -> mx.array:
    """A float numpy array (maybe bfloat16/float8 from ml_dtypes, maybe a read-only memory map)
    as a new MLX array of `dtype`; the source is only read. An MLX array is only cast."""
    if isinstance(array, mx.array):
        return array.astype(dtype)
    if array.dtype == ml_dtypes.bfloat16:
        # MLX cannot take ml_dtypes arrays: carry the 16 bits unchanged and reinterpret them, so
        # nothing is rounded before the (exact) widening to fp32.
        bits = mx.array(np.ascontiguousarray(array).view(np.uint16))
        return bits.view(mx.bfloat16).astype(dtype)
    if array.dtype in (np.float16, np.float32):
        return mx.array(np.ascontiguousarray(array)).astype(dtype)
    # float64 (MLX keeps no float64 on every device) and float8 kinds (exact in fp32).
    return mx.array(np.asarray(array, dtype=np.float32)).astype(dtype)


# ---------------------------------------------------------------------------------------------
# Weight layout


class TransposedLinear(nn.Module):
    """nn.Linear with its weight stored as weight_t [in, out], contiguous.

    The CPU backend's BLAS runs x @ W about twice as fast as x @ W.T at the row counts a
    drafter sees (measured here: 0.30 vs 0.62 ms for a 1152 -> 576 projection of one row; 13 vs
    22 ms for SmolLM2's 49152 x 576 head), so on CPU the loaded layers are swapped for these.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight_t = mx.contiguous(linear.weight.T)
        if "bias" in linear:
            self.bias = linear.bias

    def __call__(self, x: mx.array) -> mx.array:
        if "bias" in self:
            return mx.addmm(self.bias, x, self.weight_t)
        return x @ self.weight_t


def transpose_linears(module: nn.Module) -> None:
    """Replace every nn.Linear under `module` by its TransposedLinear, in place. Call after the
    canonical weights are loaded (parameter names then end in .weight_t); each original [out, in]
    weight is released once nothing else refers to it."""
    for name, child in list(module.items()):
        if isinstance(child, nn.Linear):
            setattr(module, name, TransposedLinear(child))
        elif isinstance(child, nn.Module):
            transpose_linears(child)
        elif isinstance(child, list):
            for i, item in enumerate(child):
                if isinstance(item, nn.Linear):
                    child[i] = TransposedLinear(item)
                elif isinstance(item, nn.Module):
                    transpose_linears(item)


# ---------------------------------------------------------------------------------------------
# RMSNorm


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """HF RMSNorm over the last axis. fp32 takes MLX's fused kernel (the same fp32 arithmetic);
    other dtypes follow transformers step by step: statistics in fp32, the normalised value cast
    back before the weight multiplies it, so bf16 rounds where transformers rounds."""
    if x.dtype == mx.float32 and weight.dtype == mx.float32:
        return mx.fast.rms_norm(x, weight, eps)
    x32 = x.astype(mx.float32)
    x32 = x32 * mx.rsqrt(mx.mean(mx.square(x32), axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = mx.ones((width,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return rms_norm(x, self.weight, self.eps)


# ---------------------------------------------------------------------------------------------
# RoPE


def inverse_frequencies(layer: ir.DecoderLayer) -> np.ndarray:
    """inv_freq [head_dim / 2] fp32 (`woodcock.rope`): the reference's formulas with a correctly
    rounded power, so about 1 % of entries differ from the reference's by one ulp."""
    return rope.inverse_frequencies(layer, "the MLX runtime")


def _periods(inv_freq: np.ndarray) -> np.ndarray:
    """The fp32 `freqs` argument of mx.fast.rope, which uses 1 / freqs as the inverse frequency:
    the value whose fp32 reciprocal is nearest to inv_freq (equal to it whenever one exists), so
    the angles are position * inv_freq as the reference computes them."""
    periods = (np.float32(1.0) / inv_freq).astype(np.float32)
    best, best_error = periods.copy(), np.abs(np.float32(1.0) / periods - inv_freq)
    for direction in (np.inf, 0.0):
        candidate = periods
        for _ in range(2):
            candidate = np.nextafter(candidate, np.float32(direction))
            error = np.abs(np.float32(1.0) / candidate - inv_freq)
            better = error < best_error
            best, best_error = np.where(better, candidate, best), np.minimum(error, best_error)
    return best.astype(np.float32)


class RoPE:
    """Neox-layout rotary embedding of one layer (not a module: it has no weights)."""

    def __init__(self, layer: ir.DecoderLayer):
        self.dims = layer.head_dim
        self.inv_freq_np = inverse_frequencies(layer)
        self.inv_freq = mx.array(self.inv_freq_np)  # [hd / 2]
        self._periods = mx.array(_periods(self.inv_freq_np))

    def __call__(self, x: mx.array, offset: int | mx.array) -> mx.array:
        """x [B, heads, T, hd] at positions offset .. offset + T - 1 (an mx.array offset may give
        one start per batch entry: the way to rotate arbitrary positions is to put the rows on
        the batch axis). One fused op; the angles are computed in fp32 like the reference's
        tables."""
        return mx.fast.rope(
            x,
            self.dims,
            traditional=False,
            base=None,
            scale=1.0,
            offset=offset,
            freqs=self._periods,
        )


def rope_tables(
    positions: mx.array, inv_freq: mx.array, dtype: mx.Dtype = mx.float32
) -> tuple[mx.array, mx.array]:
    """cos, sin [T, hd] for integer positions [T], as the reference builds them: fp32 angles,
    both halves equal, cast to the activation dtype. With `apply_rope`, the explicit-table
    path for positions that are not a run (trees); `RoPE` is the fused one."""
    angles = positions.astype(mx.float32)[:, None] * inv_freq[None, :]
    angles = mx.concatenate([angles, angles], axis=-1)
    return mx.cos(angles).astype(dtype), mx.sin(angles).astype(dtype)


def apply_rope(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """x [..., T, hd], cos/sin [T, hd]."""
    half = x.shape[-1] // 2
    rotated = mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


# ---------------------------------------------------------------------------------------------
# Attention


class KVCache:
    """One layer's keys/values [1, nkv, capacity, hd]; the first `offset` rows are valid. Rows are
    written in place and capacity grows in steps, so a chain step copies nothing already cached;
    dropping rows is `trim(length)` (they are overwritten later)."""

    step = 256

    def __init__(self) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0

    def update_and_fetch(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        """Append k, v [1, nkv, T, hd]; return every valid row, [1, nkv, offset, hd] each."""
        start, rows = self.offset, k.shape[2]
        if self.keys is None or start + rows > self.keys.shape[2]:
            capacity = -(-(start + rows) // self.step) * self.step
            shape = (1, k.shape[1], capacity, k.shape[3])
            keys, values = mx.zeros(shape, k.dtype), mx.zeros(shape, v.dtype)
            if self.keys is not None and start:
                keys[:, :, :start] = self.keys[:, :, :start]
                values[:, :, :start] = self.values[:, :, :start]
            self.keys, self.values = keys, values
        self.keys[:, :, start : start + rows] = k
        self.values[:, :, start : start + rows] = v
        self.offset = start + rows
        return self.keys[:, :, : self.offset], self.values[:, :, : self.offset]

    def trim(self, length: int) -> None:
        self.offset = min(self.offset, length)


class Attention(nn.Module):
    def __init__(self, layer: ir.DecoderLayer, width_in: int):
        super().__init__()
        hd, bias = layer.head_dim, layer.attention_bias
        self.num_heads, self.num_kv_heads, self.head_dim = (
            layer.num_attention_heads,
            layer.num_key_value_heads,
            hd,
        )
        self.scale = hd**-0.5
        self.q_proj = nn.Linear(width_in, self.num_heads * hd, bias=bias)
        self.k_proj = nn.Linear(width_in, self.num_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(width_in, self.num_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * hd, layer.hidden_size, bias=bias)
        self.qk_norm = layer.style == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(hd, layer.rms_norm_eps)
            self.k_norm = RMSNorm(hd, layer.rms_norm_eps)
        self.rope = RoPE(layer)

    def _heads(self, x: mx.array, heads: int) -> mx.array:
        """[T, heads * hd] or [B, T, heads * hd] -> [B (1), heads, T, hd]."""
        return x.reshape(-1, x.shape[-2], heads, self.head_dim).transpose(0, 2, 1, 3)

    def queries(self, x: mx.array, offset: int | mx.array) -> mx.array:
        """x [(B,) T, width_in] at positions offset.. (an mx.array: one start per batch entry)
        -> q [B (1), nh, T, hd] after q_norm and RoPE."""
        q = self.q_proj(x).reshape(-1, x.shape[-2], self.num_heads, self.head_dim)
        if self.qk_norm:
            # Per head, before the heads move to axis 1 (the norm is over hd either way).
            q = self.q_norm(q)
        return self.rope(q.transpose(0, 2, 1, 3), offset)

    def keys_values(self, x: mx.array, offset: int | mx.array) -> tuple[mx.array, mx.array]:
        """x [(B,) S, width_in] -> k, v [B (1), nkv, S, hd]; k after k_norm and RoPE, v
        untouched."""
        k = self.k_proj(x).reshape(-1, x.shape[-2], self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            k = self.k_norm(k)
        k = self.rope(k.transpose(0, 2, 1, 3), offset)
        return k, self._heads(self.v_proj(x), self.num_kv_heads)

    def attend(
        self, q: mx.array, keys: mx.array, values: mx.array, mask: str | mx.array | None
    ) -> mx.array:
        """q [B, nh, T, hd], keys/values [B, nkv, S, hd] (GQA: not repeated), mask None, "causal"
        (lower-right aligned: the last query row is the last key), or [T, S] (a batch: [B, 1, T,
        S]) boolean (True = visible) or additive -> o_proj output [B, T, H]. Every row must see
        at least one key."""
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(q.shape[0], q.shape[2], -1))


@partial(mx.compile, shapeless=True)
def _swiglu(gate: mx.array, up: mx.array) -> mx.array:
    # One fused elementwise kernel instead of three dispatched ops.
    return nn.silu(gate) * up


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, layer: ir.DecoderLayer):
        super().__init__()
        h, i, bias = layer.hidden_size, layer.intermediate_size, layer.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(_swiglu(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm Llama/Qwen3 block. As EAGLE-3's first layer (input "embed_and_hidden") q/k/v
    read 2H features, [input_layernorm(token embedding) ; hidden_norm(hidden state)]."""

    def __init__(self, layer: ir.DecoderLayer):
        super().__init__()
        self.config = layer
        h, eps = layer.hidden_size, layer.rms_norm_eps
        self.embed_and_hidden = layer.input == "embed_and_hidden"
        if self.embed_and_hidden:
            self.hidden_norm = RMSNorm(h, eps)
        self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = Attention(layer, 2 * h if self.embed_and_hidden else h)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = MLP(layer)

    def attention_input(
        self, x: mx.array, embeds: mx.array | None, norm_before_residual: bool
    ) -> tuple[mx.array, mx.array]:
        """(what q/k/v read [T, width_in], the residual stream [T, H])."""
        if not self.embed_and_hidden:
            return self.input_layernorm(x), x
        if embeds is None:
            raise ValueError("an embed_and_hidden layer needs the token embeddings")
        hidden = self.hidden_norm(x)
        # Checkpoints order the 2H input columns embedding first.
        both = mx.concatenate([self.input_layernorm(embeds), hidden], axis=-1)
        return both, hidden if norm_before_residual else x

    def __call__(
        self,
        x: mx.array,
        offset: int,
        mask: str | mx.array | None = None,
        *,
        cache: KVCache | None = None,
        prefix: tuple[mx.array, mx.array] | None = None,
        key_start: int = 0,
        embeds: mx.array | None = None,
        norm_before_residual: bool = False,
        out_rows: int | None = None,
    ) -> tuple[mx.array, mx.array, mx.array]:
        """x [T, H], rows at positions offset .. offset + T - 1 -> (y [R, H], k, v [1, nkv, T, hd]
        of these rows). Several sequences at once: x [B, T, H], offset [B] (an mx.array), a
        cache holding B rows (woodcock.runtime.batch.RowCache) and a [B, 1, T, S] mask -> y
        [B, R, H].

        The keys attended are [prefix ; cache rows (these rows appended) or these rows], from
        index key_start on (a sliding window drops the ones before it). out_rows: compute y for
        the last R rows only (keys/values still for all T); mask then has R rows.
        """
        rows = x.shape[-2]
        attn_in, residual = self.attention_input(x, embeds, norm_before_residual)
        k, v = self.self_attn.keys_values(attn_in, offset)
        keys, values = cache.update_and_fetch(k, v) if cache is not None else (k, v)
        if prefix is not None:
            keys = mx.concatenate([prefix[0], keys], axis=2)
            values = mx.concatenate([prefix[1], values], axis=2)
        if key_start:
            keys, values = keys[:, :, key_start:], values[:, :, key_start:]
        if out_rows is not None and out_rows < rows:
            kept = slice(rows - out_rows, None)
            attn_in, residual = attn_in[..., kept, :], residual[..., kept, :]
            offset = offset + rows - out_rows
        q = self.self_attn.queries(attn_in, offset)
        y = residual + self.self_attn.attend(q, keys, values, mask).reshape(residual.shape)
        return y + self.mlp(self.post_attention_layernorm(y)), k, v
