"""Generic decoder pieces with Hugging Face Llama/Qwen3 numerics, for one unbatched sequence.

Everything here follows the HF eager path on purpose (RMSNorm statistics in fp32 and cast back
before the weight, RoPE tables in fp32 cast to the activation dtype, softmax in fp32), because the
reference is compared with speculators and transformers to 1e-5. Module attribute names are the
checkpoint's, so `state_dict()` keys are the canonical tensor names with no rename table.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from woodcock import ir, rope

Tensor = torch.Tensor


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """HF RMSNorm: statistics in fp32, the normalised value cast back before the weight multiplies
    it (the cast happens before the product, so bf16 runs round where transformers rounds)."""
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(width))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


# ---------------------------------------------------------------------------------------------
# RoPE


def _torch_powers(theta: float, exponents: np.ndarray) -> np.ndarray:
    # Written as transformers writes it (power of a python float by an fp32 tensor) so that
    # torch's own powf rounds it: the reference equals transformers bit for bit.
    return (theta ** torch.from_numpy(exponents)).numpy()


def inverse_frequencies(layer: ir.DecoderLayer) -> Tensor:
    """inv_freq [head_dim / 2] in fp32, as transformers computes it (`woodcock.rope`, with
    torch's powers)."""
    return torch.from_numpy(rope.inverse_frequencies(layer, "the torch reference", _torch_powers))


def rope_tables(positions: Tensor, inv_freq: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin [T, head_dim] for integer positions [T]: angles in fp32, both halves equal (neox
    layout), cast to the activation dtype as transformers does. The rope types implemented here
    all have attention_scaling 1, so no post-scaling."""
    angles = positions.to(torch.float32)[:, None] * inv_freq.to(positions.device)[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [heads, T, head_dim], cos/sin [T, head_dim]."""
    return x * cos + rotate_half(x) * sin


# ---------------------------------------------------------------------------------------------
# Attention


def attend(q: Tensor, k: Tensor, v: Tensor, visible: Tensor) -> Tensor:
    """Masked softmax attention with GQA.

    q [nh, T, hd] (RoPE applied), k/v [nkv, S, hd], visible [T, S] bool -> [T, nh * hd].
    Query head h reads kv head h // (nh / nkv) (HF repeat_kv). Every query row must see at least
    one key; callers guarantee it (each row sees itself).
    """
    group = q.shape[0] // k.shape[0]
    k = k.repeat_interleave(group, dim=0)
    v = v.repeat_interleave(group, dim=0)
    scores = torch.matmul(q, k.transpose(1, 2)) * q.shape[-1] ** -0.5  # [nh, T, S]
    # -inf instead of HF's dtype-min additive mask: both give exactly 0 after the fp32 softmax.
    scores = scores.masked_fill(~visible[None], float("-inf"))
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs, v)  # [nh, T, hd]
    return out.transpose(0, 1).reshape(q.shape[1], -1)


class Attention(nn.Module):
    def __init__(self, layer: ir.DecoderLayer, width_in: int):
        super().__init__()
        hd, bias = layer.head_dim, layer.attention_bias
        self.num_heads, self.num_kv_heads, self.head_dim = (
            layer.num_attention_heads,
            layer.num_key_value_heads,
            hd,
        )
        self.q_proj = nn.Linear(width_in, self.num_heads * hd, bias=bias)
        self.k_proj = nn.Linear(width_in, self.num_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(width_in, self.num_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * hd, layer.hidden_size, bias=bias)
        self.qk_norm = layer.style == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(hd, layer.rms_norm_eps)
            self.k_norm = RMSNorm(hd, layer.rms_norm_eps)

    def _heads(self, x: Tensor, heads: int) -> Tensor:
        """[T, heads * hd] -> [heads, T, hd]."""
        return x.view(x.shape[0], heads, self.head_dim).transpose(0, 1)

    def queries(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x [T, width_in] -> q [nh, T, hd] after q_norm (qwen3) and RoPE."""
        q = self._heads(self.q_proj(x), self.num_heads)
        if self.qk_norm:
            q = self.q_norm(q)
        return apply_rope(q, cos, sin)

    def keys_values(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """x [S, width_in] -> k, v [nkv, S, hd]; k after k_norm (qwen3) and RoPE, v untouched."""
        k = self._heads(self.k_proj(x), self.num_kv_heads)
        if self.qk_norm:
            k = self.k_norm(k)
        return apply_rope(k, cos, sin), self._heads(self.v_proj(x), self.num_kv_heads)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, layer: ir.DecoderLayer):
        super().__init__()
        h, i, bias = layer.hidden_size, layer.intermediate_size, layer.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """A pre-norm Llama/Qwen3 decoder layer; with input "embed_and_hidden" it is EAGLE-3's first
    layer, whose attention reads [input_layernorm(embedding) ; hidden_norm(hidden)] (2H wide)."""

    def __init__(self, layer: ir.DecoderLayer):
        super().__init__()
        self.config = layer
        h = layer.hidden_size
        self.embed_and_hidden = layer.input == "embed_and_hidden"
        if self.embed_and_hidden:
            self.hidden_norm = RMSNorm(h, layer.rms_norm_eps)
        self.input_layernorm = RMSNorm(h, layer.rms_norm_eps)
        self.self_attn = Attention(layer, 2 * h if self.embed_and_hidden else h)
        self.post_attention_layernorm = RMSNorm(h, layer.rms_norm_eps)
        self.mlp = MLP(layer)
        # Not a buffer: state_dict() stays exactly the checkpoint's tensors, and `.to(bf16)`
        # cannot round the frequencies (transformers keeps them in fp32 too).
        self.inv_freq = inverse_frequencies(layer)

    def rope(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        return rope_tables(positions, self.inv_freq, dtype)

    def attention_input(
        self, x: Tensor, embeds: Tensor | None, norm_before_residual: bool
    ) -> tuple[Tensor, Tensor]:
        """(what q/k/v read [T, width_in], the residual stream [T, H])."""
        if not self.embed_and_hidden:
            return self.input_layernorm(x), x
        if embeds is None:
            raise ValueError("an embed_and_hidden layer needs the token embeddings")
        hidden = self.hidden_norm(x)
        # Embedding half first: q/k/v_proj columns [:H] multiply the embedding.
        both = torch.cat((self.input_layernorm(embeds), hidden), dim=-1)
        return both, hidden if norm_before_residual else x

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        visible: Tensor,
        prefix: tuple[Tensor, Tensor] | None = None,
        embeds: Tensor | None = None,
        norm_before_residual: bool = False,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """x [T, H] -> (y [T, H], k, v [nkv, T, hd] of these rows).

        prefix: keys/values [nkv, S, hd] placed before these rows' own (a cache, or DFlash's
        context); visible [T, S + T] says which of all S + T keys each row may read.
        """
        attn_in, residual = self.attention_input(x, embeds, norm_before_residual)
        q = self.self_attn.queries(attn_in, cos, sin)
        k, v = self.self_attn.keys_values(attn_in, cos, sin)
        keys, values = k, v
        if prefix is not None:
            keys = torch.cat((prefix[0], k), dim=1)
            values = torch.cat((prefix[1], v), dim=1)
        y = residual + self.self_attn.o_proj(attend(q, keys, values, visible))
        y = y + self.mlp(self.post_attention_layernorm(y))
        return y, k, v
