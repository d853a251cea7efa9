"""The EAGLE-3 drafter being trained: its spec and MLX module, and the batched
training-time-test forward (the same function as `woodcock.runtime.eagle3` computes row by row
at inference)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from woodcock.ir import DrafterSpec, Eagle3, Fusion, Head, Taps
from woodcock.runtime.eagle3 import Eagle3Model
from woodcock.train.features import TargetRunner
from woodcock.train.target_shape import layer_like_target, target_facts


def build_spec(
    runner: TargetRunner,
    target: str,
    taps: Sequence[int],
    draft_vocab: int,
    ttt_steps: int,
) -> DrafterSpec:
    layer = layer_like_target(
        runner, style="llama", input="embed_and_hidden", attention="causal", sliding_window=None
    )
    return DrafterSpec(
        algorithm=Eagle3(norm_before_residual=True, norm_output=True, speculative_tokens=ttt_steps),
        target=target_facts(runner, target),
        taps=Taps(tuple(taps)),
        fusion=Fusion(tap_norm="per_tap", fc_bias=False, hidden_norm=False),
        layers=(layer,),
        head=Head(lm_head="own", embedding="shared"),
        draft_vocab_size=draft_vocab,
    )


def build_model(
    spec, embedding: np.ndarray, head_rows: np.ndarray, norm: np.ndarray | None, seed: int
):
    """The trainable drafter: the runtime's Eagle3Model (canonical parameter names, standard
    [out, in] weights), the target's embedding loaded and frozen."""
    mx.random.seed(seed)
    model = Eagle3Model(spec, head_rows.shape[0])
    model.embed_tokens.weight = mx.array(embedding)
    model.lm_head.weight = mx.array(np.ascontiguousarray(head_rows, np.float32))
    if norm is not None:
        model.norm.weight = mx.array(norm)
    model.embed_tokens.freeze()
    mx.eval(model.parameters())
    return model


def _layer_step(layer, x, embeds, offset: int, store: list, causal, norm_before_residual: bool):
    """One decoder layer at TTT step len(store) for every row: x [B, R, H] -> [B, R, H]; this
    step's keys/values are appended to `store`."""
    attn = layer.self_attn
    batch, rows, _ = x.shape
    nh, nkv, hd = attn.num_heads, attn.num_kv_heads, attn.head_dim
    attn_in, residual = layer.attention_input(x, embeds, norm_before_residual)
    q = attn.q_proj(attn_in).reshape(batch, rows, nh, hd)
    k = attn.k_proj(attn_in).reshape(batch, rows, nkv, hd)
    v = attn.v_proj(attn_in).reshape(batch, rows, nkv, hd).transpose(0, 2, 1, 3)
    if attn.qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q = attn.rope(q.transpose(0, 2, 1, 3), offset)
    k = attn.rope(k.transpose(0, 2, 1, 3), offset)
    store.append((k, v))
    groups = nh // nkv
    qg = (q * attn.scale).reshape(batch, nkv, groups, rows, hd)
    k0, v0 = store[0]
    scores = qg @ k0[:, :, None].swapaxes(-1, -2) + causal  # [B, nkv, g, R, R]
    if len(store) == 1:
        out = mx.softmax(scores, axis=-1, precise=True) @ v0[:, :, None]
    else:
        # each row's own keys of steps 1..k: one score per (row, step)
        diagonal = mx.stack([(qg * kj[:, :, None]).sum(-1) for kj, _ in store[1:]], axis=-1)
        probs = mx.softmax(mx.concatenate([scores, diagonal], axis=-1), axis=-1, precise=True)
        out = probs[..., :rows] @ v0[:, :, None]
        values = mx.stack([vj for _, vj in store[1:]], axis=-2)  # [B, nkv, R, k, hd]
        out = out + (probs[..., rows:, None] * values[:, :, None]).sum(-2)
    out = out.reshape(batch, nh, rows, hd).transpose(0, 2, 1, 3).reshape(batch, rows, nh * hd)
    y = residual + attn.o_proj(out)
    return y + layer.mlp(layer.post_attention_layernorm(y))


def ttt_states(model, tokens, taps, steps: int) -> list:
    """tokens int32 [B, R + steps - 1] with tokens[:, j] = x_{j+1}; taps [B, R, A*Ht] with
    taps[:, i] = g_i -> per step the final-norm output [B, R, H], which lm_head turns into
    logits (step k: row i predicts x_{i+2+k})."""
    rows = taps.shape[1]
    algorithm = model.algorithm
    causal = mx.triu(mx.full((rows, rows), -math.inf, mx.float32), k=1)
    stores: list[list] = [[] for _ in model.layers]
    hidden = model.fuse(taps)
    out = []
    for k in range(steps):
        embeds = model.embed_tokens(tokens[:, k : k + rows])
        x = hidden
        for i, layer in enumerate(model.layers):
            x = _layer_step(
                layer,
                x,
                embeds if i == 0 else None,
                1 + k,
                stores[i],
                causal,
                algorithm.norm_before_residual,
            )
        normed = model.norm(x)
        out.append(normed)
        hidden = normed if algorithm.norm_output else x
    return out


def ttt_logits(model, tokens, taps, steps: int) -> list:
    """`ttt_states` through the head: logits [B, R, Vd] per step."""
    return [model.lm_head(state) for state in ttt_states(model, tokens, taps, steps)]
