"""The drafter being trained: its spec and MLX module, warm starts from a trained drafter, and
the batched training-time-test forward (the same function as `woodcock.runtime.eagle3`
computes row by row at inference)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from woodcock.errors import DrafterError
from woodcock.train.features import TargetRunner
from woodcock.train.options import TrainOptions


def default_taps(num_layers: int) -> tuple[int, ...]:
    taps = (2, num_layers // 2, num_layers - 3)
    if all(a < b for a, b in zip(taps, taps[1:], strict=False)) and taps[0] >= 0:
        return taps
    return tuple(sorted({1, max(1, num_layers // 2), num_layers}))


def _rope_scaling(args) -> dict | None:
    scaling = getattr(args, "rope_scaling", None)
    if not isinstance(scaling, dict):
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in ("linear", "llama3"):
        return None  # the drafter's short context needs no long-context scaling
    return {**{k: v for k, v in scaling.items() if k != "type"}, "rope_type": kind}


def layer_like_target(runner: TargetRunner, **fields):
    """A draft decoder layer with the target's width, heads, head_dim, MLP width, norm epsilon
    and RoPE; `fields` gives style, input, attention and sliding_window."""
    from woodcock.ir import DecoderLayer

    args = runner.model.args
    hidden = runner.hidden_size
    heads = int(args.num_attention_heads)
    return DecoderLayer(
        hidden_size=hidden,
        intermediate_size=int(args.intermediate_size),
        num_attention_heads=heads,
        num_key_value_heads=int(getattr(args, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(args, "head_dim", None) or hidden // heads),
        rms_norm_eps=float(getattr(args, "rms_norm_eps", 1e-6)),
        rope_theta=float(getattr(args, "rope_theta", 10000.0)),
        rope_scaling=_rope_scaling(args),
        max_position_embeddings=int(getattr(args, "max_position_embeddings", 4096) or 4096),
        **fields,
    )


def target_facts(runner: TargetRunner, target: str):
    from woodcock.ir import Target
    from woodcock.target_checkpoint import target_from_config

    return Target(
        num_hidden_layers=runner.num_layers,
        hidden_size=runner.hidden_size,
        vocab_size=runner.vocab_size,
        name_or_path=str(target),
        architectures=target_from_config(target).architectures,
    )


def build_spec(
    runner: TargetRunner,
    target: str,
    taps: Sequence[int],
    draft_vocab: int,
    ttt_steps: int,
):
    from woodcock.ir import DrafterSpec, Eagle3, Fusion, Head, Taps

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
    import mlx.core as mx

    from woodcock.runtime.eagle3 import Eagle3Model

    mx.random.seed(seed)
    model = Eagle3Model(spec, head_rows.shape[0])
    model.embed_tokens.weight = mx.array(embedding)
    model.lm_head.weight = mx.array(np.ascontiguousarray(head_rows, np.float32))
    if norm is not None:
        model.norm.weight = mx.array(norm)
    model.embed_tokens.freeze()
    mx.eval(model.parameters())
    return model


def load_init(opts: TrainOptions):
    """The drafter to start from and the record of it for the provenance."""
    from woodcock.loading import load_drafter_with_format, resolve_source

    init, fmt = load_drafter_with_format(opts.init)
    if init.spec.algorithm.name != opts.algorithm:
        raise DrafterError(
            f"--init {opts.init}: algorithm = {init.spec.algorithm.name!r}; this trains"
            f" {opts.algorithm!r}"
        )
    head_size = opts.draft_head_size()
    kept = init.spec.draft_vocab_size if init.vocab.draft_to_target is not None else None
    if kept is not None and head_size != kept:
        raise DrafterError(
            f"--init {opts.init}: draft_vocab_size = {kept}, --head-size {head_size}: a drafter"
            f" to start from keeps its head rows; pass --head-size {kept}"
        )
    record: dict[str, Any] = {"source": str(opts.init), "format": fmt.NAME}
    if fmt.NAME == "woodcock":
        theirs = fmt.read_provenance(resolve_source(opts.init))
        record["data"] = theirs.get("data", {}).get("dir")
        record["training"] = theirs.get("training")
        for key in ("holdout_agreement", "holdout"):
            if key in theirs:
                record[key] = theirs[key]
    return init, record


def start_from(model, init, spec, source: str) -> None:
    """Load `init`'s weights into the freshly built `model`; `init` must have the spec this run
    builds (the number of TTT steps and the target's name aside)."""
    import mlx.core as mx

    from woodcock.ir import Eagle3

    algorithm = init.spec.algorithm
    if isinstance(algorithm, Eagle3):
        algorithm = dataclasses.replace(
            algorithm, speculative_tokens=spec.algorithm.speculative_tokens
        )
    theirs = dataclasses.replace(
        init.spec,
        algorithm=algorithm,
        target=dataclasses.replace(
            init.spec.target,
            name_or_path=spec.target.name_or_path,
            architectures=spec.target.architectures,
        ),
    )
    if theirs != spec:
        field_name = next(
            f.name
            for f in dataclasses.fields(spec)
            if getattr(theirs, f.name) != getattr(spec, f.name)
        )
        raise DrafterError(
            f"--init {source}: {field_name} = {getattr(init.spec, field_name)!r}; this run trains"
            f" {getattr(spec, field_name)!r}"
        )
    weights = [(name, mx.array(np.asarray(a, np.float32))) for name, a in init.weights.items()]
    model.load_weights(weights, strict=False)  # the embedding is the target's, not the drafter's
    mx.eval(model.parameters())


def trained_weights(model) -> dict[str, np.ndarray]:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    return {
        name: np.array(value.astype(mx.float32))
        for name, value in tree_flatten(model.trainable_parameters())
    }


def _layer_step(layer, x, embeds, offset: int, store: list, causal, norm_before_residual: bool):
    """One decoder layer at TTT step len(store) for every row: x [B, R, H] -> [B, R, H]; this
    step's keys/values are appended to `store`."""
    import mlx.core as mx

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
    import mlx.core as mx

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
