"""The block drafter being trained (DFlash, DSpark): its spec and MLX module, and the batched
training forward over many anchored blocks per sequence, the function
`woodcock.runtime.block.BlockDrafter` computes one block at a time at inference.

A block anchored at position p is [x_p, MASK x (B-1)] at positions p..p+B-1. It reads the fused
target features of positions t < p (t >= p - W in a layer with a sliding window) as extra keys
and values of every layer, and its own B keys (all of them, or up to the slot itself in a
block_causal layer). Blocks never see each other, so one sequence's blocks run side by side:
queries [S, N, B] against [the sequence's context ; the block's own rows], with the context
visibility of every block built as an explicit mask [S, N, Lc].
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from woodcock.errors import DrafterError
from woodcock.ir import DFlash, DrafterSpec, DSpark, Fusion, Head, Taps
from woodcock.runtime.block import BlockModel
from woodcock.train.features import TargetRunner
from woodcock.train.options import TrainOptions
from woodcock.train.target_shape import layer_like_target, target_facts


def mask_token_id(tokenizer, vocab_size: int) -> int:
    """The MASK token of the block: the tokenizer's mask token, else its pad, eos or unk token
    (speculators' order when the embedding has no spare row for a new token: the target's
    embedding is shared and frozen, so the row must be one the target already has)."""
    for name in ("mask_token_id", "pad_token_id", "eos_token_id", "unk_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, list | tuple):
            value = value[0] if value else None
        if isinstance(value, int) and 0 <= value < vocab_size:
            return value
    raise DrafterError(
        "the target's tokenizer has no mask, pad, eos or unk token to use as the block's MASK"
    )


def build_block_spec(
    runner: TargetRunner,
    target: str,
    taps: Sequence[int],
    draft_vocab: int,
    opts: TrainOptions,
    mask_id: int,
):
    """Qwen3 layers (q/k norm) shaped like the target's, full attention, bidirectional inside
    the block: the one layer kind speculators, SpecForge and DeepSpec all hold. The taps are
    fused as hidden_norm(fc(concat)), the only fusion those formats have. The embedding is the
    target's; the LM head too when the draft vocabulary is the target's."""
    layer = layer_like_target(
        runner,
        style="qwen3",
        input="hidden",
        attention="block_bidirectional",
        sliding_window=None,
    )
    block = {
        "block_size": opts.block_size,
        "mask_token_id": mask_id,
        "sample_from_anchor": opts.anchor_first(),
    }
    if opts.algorithm == "dspark":
        algorithm = DSpark(
            **block,
            markov_head_type=opts.markov_head,
            markov_rank=opts.markov_rank,
            confidence_head=opts.confidence_head,
            confidence_head_with_markov=opts.confidence_head and opts.markov_rank > 0,
        )
    else:
        algorithm = DFlash(**block)
    full = draft_vocab == runner.vocab_size
    return DrafterSpec(
        algorithm=algorithm,
        target=target_facts(runner, target),
        taps=Taps(tuple(taps)),
        fusion=Fusion(tap_norm="none", fc_bias=False, hidden_norm=True),
        layers=(layer,) * opts.layers,
        head=Head(lm_head="shared" if full else "own", embedding="shared"),
        draft_vocab_size=draft_vocab,
    )


def build_block_model(
    spec, embedding: np.ndarray, head_rows: np.ndarray, norm: np.ndarray | None, seed: int
):
    """The trainable drafter: the runtime's BlockModel (canonical parameter names), the target's
    embedding loaded and frozen, the head rows loaded (frozen when the head is shared), the
    final norm started from the target's."""
    mx.random.seed(seed)
    model = BlockModel(spec)
    model.embed_tokens.weight = mx.array(embedding)
    model.lm_head.weight = mx.array(np.ascontiguousarray(head_rows, np.float32))
    if norm is not None:
        model.norm.weight = mx.array(norm)
    algorithm = spec.algorithm
    if isinstance(algorithm, DSpark) and algorithm.markov_rank:
        # speculators' initialisation: a near-zero bias at the start
        w1 = model.markov_head.markov_w1
        w1.weight = 0.01 * mx.random.normal(w1.weight.shape)
    model.embed_tokens.freeze()
    if spec.head.lm_head == "shared":
        model.lm_head.freeze()
    mx.eval(model.parameters())
    return model


def fuse(model, spec, taps):
    """taps [..., A*Ht] -> fused context [..., H] (`BlockDrafter.fuse`)."""
    fusion = spec.fusion
    x = taps
    if fusion.tap_norm == "per_tap":
        parts = mx.split(x, len(model.fc_norm), axis=-1)
        x = mx.concatenate([norm(p) for norm, p in zip(model.fc_norm, parts, strict=True)], -1)
    elif fusion.tap_norm == "concat":
        x = model.input_norm(x)
    x = model.fc(x)
    if fusion.hidden_norm:
        x = model.hidden_norm(x)
    return x


def context_masks(spec, anchors, context_rows: int) -> dict:
    """Additive masks [S, N, Lc] (0 visible, -inf not) by sliding window (None = full): context
    row t is visible to the block anchored at p iff t < p (and t >= p - W)."""
    t = mx.arange(context_rows)[None, None, :]
    p = anchors[..., None]
    masks = {}
    for layer in spec.layers:
        window = layer.sliding_window
        if window in masks:
            continue
        visible = t < p
        if window is not None:
            visible = visible & (t >= p - window)
        masks[window] = mx.where(visible, 0.0, -math.inf)
    return masks


def _layer(layer, x, context, anchors, context_mask, block_mask):
    """One decoder layer over every block: x [S, N, B, H], context [S, Lc, H] (fused, the same
    for every layer), anchors [S, N] -> [S, N, B, H]."""
    attn = layer.self_attn
    s, n, b, _ = x.shape
    rows = context.shape[1]
    nh, nkv, hd = attn.num_heads, attn.num_kv_heads, attn.head_dim
    g = nh // nkv
    # Context keys/values: no input_layernorm, k_norm and RoPE at the rows' own positions.
    kc = attn.k_proj(context).reshape(s, rows, nkv, hd)
    if attn.qk_norm:
        kc = attn.k_norm(kc)
    kc = attn.rope(kc.transpose(0, 2, 1, 3), 0)  # [S, nkv, Lc, hd]
    vc = attn.v_proj(context).reshape(s, rows, nkv, hd).transpose(0, 2, 1, 3)
    a = layer.input_layernorm(x)
    q = attn.q_proj(a).reshape(s * n, b, nh, hd)
    k = attn.k_proj(a).reshape(s * n, b, nkv, hd)
    v = attn.v_proj(a).reshape(s, n, b, nkv, hd).transpose(0, 3, 1, 2, 4)  # [S, nkv, N, B, hd]
    if attn.qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    # Each block on the batch axis: one RoPE offset (its anchor's position) per block.
    offsets = anchors.reshape(-1)
    q = attn.rope(q.transpose(0, 2, 1, 3), offsets)  # [S*N, nh, B, hd]
    k = attn.rope(k.transpose(0, 2, 1, 3), offsets)  # [S*N, nkv, B, hd]
    # Query head h reads kv head h // g (grouped-query attention).
    q = (q * attn.scale).reshape(s, n, nkv, g, b, hd).transpose(0, 2, 1, 3, 4, 5)
    k = k.reshape(s, n, nkv, b, hd).transpose(0, 2, 1, 3, 4)  # [S, nkv, N, B, hd]
    context_scores = (q.reshape(s, nkv, n * g * b, hd) @ kc.swapaxes(-1, -2)).reshape(
        s, nkv, n, g, b, rows
    )
    context_scores = context_scores + context_mask[:, None, :, None, None, :]
    block_scores = q @ k[:, :, :, None].swapaxes(-1, -2)  # [S, nkv, N, g, B, B]
    if block_mask is not None:
        block_scores = block_scores + block_mask
    probs = mx.softmax(
        mx.concatenate([context_scores, block_scores], axis=-1), axis=-1, precise=True
    )
    out = (probs[..., :rows].reshape(s, nkv, n * g * b, rows) @ vc).reshape(s, nkv, n, g, b, hd)
    out = out + probs[..., rows:] @ v[:, :, :, None]
    out = out.transpose(0, 2, 4, 1, 3, 5).reshape(s, n, b, nh * hd)
    y = x + attn.o_proj(out)
    return y + layer.mlp(layer.post_attention_layernorm(y))


def block_states(model, spec, taps, anchors, block_ids):
    """taps [S, Lc, A*Ht] (row t: the target's tapped states at position t), anchors [S, N]
    int32 positions p >= 1, block_ids [S, N, B] target ids ([x_p, MASK, ...]) -> the post-norm
    states of every block slot [S, N, B, H]."""
    context = fuse(model, spec, taps)
    masks = context_masks(spec, anchors, taps.shape[1])
    size = block_ids.shape[-1]
    causal = mx.triu(mx.full((size, size), -math.inf, mx.float32), k=1)
    x = model.embed_tokens(block_ids)
    for layer in model.layers:
        config = layer.config
        block_mask = causal if config.attention == "block_causal" else None
        x = _layer(layer, x, context, anchors, masks[config.sliding_window], block_mask)
    return model.norm(x)


def markov_features(model, spec, hidden, prev_ids):
    """DSpark's heads, teacher-forced: hidden [S, N, B, H], prev_ids [S, N, B] target ids of the
    token before the one each slot predicts -> (u [S, N, B, r]: the bias is markov_w2(u),
    e [S, N, B, r]: markov_w1 of the previous tokens). The rnn state runs over every slot of a
    block in order, slot 0 included."""
    head = model.markov_head
    e = head.markov_w1(prev_ids)
    if head.kind == "vanilla":
        return e, e
    if head.kind == "gated":
        return mx.sigmoid(head.gate_proj(mx.concatenate([hidden, e], axis=-1))) * e, e
    state = mx.zeros((*e.shape[:2], e.shape[-1]), e.dtype)
    outputs = []
    for k in range(e.shape[2]):
        joint = head.joint_proj(mx.concatenate([state, e[:, :, k], hidden[:, :, k]], axis=-1))
        gate_raw, candidate, out = mx.split(joint, 3, axis=-1)
        gate = mx.sigmoid(gate_raw)
        # The bias reads `out`, computed from the state before this slot's update.
        state = gate * state + (1.0 - gate) * mx.tanh(candidate)
        outputs.append(mx.tanh(out))
    return mx.stack(outputs, axis=2), e


def slot_outputs(model, spec, hidden, prev_ids, rows=None):
    """The draft logits (Markov bias included) and confidence logits of the chosen slots:
    hidden [S, N, B, H], prev_ids [S, N, B], rows: flat indices into S*N*B (None: all) ->
    (logits [n, Vd], confidence logits [n] or None)."""
    algorithm = spec.algorithm

    def pick(x):
        flat = x.reshape(-1, x.shape[-1])
        return flat if rows is None else mx.take(flat, rows, axis=0)

    chosen = pick(hidden)
    logits = model.lm_head(chosen)
    if not isinstance(algorithm, DSpark):
        return logits, None
    e = None
    if algorithm.markov_rank:
        u, e = markov_features(model, spec, hidden, prev_ids)
        logits = logits + model.markov_head.markov_w2(pick(u))
    confidence = None
    if algorithm.confidence_head:
        features = chosen
        if algorithm.confidence_head_with_markov:
            features = mx.concatenate([chosen, pick(e)], axis=-1)
        confidence = model.confidence_head.proj(features)[:, 0]
    return logits, confidence
