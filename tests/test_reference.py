"""The torch reference forward: cache against recomputation, every flag wired, masks, Markov and
confidence heads, shared heads, RoPE against transformers, a float64 numpy re-derivation of
whole layers, and the target wrapper against transformers models built here (no network)."""

import dataclasses
import itertools
import subprocess
import sys

import numpy as np
import pytest
import torch

from woodcock.errors import DrafterError
from woodcock.ir import DecoderLayer, Drafter, Head
from woodcock.reference import TorchDrafter, TorchTarget
from woodcock.reference.layers import DecoderLayer as TorchLayer
from woodcock.reference.layers import inverse_frequencies, rms_norm
from woodcock.synthetic import random_drafter, tiny_spec
from woodcock.target_checkpoint import load_target_tensors

V, H, A = 96, 32, 3  # tiny_spec's target vocab, hidden size, number of taps
REDUCED = 48


# ---------------------------------------------------------------------------------------------
# Builders


def with_layers(spec, **changes):
    return dataclasses.replace(
        spec, layers=tuple(dataclasses.replace(layer, **changes) for layer in spec.layers)
    )


def with_algorithm(spec, **changes):
    return dataclasses.replace(spec, algorithm=dataclasses.replace(spec.algorithm, **changes))


def make_drafter(spec, seed=0, scale=0.1):
    """random_drafter with larger matrices (std `scale`), so that attention is far from uniform
    and a wrong mask, position or norm moves the logits by much more than rounding."""
    drafter = random_drafter(spec, seed=seed)
    weights = {
        name: array if name.endswith("norm.weight") else array * np.float32(scale / 0.02)
        for name, array in drafter.weights.items()
    }
    return Drafter(spec, drafter.vocab, weights)


def target_tensors(seed=1, vocab=V, hidden=H):
    rng = np.random.default_rng(seed)
    return {
        "embed_tokens.weight": rng.standard_normal((vocab, hidden), dtype=np.float32),
        "lm_head.weight": 0.3 * rng.standard_normal((vocab, hidden), dtype=np.float32),
    }


def build(spec, seed=0):
    drafter = make_drafter(spec, seed)
    return TorchDrafter(drafter, target_tensors()), drafter


def respec(drafter, spec):
    """The same weights under another spec of the same shapes (a flag, mask or window changed)."""
    return TorchDrafter(Drafter(spec, drafter.vocab, drafter.weights), target_tensors())


def random_taps(rows, seed=2, width=A * H):
    return torch.from_numpy(np.random.default_rng(seed).standard_normal((rows, width))).float()


def close(a, b, atol=1e-5):
    return torch.allclose(a, b, rtol=1e-5, atol=atol)


# ---------------------------------------------------------------------------------------------
# EAGLE-3


EAGLE3_CASES = [
    (style, layers, tap_norm, nbr, nout, vocab, window)
    for style, layers, tap_norm, nbr, nout, vocab, window in itertools.product(
        ["llama", "qwen3"],
        [1, 2],
        ["none", "per_tap", "concat"],
        [False, True],
        [False, True],
        [V, REDUCED],
        [None, 3],
    )
    # Every flag combination with full vocab and no window; the rest thinned out.
    if (vocab == V and window is None) or (nbr == nout and tap_norm != "none")
]


@pytest.mark.parametrize("style, layers, tap_norm, nbr, nout, vocab, window", EAGLE3_CASES)
def test_eagle3_chain_equals_uncached_recomputation(
    style, layers, tap_norm, nbr, nout, vocab, window
):
    spec = tiny_spec(
        "eagle3",
        num_layers=layers,
        style=style,
        tap_norm=tap_norm,
        draft_vocab_size=vocab,
        norm_before_residual=nbr,
        norm_output=nout,
    )
    drafter, _ = build(with_layers(spec, sliding_window=window))
    prompt, steps = 7, 4
    taps = random_taps(prompt)
    tokens = torch.tensor([5, 17, 3, 88, 41, 0, 63, 29])
    result = drafter.eagle3_draft(taps, tokens, steps)
    assert result.tokens.shape == (steps,) and result.logits.shape == (steps, vocab)
    assert result.confidence is None

    # Each step again from scratch with a fresh cache: the context rows in one call, then every
    # chain row so far in one call.
    fused = drafter.fuse(taps)
    ids, hidden, positions = [], [], []
    for step in range(steps):
        cache = drafter.new_cache()
        out = drafter.eagle3_forward(tokens[1:], fused, torch.arange(1, prompt + 1), cache)
        if step:
            out = drafter.eagle3_forward(
                torch.tensor(ids), torch.stack(hidden), torch.tensor(positions), cache, chain=True
            )
        assert close(out.logits[-1], result.logits[step]), step
        token = drafter.draft_to_target[out.logits[-1].argmax()]
        assert token == result.tokens[step]
        ids.append(int(token))
        hidden.append(out.hidden[-1])
        positions.append(prompt + step + 1)
    if vocab != V:
        assert set(result.tokens.tolist()) <= set(drafter.draft_to_target.tolist())


def test_eagle3_norm_output_is_the_fed_back_state():
    spec = tiny_spec("eagle3", num_layers=2, style="qwen3", norm_output=False)
    pre, weights = build(spec)
    post = respec(weights, with_algorithm(spec, norm_output=True))
    args = (torch.tensor([4, 9, 2]), random_taps(3, width=H), torch.tensor([1, 2, 3]))
    a = pre.eagle3_forward(*args, pre.new_cache())
    b = post.eagle3_forward(*args, post.new_cache())
    assert torch.equal(a.logits, b.logits)  # the flag only changes what is fed back
    assert not close(a.hidden, b.hidden)
    assert close(b.hidden, rms_norm(a.hidden, pre.norm.weight, 1e-6))
    # ... and so every later chain step.
    taps, tokens = random_taps(5), torch.tensor([1, 2, 3, 4, 5, 6])
    chain_a, chain_b = pre.eagle3_draft(taps, tokens, 3), post.eagle3_draft(taps, tokens, 3)
    assert torch.equal(chain_a.logits[0], chain_b.logits[0])
    assert not close(chain_a.logits[1:], chain_b.logits[1:])


@pytest.mark.parametrize("layers", [1, 2])
def test_eagle3_norm_before_residual_changes_the_output(layers):
    spec = tiny_spec("eagle3", num_layers=layers, norm_before_residual=False)
    raw, weights = build(spec)
    normed = respec(weights, with_algorithm(spec, norm_before_residual=True))
    args = (torch.tensor([4, 9, 2]), 3 * random_taps(3, width=H), torch.tensor([1, 2, 3]))
    a = raw.eagle3_forward(*args, raw.new_cache())
    b = normed.eagle3_forward(*args, normed.new_cache())
    assert not close(a.logits, b.logits) and not close(a.hidden, b.hidden)


def test_eagle3_tap_norms_are_wired():
    outputs = []
    for tap_norm in ("none", "per_tap", "concat"):
        drafter, _ = build(tiny_spec("eagle3", tap_norm=tap_norm))
        outputs.append(drafter.fuse(random_taps(4)))
    for a, b in itertools.combinations(outputs, 2):
        assert not close(a, b)


def test_eagle3_sliding_window():
    window, prompt = 3, 8
    spec = tiny_spec("eagle3", num_layers=1, style="qwen3")
    windowed, weights = build(with_layers(spec, sliding_window=window))
    full = respec(weights, spec)
    taps, tokens = random_taps(prompt), torch.arange(10, 10 + prompt + 1)
    fused = windowed.fuse(taps)
    ids, positions = tokens[1:], torch.arange(1, prompt + 1)

    # One layer: the last row reads only the rows at positions > P - W, so the rows before do
    # not matter at all; without the window they do.
    out = windowed.eagle3_forward(ids, fused, positions, windowed.new_cache())
    tail = windowed.eagle3_forward(
        ids[-window:], fused[-window:], positions[-window:], windowed.new_cache()
    )
    assert close(out.logits[-1], tail.logits[-1])
    unwindowed = full.eagle3_forward(ids, fused, positions, full.new_cache())
    assert not close(out.logits[-1], unwindowed.logits[-1])
    # A context no longer than the window: no difference.
    short = slice(prompt - window, None)
    a = windowed.eagle3_forward(ids[short], fused[short], positions[short], windowed.new_cache())
    b = full.eagle3_forward(ids[short], fused[short], positions[short], full.new_cache())
    assert close(a.logits, b.logits, atol=1e-6)

    # Step 2 (a chain row at position P + 1) sees the same context window as step 1 (positions
    # > P - W, speculators' training mask) plus the chain rows, which are never windowed.
    cache = windowed.new_cache()
    first = windowed.eagle3_forward(ids, fused, positions, cache)
    draft = windowed.draft_to_target[first.logits[-1].argmax()]
    state = first.hidden[-1:]
    second = windowed.eagle3_forward(
        draft[None], state, torch.tensor([prompt + 1]), cache, chain=True
    )
    keep = slice(prompt - window, None)  # positions P - W + 1 .. P
    alone_cache = windowed.new_cache()
    windowed.eagle3_forward(ids[keep], fused[keep], positions[keep], alone_cache)
    alone = windowed.eagle3_forward(
        draft[None], state, torch.tensor([prompt + 1]), alone_cache, chain=True
    )
    assert close(second.logits[-1], alone.logits[-1])
    result = windowed.eagle3_draft(taps, tokens, 2)
    assert close(result.logits[1], second.logits[-1])


def test_cache_truncate_drops_chain_rows():
    drafter, _ = build(tiny_spec("eagle3", num_layers=2))
    cache = drafter.new_cache()
    ids, hidden = torch.tensor([3, 4, 5]), random_taps(3, width=H)
    drafter.eagle3_forward(ids, hidden, torch.tensor([1, 2, 3]), cache)
    drafter.eagle3_forward(torch.tensor([7]), hidden[:1], torch.tensor([4]), cache)
    cache.truncate(3)
    again = drafter.eagle3_forward(torch.tensor([8]), hidden[1:2], torch.tensor([4]), cache)
    fresh = drafter.eagle3_forward(
        torch.tensor([3, 4, 5, 8]),
        torch.cat((hidden, hidden[1:2])),
        torch.tensor([1, 2, 3, 4]),
        drafter.new_cache(),
    )
    assert len(cache) == 4 and close(again.logits[-1], fresh.logits[-1])


# ---------------------------------------------------------------------------------------------
# Independent float64 numpy derivation


def np_rms(x, w, eps=1e-6):
    return w * (x / np.sqrt((x * x).mean(-1, keepdims=True) + eps))


def np_linear(w, name, x):
    y = x @ w[name + ".weight"].T
    return y + w[name + ".bias"] if name + ".bias" in w else y


def np_rope(x, positions, theta):
    """x [T, heads, hd]: neox halves rotated by position * theta^(-2k/hd)."""
    hd = x.shape[-1]
    angles = positions[:, None] * (1.0 / theta ** (np.arange(0, hd, 2) / hd))[None, :]
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return np.concatenate((x1 * cos - x2 * sin, x2 * cos + x1 * sin), axis=-1)


def np_layer(w, prefix, layer, q_in, q_pos, kv_in, kv_pos, visible):
    """Attention of rows q_in over keys/values from kv_in (the same projections), -> o_proj
    output [T, H]. visible [T, S]."""
    nh, nkv, hd = layer.num_attention_heads, layer.num_key_value_heads, layer.head_dim
    q = np_linear(w, prefix + "self_attn.q_proj", q_in).reshape(len(q_in), nh, hd)
    k = np_linear(w, prefix + "self_attn.k_proj", kv_in).reshape(len(kv_in), nkv, hd)
    v = np_linear(w, prefix + "self_attn.v_proj", kv_in).reshape(len(kv_in), nkv, hd)
    if layer.style == "qwen3":
        q = np_rms(q, w[prefix + "self_attn.q_norm.weight"])
        k = np_rms(k, w[prefix + "self_attn.k_norm.weight"])
    q, k = np_rope(q, q_pos, layer.rope_theta), np_rope(k, kv_pos, layer.rope_theta)
    out = np.zeros((len(q_in), nh, hd))
    for head in range(nh):
        kv_head = head // (nh // nkv)
        scores = q[:, head] @ k[:, kv_head].T / np.sqrt(hd)
        scores = np.where(visible, scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out[:, head] = probs @ v[:, kv_head]
    return np_linear(w, prefix + "self_attn.o_proj", out.reshape(len(q_in), nh * hd))


def np_mlp(w, prefix, x):
    gate = np_linear(w, prefix + "mlp.gate_proj", x)
    up = np_linear(w, prefix + "mlp.up_proj", x)
    return np_linear(w, prefix + "mlp.down_proj", gate / (1 + np.exp(-gate)) * up)


def np_weights(drafter, tensors):
    w = {k: np.asarray(v, dtype=np.float64) for k, v in drafter.weights.items()}
    ids = drafter.vocab.target_ids(drafter.spec)
    if drafter.spec.head.embedding == "shared":
        w["embed_tokens.weight"] = tensors["embed_tokens.weight"].astype(np.float64)
    if drafter.spec.head.lm_head == "shared":
        w["lm_head.weight"] = tensors["lm_head.weight"].astype(np.float64)[ids]
    return w, ids


def np_fuse(spec, w, taps):
    x = taps
    if spec.fusion.tap_norm == "per_tap":
        ht = spec.target.hidden_size
        chunks = [x[:, j * ht : (j + 1) * ht] for j in range(len(spec.taps.layer_ids))]
        x = np.concatenate([np_rms(c, w[f"fc_norm.{j}.weight"]) for j, c in enumerate(chunks)], -1)
    elif spec.fusion.tap_norm == "concat":
        x = np_rms(x, w["input_norm.weight"])
    x = np_linear(w, "fc", x)
    return np_rms(x, w["hidden_norm.weight"]) if spec.fusion.hidden_norm else x


@pytest.mark.parametrize(
    "style, layers, nbr, nout, window",
    [("llama", 1, False, False, None), ("qwen3", 1, True, True, 2), ("qwen3", 2, True, False, 3)],
)
def test_eagle3_layers_by_hand_in_numpy(style, layers, nbr, nout, window):
    spec = tiny_spec(
        "eagle3",
        num_layers=layers,
        style=style,
        tap_norm="per_tap",
        draft_vocab_size=REDUCED,
        norm_before_residual=nbr,
        norm_output=nout,
    )
    spec = with_layers(spec, attention_bias=True, mlp_bias=True, sliding_window=window)
    spec = dataclasses.replace(spec, fusion=dataclasses.replace(spec.fusion, fc_bias=True))
    drafter = make_drafter(spec)
    tensors = target_tensors()
    torch_drafter = TorchDrafter(drafter, tensors)
    w, _ = np_weights(drafter, tensors)
    rows = 6
    taps = np.random.default_rng(5).standard_normal((rows, A * H))
    ids = np.array([3, 70, 12, 12, 95, 40])
    pos = np.arange(1, rows + 1, dtype=np.float64)

    h = np_fuse(spec, w, taps)
    e = w["embed_tokens.weight"][ids]
    order = np.arange(rows)[None, :] <= np.arange(rows)[:, None]
    x = h
    for i, layer in enumerate(spec.layers):
        visible = order if window is None else order & (pos[None, :] > pos[:, None] - window)
        p = f"layers.{i}."
        if i == 0:
            h_n = np_rms(x, w[p + "hidden_norm.weight"])
            attn_in = np.concatenate((np_rms(e, w[p + "input_layernorm.weight"]), h_n), -1)
            residual = h_n if nbr else x
        else:
            attn_in, residual = np_rms(x, w[p + "input_layernorm.weight"]), x
        x = residual + np_layer(w, p, layer, attn_in, pos, attn_in, pos, visible)
        x = x + np_mlp(w, p, np_rms(x, w[p + "post_attention_layernorm.weight"]))
    normed = np_rms(x, w["norm.weight"])
    logits = normed @ w["lm_head.weight"].T

    out = torch_drafter.eagle3_forward(
        torch.from_numpy(ids),
        torch_drafter.fuse(torch.from_numpy(taps).float()),
        torch.from_numpy(pos).long(),
        torch_drafter.new_cache(),
    )
    assert np.allclose(out.logits.numpy(), logits, rtol=1e-5, atol=1e-5)
    assert np.allclose(out.hidden.numpy(), normed if nout else x, rtol=1e-5, atol=1e-5)
    assert np.abs(logits).max() > 1.0  # the comparison is not between two near-zero arrays


def np_block(spec, w, ids, taps, anchor_id):
    """Backbone of one block over context rows at positions 0..p-1: (hid [B, H], logits)."""
    algorithm = spec.algorithm
    c = np_fuse(spec, w, taps)
    p, size = len(c), algorithm.block_size
    block_pos = np.arange(p, p + size, dtype=np.float64)
    ctx_pos = np.arange(p, dtype=np.float64)
    x = w["embed_tokens.weight"][[anchor_id] + [algorithm.mask_token_id] * (size - 1)]
    for i, layer in enumerate(spec.layers):
        ctx = np.ones(p, bool)
        if layer.sliding_window is not None:
            ctx &= ctx_pos >= p - layer.sliding_window
        block = np.ones((size, size), bool)
        if layer.attention == "block_causal":
            block = np.tril(block)
        visible = np.concatenate((np.broadcast_to(ctx, (size, p)), block), axis=1)
        pre = f"layers.{i}."
        a = np_rms(x, w[pre + "input_layernorm.weight"])
        kv_in, kv_pos = np.concatenate((c, a)), np.concatenate((ctx_pos, block_pos))
        x = x + np_layer(w, pre, layer, a, block_pos, kv_in, kv_pos, visible)
        x = x + np_mlp(w, pre, np_rms(x, w[pre + "post_attention_layernorm.weight"]))
    hid = np_rms(x, w["norm.weight"])
    return hid, hid @ w["lm_head.weight"].T


def np_markov(spec, w, hid, logits, prev):
    algorithm, r = spec.algorithm, spec.algorithm.markov_rank
    state, out, confidence = np.zeros(r), [], []
    sigmoid = lambda z: 1 / (1 + np.exp(-z))  # noqa: E731
    for k in range(len(hid)):
        e = w["markov_head.markov_w1.weight"][prev[k]]
        if algorithm.markov_head_type == "vanilla":
            m = e
        elif algorithm.markov_head_type == "gated":
            m = sigmoid(np_linear(w, "markov_head.gate_proj", np.concatenate((hid[k], e)))) * e
        else:
            z = np_linear(w, "markov_head.joint_proj", np.concatenate((state, e, hid[k])))
            g = sigmoid(z[:r])
            state = g * state + (1 - g) * np.tanh(z[r : 2 * r])
            m = np.tanh(z[2 * r :])
        out.append(logits[k] + w["markov_head.markov_w2.weight"] @ m)
        features = np.concatenate((hid[k], e)) if algorithm.confidence_head_with_markov else hid[k]
        confidence.append(sigmoid(np_linear(w, "confidence_head.proj", features))[0])
    return np.stack(out), np.array(confidence)


@pytest.mark.parametrize(
    "algorithm, attention, window, kind",
    [
        ("dflash", "block_bidirectional", None, None),
        ("dflash", "block_causal", 3, None),
        ("dspark", "block_bidirectional", 2, "vanilla"),
        ("dspark", "block_causal", None, "gated"),
        ("dspark", "block_bidirectional", None, "rnn"),
    ],
)
def test_block_by_hand_in_numpy(algorithm, attention, window, kind):
    extra = {"markov_head_type": kind} if kind else {}
    spec = tiny_spec(
        algorithm,
        num_layers=2,
        style="qwen3",
        tap_norm="concat",
        draft_vocab_size=REDUCED,
        **extra,
    )
    spec = with_layers(spec, attention=attention, sliding_window=window)
    drafter = make_drafter(spec)
    tensors = target_tensors()
    torch_drafter = TorchDrafter(drafter, tensors)
    w, ids = np_weights(drafter, tensors)
    p, anchor = 6, 33
    taps = np.random.default_rng(6).standard_normal((p, A * H))
    hid, logits = np_block(spec, w, ids, taps, anchor)

    size = spec.algorithm.block_size
    out = torch_drafter.block_forward(
        torch_drafter.fuse(torch.from_numpy(taps).float()),
        torch.arange(p),
        torch.tensor([anchor] + [spec.algorithm.mask_token_id] * (size - 1)),
        torch.arange(p, p + size),
    )
    assert np.allclose(out.logits.numpy(), logits, rtol=1e-5, atol=1e-5)
    assert np.allclose(out.hidden.numpy(), hid, rtol=1e-5, atol=1e-5)
    if kind:
        prev = np.array([anchor, 5, 77, 5])
        biased, conf = np_markov(spec, w, hid, logits, prev)
        got, got_conf = torch_drafter.markov_heads(out.hidden, out.logits, torch.from_numpy(prev))
        assert np.allclose(got.numpy(), biased, rtol=1e-5, atol=1e-5)
        assert np.allclose(got_conf.numpy(), conf, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# DFlash / DSpark


def run_block(drafter, p=6, seed=3, taps=None):
    taps = random_taps(p, seed) if taps is None else taps
    size = drafter.spec.algorithm.block_size
    ids = torch.tensor([21] + [drafter.spec.algorithm.mask_token_id] * (size - 1))
    fused = drafter.fuse(taps)
    return drafter.block_forward(fused, torch.arange(p), ids, torch.arange(p, p + size))


@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("style", ["llama", "qwen3"])
def test_block_causal_differs_from_bidirectional(layers, style):
    spec = tiny_spec("dflash", num_layers=layers, style=style)
    causal, weights = build(with_layers(spec, attention="block_causal"))
    both = respec(weights, spec)
    a, b = run_block(causal), run_block(both)
    assert not close(a.logits[:-1], b.logits[:-1])
    if layers == 1:
        # The last slot sees the whole block either way.
        assert close(a.logits[-1], b.logits[-1])


@pytest.mark.parametrize("attention", ["block_bidirectional", "block_causal"])
def test_block_sliding_window_hides_old_context(attention):
    window, p = 2, 6
    spec = with_layers(tiny_spec("dspark", num_layers=2, style="qwen3"), attention=attention)
    windowed, weights = build(with_layers(spec, sliding_window=window))
    full = respec(weights, spec)
    size = spec.algorithm.block_size
    context = windowed.fuse(random_taps(p))
    ids = torch.tensor([21] + [spec.algorithm.mask_token_id] * (size - 1))
    block_pos = torch.arange(p, p + size)
    out = windowed.block_forward(context, torch.arange(p), ids, block_pos)
    # Only context positions p - W .. p - 1 are read, for every slot.
    kept = windowed.block_forward(
        context[p - window :], torch.arange(p - window, p), ids, block_pos
    )
    assert close(out.logits, kept.logits) and close(out.hidden, kept.hidden)
    assert not close(
        out.logits, full.block_forward(context, torch.arange(p), ids, block_pos).logits
    )
    # Context rows at or after the anchor are never read.
    extra = torch.cat((context, context[:2]))
    late = windowed.block_forward(
        extra, torch.cat((torch.arange(p), block_pos[:2])), ids, block_pos
    )
    assert close(out.logits, late.logits)


@pytest.mark.parametrize("style", ["llama", "qwen3"])
@pytest.mark.parametrize("sample_from_anchor", [False, True])
@pytest.mark.parametrize("vocab", [V, REDUCED])
@pytest.mark.parametrize("tap_norm", ["none", "per_tap", "concat"])
def test_dflash_block_draft(style, sample_from_anchor, vocab, tap_norm):
    spec = tiny_spec(
        "dflash",
        num_layers=2,
        style=style,
        draft_vocab_size=vocab,
        tap_norm=tap_norm,
        sample_from_anchor=sample_from_anchor,
        block_size=5,
    )
    drafter, _ = build(spec)
    p = 6
    taps = random_taps(p)
    result = drafter.block_draft(taps, 21)
    drafts = 5 if sample_from_anchor else 4
    assert result.tokens.shape == (drafts,) and result.logits.shape == (drafts, vocab)
    assert result.confidence is None
    out = run_block(drafter, p, taps=taps)
    tail = out.logits[5 - drafts :]
    assert torch.equal(result.logits, tail)
    assert torch.equal(result.tokens, drafter.draft_to_target[tail.argmax(-1)])
    logits, confidence = drafter.markov_heads(out.hidden, out.logits, torch.zeros(5).long())
    assert torch.equal(logits, out.logits) and confidence is None


def prev_for(result, anchor, sample_from_anchor):
    """The Markov head's previous token per slot, from the drafted tokens."""
    drafted = result.tokens.tolist()
    if sample_from_anchor:
        return torch.tensor([anchor] + drafted[:-1])
    return torch.tensor([anchor, anchor] + drafted[:-1])


DSPARK_CASES = list(
    itertools.product(["vanilla", "gated", "rnn"], [False, True], [V, REDUCED], ["llama", "qwen3"])
)


@pytest.mark.parametrize("kind, sample_from_anchor, vocab, style", DSPARK_CASES)
def test_dspark_block_draft_is_the_teacher_forced_head(kind, sample_from_anchor, vocab, style):
    spec = tiny_spec(
        "dspark",
        num_layers=1 if kind == "gated" else 2,
        style=style,
        markov_head_type=kind,
        draft_vocab_size=vocab,
        sample_from_anchor=sample_from_anchor,
    )
    drafter, _ = build(spec)
    taps, anchor = random_taps(5), 21
    result = drafter.block_draft(taps, anchor)
    size = spec.algorithm.block_size
    drafts = size if sample_from_anchor else size - 1
    assert result.tokens.shape == (drafts,) and result.logits.shape == (drafts, vocab)
    assert result.confidence.shape == (drafts,)
    assert bool(((result.confidence > 0) & (result.confidence < 1)).all())

    out = run_block(drafter, 5, taps=taps)
    out = drafter.block_forward(
        drafter.fuse(taps),
        torch.arange(5),
        torch.tensor([anchor] + [spec.algorithm.mask_token_id] * (size - 1)),
        torch.arange(5, 5 + size),
    )
    prev = prev_for(result, anchor, sample_from_anchor)
    logits, confidence = drafter.markov_heads(out.hidden, out.logits, prev)
    first = size - drafts
    assert close(result.logits, logits[first:]) and close(result.confidence, confidence[first:])
    assert torch.equal(result.tokens, drafter.draft_to_target[logits[first:].argmax(-1)])
    assert not close(logits, out.logits)  # the head changes the logits


def test_dspark_vanilla_bias_is_w2_of_w1_prev():
    spec = tiny_spec("dspark", markov_head_type="vanilla", draft_vocab_size=REDUCED)
    drafter, weights = build(spec)
    out = run_block(drafter)
    prev = torch.tensor([90, 3, 3, 41])
    logits, _ = drafter.markov_heads(out.hidden, out.logits, prev)
    w1 = weights.weights["markov_head.markov_w1.weight"].astype(np.float64)
    w2 = weights.weights["markov_head.markov_w2.weight"].astype(np.float64)
    expected = w1[prev.numpy()] @ w2.T
    assert np.allclose((logits - out.logits).numpy(), expected, atol=1e-5)


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_dspark_only_rnn_carries_state_across_slots(kind):
    drafter, _ = build(tiny_spec("dspark", markov_head_type=kind))
    out = run_block(drafter)
    a, _ = drafter.markov_heads(out.hidden, out.logits, torch.tensor([1, 2, 3, 4]))
    b, _ = drafter.markov_heads(out.hidden, out.logits, torch.tensor([50, 2, 3, 4]))
    assert not close(a[0], b[0])
    assert close(a[1:], b[1:]) == (kind != "rnn")


def test_dspark_heads_differ_by_kind():
    shared = None
    results = {}
    for kind in ("vanilla", "gated", "rnn"):
        drafter, _ = build(tiny_spec("dspark", markov_head_type=kind))
        out = run_block(drafter)
        if shared is None:
            shared = out.logits
        assert torch.equal(out.logits, shared)  # same backbone weights (same seed)
        results[kind] = drafter.markov_heads(out.hidden, out.logits, torch.tensor([1, 2, 3, 4]))
    for a, b in itertools.combinations(results.values(), 2):
        assert not close(a[0], b[0])


@pytest.mark.parametrize("confidence_head", [False, True])
def test_dspark_markov_rank_zero(confidence_head):
    spec = tiny_spec(
        "dspark",
        markov_rank=0,
        confidence_head=confidence_head,
        confidence_head_with_markov=False,
    )
    drafter, weights = build(spec)
    assert not any(name.startswith("markov_head") for name in drafter.state_dict())
    out = run_block(drafter)
    logits, confidence = drafter.markov_heads(out.hidden, out.logits, torch.tensor([1, 2, 3, 4]))
    assert torch.equal(logits, out.logits)
    result = drafter.block_draft(random_taps(6, 3), 21)
    assert torch.equal(result.tokens, drafter.draft_to_target[out.logits.argmax(-1)])
    if not confidence_head:
        assert confidence is None and result.confidence is None
        return
    w = weights.weights["confidence_head.proj.weight"].astype(np.float64)
    b = weights.weights["confidence_head.proj.bias"].astype(np.float64)
    expected = 1 / (1 + np.exp(-(out.hidden.double().numpy() @ w.T + b)))[:, 0]
    assert np.allclose(confidence.numpy(), expected, atol=1e-6)
    assert torch.equal(result.confidence, confidence)


def test_confidence_without_markov_features():
    spec = tiny_spec("dspark", confidence_head_with_markov=False, markov_head_type="gated")
    drafter, _ = build(spec)
    out = run_block(drafter)
    _, a = drafter.markov_heads(out.hidden, out.logits, torch.tensor([1, 2, 3, 4]))
    _, b = drafter.markov_heads(out.hidden, out.logits, torch.tensor([9, 8, 7, 6]))
    assert torch.equal(a, b)  # reads the hidden state only


# ---------------------------------------------------------------------------------------------
# Shared heads, weights, dtypes, errors


@pytest.mark.parametrize("algorithm", ["eagle3", "dspark"])
def test_shared_head_and_embedding_come_from_the_target(algorithm):
    spec = tiny_spec(algorithm, draft_vocab_size=REDUCED, num_layers=2)
    spec = dataclasses.replace(spec, head=Head(lm_head="shared", embedding="shared"))
    drafter = make_drafter(spec)
    tensors = target_tensors()
    shared = TorchDrafter(drafter, tensors)
    ids = drafter.vocab.target_ids(spec)
    assert not np.array_equal(ids, np.arange(REDUCED))
    assert np.array_equal(shared.lm_head.weight.numpy(), tensors["lm_head.weight"][ids])

    own_spec = dataclasses.replace(spec, head=Head(lm_head="own", embedding="own"))
    own_weights = dict(drafter.weights)
    own_weights["embed_tokens.weight"] = tensors["embed_tokens.weight"]
    own_weights["lm_head.weight"] = tensors["lm_head.weight"][ids]
    own = TorchDrafter(Drafter(own_spec, drafter.vocab, own_weights))
    taps = random_taps(5)
    if algorithm == "eagle3":
        tokens = torch.tensor([2, 80, 7, 7, 51, 13])
        a, b = shared.eagle3_draft(taps, tokens, 3), own.eagle3_draft(taps, tokens, 3)
    else:
        a, b = shared.block_draft(taps, 80), own.block_draft(taps, 80)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logits, b.logits)
    assert set(a.tokens.tolist()) <= set(ids.tolist())


def test_missing_or_wrong_target_tensors_are_named():
    spec = dataclasses.replace(
        tiny_spec("eagle3", draft_vocab_size=REDUCED),
        head=Head(lm_head="shared", embedding="shared"),
    )
    drafter = make_drafter(spec)
    with pytest.raises(DrafterError, match="embed_tokens.weight"):
        TorchDrafter(drafter)
    with pytest.raises(DrafterError, match="lm_head.weight"):
        TorchDrafter(drafter, {"embed_tokens.weight": target_tensors()["embed_tokens.weight"]})
    with pytest.raises(DrafterError, match="embed_tokens.weight"):
        TorchDrafter(drafter, {"lm_head.weight": target_tensors()["lm_head.weight"]})
    bad = target_tensors(vocab=V - 1)
    with pytest.raises(DrafterError, match=r"lm_head.weight.*shape"):
        TorchDrafter(drafter, {**target_tensors(), "lm_head.weight": bad["lm_head.weight"]})
    # Nothing shared: no target needed.
    own = dataclasses.replace(spec, head=Head(lm_head="own", embedding="own"))
    TorchDrafter(make_drafter(own))


def test_state_dict_names_are_the_canonical_names():
    for spec in (
        tiny_spec("eagle3", num_layers=2, style="qwen3", tap_norm="per_tap"),
        tiny_spec("dspark", markov_head_type="rnn", tap_norm="concat"),
    ):
        drafter, weights = build(spec)
        names = set(drafter.state_dict())
        assert names == set(spec.tensor_shapes()) | {"embed_tokens.weight", "lm_head.weight"}
        for name, array in weights.weights.items():
            assert np.array_equal(drafter.state_dict()[name].numpy(), array), name


def test_target_hidden_size_differs_from_the_drafter():
    spec = tiny_spec("eagle3", tap_norm="per_tap", num_layers=2)
    spec = dataclasses.replace(
        spec,
        target=dataclasses.replace(spec.target, hidden_size=48),
        head=Head(lm_head="own", embedding="own"),
    )
    drafter = TorchDrafter(make_drafter(spec))
    result = drafter.eagle3_draft(random_taps(4, width=A * 48), torch.arange(5), 2)
    assert result.tokens.shape == (2,)
    with pytest.raises(DrafterError, match="taps.shape"):
        drafter.fuse(random_taps(4))


def test_bf16_weights_read_bit_exactly_and_run_in_bf16():
    spec = tiny_spec("dspark", markov_head_type="rnn", num_layers=2, draft_vocab_size=REDUCED)
    bf16 = random_drafter(spec, dtype="BF16")
    before = {name: array.copy() for name, array in bf16.weights.items()}
    upcast = Drafter(spec, bf16.vocab, {k: v.astype(np.float32) for k, v in bf16.weights.items()})
    a = TorchDrafter(bf16, target_tensors())
    b = TorchDrafter(upcast, target_tensors())
    for name, tensor in a.state_dict().items():
        assert torch.equal(tensor, b.state_dict()[name]), name
    taps = random_taps(5)
    r32 = a.block_draft(taps, 4)
    half = TorchDrafter(bf16, target_tensors(), dtype=torch.bfloat16)
    assert half.fc.weight.dtype == torch.bfloat16
    r16 = half.block_draft(taps, 4)
    assert r16.logits.dtype == torch.bfloat16
    assert torch.allclose(r16.logits.float(), r32.logits, atol=0.05, rtol=0.05)
    for name, array in bf16.weights.items():
        assert array.tobytes() == before[name].tobytes()


def test_wrong_algorithm_methods_refuse():
    eagle, _ = build(tiny_spec("eagle3"))
    block, _ = build(tiny_spec("dflash"))
    with pytest.raises(DrafterError, match="eagle3"):
        block.eagle3_draft(random_taps(3), torch.arange(4), 2)
    with pytest.raises(DrafterError, match="dflash"):
        eagle.block_draft(random_taps(3), 1)


# ---------------------------------------------------------------------------------------------
# RoPE and whole layers against transformers


def layer_spec(style, rope_scaling=None, layers_theta=10000.0):
    return DecoderLayer(
        style=style,
        input="hidden",
        attention="causal",
        sliding_window=None,
        hidden_size=H,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        rope_theta=layers_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=128,
    )


LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
LINEAR = {"rope_type": "linear", "factor": 4.0}


def hf_config(style, rope_scaling, layers=4, tie=False):
    from transformers import LlamaConfig, Qwen3Config

    cls = LlamaConfig if style == "llama" else Qwen3Config
    rope = {"rope_type": "default", **(rope_scaling or {}), "rope_theta": 10000.0}
    return cls(
        vocab_size=64,
        hidden_size=H,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        max_position_embeddings=128,
        rope_parameters=rope,
        tie_word_embeddings=tie,
    )


@pytest.mark.parametrize("scaling", [None, LINEAR, LLAMA3])
def test_inverse_frequencies_equal_transformers(scaling):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    ours = inverse_frequencies(layer_spec("llama", scaling))
    config = hf_config("llama", scaling)
    if scaling is None:
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        theirs = LlamaRotaryEmbedding.compute_default_rope_parameters(config)[0]
    else:
        theirs = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu")[0]
    assert torch.equal(ours, theirs)
    if scaling is LLAMA3:  # all three wavelength bands are exercised
        base = inverse_frequencies(layer_spec("llama"))
        ratio = (base / ours).tolist()
        assert ratio[0] == 1.0 and 1.0 < ratio[1] < 8.0 and ratio[-1] == 8.0


@pytest.mark.parametrize("rope_type", ["yarn", "dynamic", "longrope"])
def test_unimplemented_rope_types_are_refused_by_name(rope_type):
    factors = {"short_factor": [1.0] * 4, "long_factor": [2.0] * 4}  # longrope's own
    scaling = {
        "rope_type": rope_type,
        "factor": 2.0,
        **(factors if rope_type == "longrope" else {}),
    }
    spec = with_layers(tiny_spec("eagle3"), rope_scaling=scaling)
    with pytest.raises(DrafterError, match=rope_type):
        TorchDrafter(make_drafter(spec), target_tensors())


@pytest.mark.parametrize("style, scaling", [("llama", LLAMA3), ("qwen3", LINEAR)])
def test_decoder_layers_equal_transformers(style, scaling):
    """Canonical names make an HF decoder layer's state_dict load as is; the layers must then
    reproduce HF's residual stream (mask, GQA, q/k norm, RoPE scaling, MLP)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config(style, scaling)).eval()
    ids = torch.randint(0, 64, (20,))
    with torch.no_grad():
        states = model(ids[None], output_hidden_states=True).hidden_states
        positions = torch.arange(20)
        visible = torch.ones(20, 20, dtype=torch.bool).tril()
        x = states[0][0]
        for i, hf_layer in enumerate(model.model.layers[:-1]):
            layer = TorchLayer(layer_spec(style, scaling))
            layer.load_state_dict(hf_layer.state_dict(), strict=True)
            x, _, _ = layer(x, *layer.rope(positions, torch.float32), visible)
            assert torch.allclose(x, states[i + 1][0], atol=1e-6, rtol=1e-5), i


# ---------------------------------------------------------------------------------------------
# Target wrapper


@pytest.mark.parametrize("style, tie", [("llama", False), ("qwen3", True)])
def test_torch_target(style, tie, tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config(style, None, layers=4, tie=tie)).eval()
    model.save_pretrained(tmp_path)
    ids = torch.randint(0, 64, (9,))
    with torch.no_grad():
        reference = model(ids[None], output_hidden_states=True)
    for target in (TorchTarget(model), TorchTarget(tmp_path)):
        logits, taps = target.forward(ids, [0, 1, 3, 4])
        assert torch.equal(logits, reference.logits[0])
        assert taps.shape == (9, 4 * H)
        for j, layer_id in enumerate([0, 1, 3]):
            assert torch.equal(taps[:, j * H : (j + 1) * H], reference.hidden_states[layer_id][0])
        last = taps[:, 3 * H :]
        assert not torch.allclose(last, reference.hidden_states[4][0])  # HF's is post-norm
        normed = target.model.model.norm(last)
        assert torch.allclose(normed, reference.hidden_states[4][0], atol=1e-6)
        assert torch.allclose(normed @ target.model.lm_head.weight.T, logits, atol=1e-5)
    with pytest.raises(DrafterError, match="ascending"):
        target.forward(ids, [2, 1])
    with pytest.raises(DrafterError, match=r"\[0, 4\]"):
        target.forward(ids, [1, 5])

    # End to end: taps from the target, shared embedding and head from its files.
    spec = tiny_spec("eagle3", vocab_size=64, draft_vocab_size=40, target_layers=4, style=style)
    drafter = TorchDrafter(make_drafter(spec), load_target_tensors(tmp_path))
    assert torch.equal(drafter.embed_tokens.weight, model.model.embed_tokens.weight)
    _, taps = target.forward(ids, spec.taps.layer_ids)
    result = drafter.eagle3_draft(taps[:-1], ids, 3)
    assert result.tokens.shape == (3,)


def test_missing_torch_names_the_extra():
    code = "import sys; sys.modules['torch'] = None; import woodcock.reference"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode != 0
    assert "ImportError" in result.stderr and "pip install -e '.[torch]'" in result.stderr
