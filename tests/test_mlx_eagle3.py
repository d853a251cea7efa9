"""The MLX EAGLE-3 drafter against the torch reference: every variant through the decoding loop's
API (add_context / propose, several rounds), truncated heads, weight loading and dtypes, the MLX
building blocks, the parity report and the `woodcock parity` command."""

import dataclasses
import json

import ml_dtypes
import mlx.core as mx
import numpy as np
import pytest
import torch
from helpers import run_cli
from mlx.utils import tree_flatten

from woodcock import parity as parity_module
from woodcock.errors import DrafterError
from woodcock.ir import Drafter, Head
from woodcock.loading import save_drafter
from woodcock.parity import eagle3_parity, parity
from woodcock.reference import TorchDrafter
from woodcock.reference.layers import apply_rope as torch_apply_rope
from woodcock.reference.layers import inverse_frequencies as torch_inverse_frequencies
from woodcock.reference.layers import rms_norm as torch_rms_norm
from woodcock.reference.layers import rope_tables as torch_rope_tables
from woodcock.runtime.eagle3 import (
    Eagle3Drafter,
    Eagle3Model,
    can_propose_together,
    propose_together,
)
from woodcock.runtime.layers import (
    KVCache,
    RoPE,
    apply_rope,
    inverse_frequencies,
    rms_norm,
    rope_tables,
    to_mx,
)
from woodcock.serve.batching import own_state
from woodcock.synthetic import random_drafter, tiny_spec
from woodcock.tensorfile import write_safetensors

V, H, A = 96, 32, 3  # tiny_spec's target vocab, hidden size, number of taps
REDUCED = 48
TOL = 1e-4
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


# ---------------------------------------------------------------------------------------------
# Builders


def with_layers(spec, **changes):
    return dataclasses.replace(
        spec, layers=tuple(dataclasses.replace(layer, **changes) for layer in spec.layers)
    )


def make_drafter(spec, seed=0, scale=0.1, dtype="F32"):
    """random_drafter with larger matrices (std `scale`): attention far from uniform and varied
    greedy tokens, so a wrong mask, position or norm moves the logits by much more than 1e-4."""
    drafter = random_drafter(spec, dtype=dtype, seed=seed)
    weights = {
        name: array
        if name.endswith("norm.weight")
        else (array.astype(np.float32) * np.float32(scale / 0.02)).astype(array.dtype)
        for name, array in drafter.weights.items()
    }
    return Drafter(spec, drafter.vocab, weights)


def target_tensors(seed=1, vocab=V, hidden=H):
    rng = np.random.default_rng(seed)
    return {
        "embed_tokens.weight": rng.standard_normal((vocab, hidden), dtype=np.float32),
        "lm_head.weight": 0.3 * rng.standard_normal((vocab, hidden), dtype=np.float32),
    }


def random_taps(rows, width, seed):
    return np.random.default_rng(seed).standard_normal((rows, width), dtype=np.float32)


def greedy(logits):
    return mx.argmax(logits)


def torch_rounds(reference, rounds, k):
    """The loop on the reference: per round, drop the chain rows (KVCache.truncate), run the new
    context rows, then a greedy chain of k steps. -> [(tokens [k], logits [k, Vd])]."""
    cache, position, results = reference.new_cache(), 1, []
    for tokens, taps in rounds:
        cache.truncate(cache.context)
        n = len(tokens)
        out = reference.eagle3_forward(
            torch.tensor(tokens),
            reference.fuse(torch.from_numpy(taps)),
            torch.arange(position, position + n),
            cache,
        )
        position += n
        logits, drafted = [out.logits[-1]], [reference.draft_to_target[out.logits[-1].argmax()]]
        for step in range(2, k + 1):
            out = reference.eagle3_forward(
                drafted[-1][None],
                out.hidden[-1:],
                torch.tensor([position + step - 2]),
                cache,
                chain=True,
            )
            logits.append(out.logits[-1])
            drafted.append(reference.draft_to_target[out.logits[-1].argmax()])
        results.append((torch.stack(drafted).numpy(), torch.stack(logits).numpy()))
    return results


def mlx_rounds(drafter, rounds, k, sampler=greedy):
    results = []
    for tokens, taps in rounds:
        drafter.add_context(tokens, mx.array(taps))
        drafted, logits = drafter.propose(k, sampler)
        mx.eval(drafted, logits)
        results.append((np.array(drafted), np.array(logits)))
    return results


def loop_rounds(spec, seed=3):
    """Three rounds as the decoding loop makes them: a prompt, then (accepted drafts + bonus)
    rows with the verifier's new features, then the bonus token alone (nothing accepted)."""
    width = len(spec.taps.layer_ids) * spec.target.hidden_size
    rng = np.random.default_rng(seed)
    vocab = spec.target.vocab_size
    return [
        (rng.integers(0, vocab, 7).tolist(), random_taps(7, width, seed)),
        (rng.integers(0, vocab, 3).tolist(), random_taps(3, width, seed + 1)),
        (rng.integers(0, vocab, 1).tolist(), random_taps(1, width, seed + 2)),
    ]


def assert_same_chains(spec, drafter, tensors=None, k=4):
    reference = TorchDrafter(drafter, tensors)
    runtime = Eagle3Drafter(drafter, tensors)
    rounds = loop_rounds(spec)
    expected = torch_rounds(reference, rounds, k)
    got = mlx_rounds(runtime, rounds, k)
    for r, ((t_tokens, t_logits), (m_tokens, m_logits)) in enumerate(
        zip(expected, got, strict=True)
    ):
        assert m_logits.shape == (k, spec.draft_vocab_size) and m_tokens.shape == (k,)
        assert np.abs(m_logits - t_logits).max() <= TOL, (r, np.abs(m_logits - t_logits).max())
        assert m_tokens.tolist() == t_tokens.tolist(), r
    return expected


# ---------------------------------------------------------------------------------------------
# Every variant against the reference, through add_context / propose


def variant(
    style="llama",
    layers=1,
    tap_norm="none",
    nbr=False,
    nout=False,
    vocab=V,
    window=None,
    **layer_changes,
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
    return with_layers(spec, sliding_window=window, **layer_changes)


FLAG_CASES = [
    (style, layers, tap_norm, nbr, nout)
    for style in ("llama", "qwen3")
    for layers in (1, 2)
    for tap_norm in ("none", "per_tap", "concat")
    for nbr in (False, True)
    for nout in (False, True)
]


@pytest.mark.parametrize("style, layers, tap_norm, nbr, nout", FLAG_CASES)
def test_flags_match_the_reference(style, layers, tap_norm, nbr, nout):
    spec = variant(style, layers, tap_norm, nbr, nout)
    assert_same_chains(spec, make_drafter(spec), target_tensors())


@pytest.mark.parametrize(
    "style, layers, vocab, window",
    [
        (style, layers, vocab, window)
        for style in ("llama", "qwen3")
        for layers in (1, 2)
        for vocab in (V, REDUCED)
        for window in (None, 1, 3, 100)
        if vocab == REDUCED or window is not None
    ],
)
def test_reduced_vocab_and_sliding_window_match_the_reference(style, layers, vocab, window):
    spec = variant(style, layers, "per_tap", nbr=layers == 2, nout=True, vocab=vocab, window=window)
    expected = assert_same_chains(spec, make_drafter(spec), target_tensors())
    if vocab == REDUCED:
        ids = make_drafter(spec).vocab.target_ids(spec)
        assert all(set(tokens.tolist()) <= set(ids.tolist()) for tokens, _ in expected)


def test_windows_differ_per_layer():
    spec = variant("qwen3", 2, "concat", nout=True)
    spec = dataclasses.replace(
        spec,
        layers=(
            dataclasses.replace(spec.layers[0], sliding_window=2),
            dataclasses.replace(spec.layers[1], sliding_window=None),
        ),
    )
    assert_same_chains(spec, make_drafter(spec), target_tensors())


@pytest.mark.parametrize(
    "changes",
    [
        {"rope_scaling": LLAMA3},
        {"rope_scaling": {"rope_type": "linear", "factor": 2.5}},
        {"rope_theta": 500000.0, "max_position_embeddings": 4096},
        {"attention_bias": True, "mlp_bias": True},
        {"num_key_value_heads": 4},
        {"num_key_value_heads": 1},
    ],
    ids=["llama3", "linear", "theta", "biases", "mha", "mqa"],
)
@pytest.mark.parametrize("style", ["llama", "qwen3"])
def test_layer_options_match_the_reference(changes, style):
    spec = variant(style, 2, "per_tap", nbr=True, vocab=REDUCED, window=4, **changes)
    assert_same_chains(spec, make_drafter(spec), target_tensors())


def test_fc_bias_matches_the_reference():
    spec = variant("llama", 1, "concat", nout=True)
    spec = dataclasses.replace(spec, fusion=dataclasses.replace(spec.fusion, fc_bias=True))
    assert_same_chains(spec, make_drafter(spec), target_tensors())


@pytest.mark.parametrize(
    "lm_head, embedding", [("shared", "shared"), ("shared", "own"), ("own", "own")]
)
def test_shared_and_own_heads_match_the_reference(lm_head, embedding):
    spec = variant("qwen3", 2, "per_tap", nbr=True, nout=True, vocab=REDUCED)
    spec = dataclasses.replace(spec, head=Head(lm_head=lm_head, embedding=embedding))
    drafter = make_drafter(spec)
    tensors = target_tensors() if "shared" in (lm_head, embedding) else None
    assert_same_chains(spec, drafter, tensors)


def test_target_hidden_size_differs_from_the_drafter():
    spec = variant("llama", 2, "per_tap", nout=True, vocab=REDUCED)
    spec = dataclasses.replace(
        spec,
        target=dataclasses.replace(spec.target, hidden_size=48),
        head=Head(lm_head="own", embedding="own"),
    )
    assert_same_chains(spec, make_drafter(spec))
    with pytest.raises(DrafterError, match=r"taps.shape = \[2, 96\].*\[n, 144\]"):
        Eagle3Drafter(make_drafter(spec)).add_context([1, 2], mx.zeros((2, 96)))


# ---------------------------------------------------------------------------------------------
# The loop's API


def tiny_runtime(window=None):
    spec = variant("qwen3", 2, "per_tap", nout=True, vocab=REDUCED, window=window)
    drafter = make_drafter(spec)
    return spec, drafter, Eagle3Drafter(drafter, target_tensors())


def test_propose_returns_lazy_target_ids_and_logits():
    spec, drafter, runtime = tiny_runtime()
    seen = []

    def sampler(logits):
        seen.append(logits.shape)
        return mx.argmax(logits)

    runtime.add_context(mx.array([3, 5, 7]), mx.array(random_taps(3, A * H, 0)))
    tokens, logits = runtime.propose(3, sampler)
    assert seen == [(REDUCED,)] * 3
    assert tokens.dtype == mx.int32 and tokens.shape == (3,)
    assert logits.dtype == mx.float32 and logits.shape == (3, REDUCED)
    ids = drafter.vocab.target_ids(spec)
    assert np.array_equal(np.array(runtime.head_target_ids), ids)
    assert set(np.array(tokens).tolist()) <= set(ids.tolist())


def test_context_calls_accumulate_and_proposals_repeat():
    spec, drafter, runtime = tiny_runtime(window=3)
    taps = random_taps(6, A * H, 4)
    runtime.add_context([1, 2, 3, 4, 5, 6], mx.array(taps))
    once = [np.array(a) for a in runtime.propose(4, greedy)]
    # The same rows in two calls before one propose: one forward, the same function.
    split = Eagle3Drafter(drafter, target_tensors())
    split.add_context([1, 2], mx.array(taps[:2]))
    split.add_context([3, 4, 5, 6], mx.array(taps[2:]))
    twice = [np.array(a) for a in split.propose(4, greedy)]
    assert np.array_equal(once[0], twice[0]) and np.abs(once[1] - twice[1]).max() <= 1e-6
    # Proposing again without new context starts over from the same last context row.
    again = [np.array(a) for a in runtime.propose(4, greedy)]
    assert np.array_equal(once[0], again[0]) and np.array_equal(once[1], again[1])
    # reset forgets everything: the same inputs give the same chain.
    runtime.reset()
    runtime.add_context([1, 2, 3, 4, 5, 6], mx.array(taps))
    fresh = [np.array(a) for a in runtime.propose(4, greedy)]
    assert np.array_equal(once[0], fresh[0]) and np.array_equal(once[1], fresh[1])


def test_cache_grows_past_its_step():
    spec, drafter, runtime = tiny_runtime(window=5)
    for cache in runtime._caches:
        cache.step = 4
    reference = TorchDrafter(drafter, target_tensors())
    rounds = [([t, t + 1, t + 2], random_taps(3, A * H, t)) for t in range(0, 15, 3)]
    expected = torch_rounds(reference, rounds, 3)
    got = mlx_rounds(runtime, rounds, 3)
    for (t_tokens, t_logits), (m_tokens, m_logits) in zip(expected, got, strict=True):
        assert np.abs(m_logits - t_logits).max() <= TOL
        assert m_tokens.tolist() == t_tokens.tolist()


def test_kv_cache_keeps_rows_when_growing():
    cache = KVCache()
    cache.step = 2
    rows = [mx.full((1, 2, 1, 4), float(i)) for i in range(5)]
    for row in rows:
        keys, values = cache.update_and_fetch(row, -row)
    assert keys.shape == (1, 2, 5, 4) and cache.keys.shape[2] == 6
    assert np.array_equal(np.array(keys)[0, 0, :, 0], np.arange(5.0))
    cache.trim(2)
    keys, values = cache.update_and_fetch(rows[4], rows[4])
    assert np.array_equal(np.array(keys)[0, 1, :, 0], [0.0, 1.0, 4.0])


def test_sampled_chain_uses_the_sampler_index():
    spec, drafter, runtime = tiny_runtime()
    runtime.add_context([9, 8], mx.array(random_taps(2, A * H, 5)))
    mx.random.seed(7)
    tokens, logits = runtime.propose(4, lambda row: mx.random.categorical(row))
    tokens, logits = np.array(tokens), np.array(logits)
    assert tokens.shape == (4,) and np.isfinite(logits).all()
    assert set(tokens.tolist()) <= set(drafter.vocab.target_ids(spec).tolist())


def test_drafters_propose_together_as_each_proposes_alone():
    spec, drafter, _ = tiny_runtime()
    shared = Eagle3Drafter(drafter, target_tensors())
    together = [own_state(shared) for _ in range(3)]
    alone = [Eagle3Drafter(drafter, target_tensors()) for _ in range(3)]
    # per round, each drafter's new context rows (0: none, it proposes again from the same
    # row) and draft length; the contexts grow unevenly, so rows pad and lengths differ
    rounds = [([3, 1, 5], [1, 3, 2]), ([1, 2, 1], [2, 1, 3]), ([4, 0, 2], [3, 2, 1])]
    seed = 0
    for new_rows, lengths in rounds:
        for row, n in enumerate(new_rows):
            if n:
                seed += 1
                tokens = [int(t) for t in np.random.default_rng(seed).integers(0, V, n)]
                taps = mx.array(random_taps(n, A * H, seed))
                together[row].add_context(tokens, taps)
                alone[row].add_context(tokens, taps)
        assert can_propose_together(together)
        got = propose_together(together, lengths, [greedy] * 3)
        for runtime, k, (tokens, logits) in zip(alone, lengths, got, strict=True):
            expected_tokens, expected_logits = runtime.propose(k, greedy)
            assert np.array(tokens).tolist() == np.array(expected_tokens).tolist()
            assert np.abs(np.array(logits) - np.array(expected_logits)).max() <= 1e-5
    # the state each is left in is its own: proposing alone from it continues as before
    for mine, theirs in zip(together, alone, strict=True):
        assert mine._context == theirs._context
        assert np.array(mine.propose(3, greedy)[0]).tolist() == (
            np.array(theirs.propose(3, greedy)[0]).tolist()
        )


def test_only_windowless_drafters_of_one_model_propose_together():
    _, drafter, runtime = tiny_runtime()
    assert not can_propose_together([runtime, Eagle3Drafter(drafter, target_tensors())])
    _, _, windowed = tiny_runtime(window=3)
    assert not can_propose_together([windowed, own_state(windowed)])
    _, _, context_free = tiny_runtime()
    with pytest.raises(DrafterError, match="no context rows"):
        propose_together([context_free, own_state(context_free)], [1, 1], [greedy] * 2)


# ---------------------------------------------------------------------------------------------
# Truncated heads


@pytest.mark.parametrize("lm_head", ["own", "shared"])
def test_truncated_head_gives_the_full_heads_logits_on_its_rows(lm_head):
    spec = variant("llama", 2, "per_tap", nout=True, vocab=REDUCED, window=3)
    spec = dataclasses.replace(spec, head=Head(lm_head=lm_head, embedding="shared"))
    drafter = make_drafter(spec)
    keep = np.sort(np.random.default_rng(0).choice(REDUCED, 20, replace=False))
    full = Eagle3Drafter(drafter, target_tensors())
    cut = Eagle3Drafter(drafter, target_tensors(), head_ids=keep)
    ids = drafter.vocab.target_ids(spec)
    assert np.array_equal(np.array(cut.head_target_ids), ids[keep])
    mask = np.full(REDUCED, -np.inf, dtype=np.float32)
    mask[keep] = 0.0
    mask = mx.array(mask)

    def kept_argmax(logits):  # the full head's choice restricted to the kept rows
        return mx.argmax(logits + mask)

    rounds = loop_rounds(spec)
    for (f_tokens, f_logits), (c_tokens, c_logits) in zip(
        mlx_rounds(full, rounds, 4, kept_argmax), mlx_rounds(cut, rounds, 4), strict=True
    ):
        assert np.array_equal(f_tokens, c_tokens)
        assert np.array_equal(f_logits[:, keep], c_logits)


@pytest.mark.parametrize(
    "head_ids, message",
    [
        (np.array([3, 2]), "strictly ascending"),
        (np.array([1, 1]), "strictly ascending"),
        (np.array([0, REDUCED]), r"48: expected draft-row indices in \[0, 48\)"),
        (np.array([-1, 4]), "-1: expected"),
        (np.array([], dtype=np.int64), "non-empty"),
        (np.array([[1, 2]]), "1-D"),
        (np.array([0.0, 1.0]), "integer"),
    ],
)
def test_bad_head_ids_are_refused(head_ids, message):
    spec = variant(vocab=REDUCED)
    with pytest.raises(DrafterError, match=message):
        Eagle3Drafter(make_drafter(spec), target_tensors(), head_ids=head_ids)


# ---------------------------------------------------------------------------------------------
# Weights, names, dtypes, errors


def test_bf16_weights_load_bit_exactly():
    rng = np.random.default_rng(0)
    bf16 = rng.standard_normal((7, 5)).astype(ml_dtypes.bfloat16)
    as_bf16 = to_mx(bf16, mx.bfloat16)
    assert as_bf16.dtype == mx.bfloat16
    assert np.array_equal(np.array(as_bf16.view(mx.uint16)), bf16.view(np.uint16))
    assert np.array_equal(np.array(to_mx(bf16)), bf16.astype(np.float32))
    assert np.array_equal(np.array(to_mx(bf16.astype(np.float16))), bf16.astype(np.float32))

    # A whole bf16 drafter: the fp32 runtime holds exactly the upcast weights and computes the
    # same as the drafter upcast in numpy.
    spec = variant("qwen3", 2, "per_tap", nout=True, vocab=REDUCED)
    drafter = make_drafter(spec, dtype="BF16")
    assert drafter.weights.dtypes == {"BF16": len(drafter.weights)}
    upcast = Drafter(
        spec, drafter.vocab, {k: v.astype(np.float32) for k, v in drafter.weights.items()}
    )
    a, b = Eagle3Drafter(drafter, target_tensors()), Eagle3Drafter(upcast, target_tensors())
    flat_a, flat_b = dict(tree_flatten(a.model.parameters())), tree_flatten(b.model.parameters())
    for name, array in flat_b:
        assert flat_a[name].dtype == mx.float32
        assert np.array_equal(np.array(flat_a[name]), np.array(array)), name
    rounds = loop_rounds(spec)
    for (ta, la), (tb, lb) in zip(mlx_rounds(a, rounds, 3), mlx_rounds(b, rounds, 3), strict=True):
        assert np.array_equal(ta, tb) and np.array_equal(la, lb)
    assert_same_chains(spec, drafter, target_tensors())


def test_bf16_activations_run():
    spec, drafter, _ = tiny_runtime()
    runtime = Eagle3Drafter(drafter, target_tensors(), dtype=mx.bfloat16)
    runtime.add_context([1, 2, 3], mx.array(random_taps(3, A * H, 0)))
    tokens, logits = runtime.propose(3, greedy)
    assert logits.dtype == mx.bfloat16 and np.isfinite(np.array(logits.astype(mx.float32))).all()
    assert tokens.shape == (3,)


def test_module_names_are_the_canonical_names():
    spec = variant("qwen3", 2, "per_tap", vocab=REDUCED, attention_bias=True, mlp_bias=True)
    spec = dataclasses.replace(spec, fusion=dataclasses.replace(spec.fusion, fc_bias=True))
    model = Eagle3Model(spec, REDUCED)
    names = {name for name, _ in tree_flatten(model.parameters())}
    assert names == set(spec.tensor_shapes()) | {"embed_tokens.weight", "lm_head.weight"}
    shapes = dict(spec.tensor_shapes()) | {"embed_tokens.weight": (V, H)}
    for name, array in tree_flatten(model.parameters()):
        assert tuple(array.shape) == shapes.get(name, (REDUCED, H)), name


def test_not_eagle3_or_missing_target_tensors_are_refused():
    with pytest.raises(DrafterError, match="expected 'eagle3'"):
        Eagle3Drafter(make_drafter(tiny_spec("dflash")), target_tensors())
    spec = dataclasses.replace(variant(vocab=REDUCED), head=Head("shared", "shared"))
    drafter = make_drafter(spec)
    with pytest.raises(DrafterError, match="embed_tokens.weight.*missing"):
        Eagle3Drafter(drafter)
    with pytest.raises(DrafterError, match="lm_head.weight.*missing"):
        Eagle3Drafter(drafter, {"embed_tokens.weight": target_tensors()["embed_tokens.weight"]})
    bad = target_tensors(vocab=V - 1)
    with pytest.raises(DrafterError, match=r"lm_head.weight.*shape = \(95, 32\)"):
        Eagle3Drafter(drafter, {**target_tensors(), "lm_head.weight": bad["lm_head.weight"]})


def test_bad_calls_are_refused():
    _, _, runtime = tiny_runtime()
    with pytest.raises(DrafterError, match="no context rows"):
        runtime.propose(2, greedy)
    with pytest.raises(DrafterError, match=r"taps.shape = \[2, 95\]"):
        runtime.add_context([1, 2], mx.zeros((2, 95)))
    with pytest.raises(DrafterError, match=r"tokens.shape = \[3\]"):
        runtime.add_context([1, 2, 3], mx.zeros((2, A * H)))
    runtime.add_context([1], mx.zeros((1, A * H)))
    with pytest.raises(DrafterError, match="k = 0"):
        runtime.propose(0, greedy)


@pytest.mark.parametrize(
    "scaling, message",
    [
        ({"rope_type": "yarn", "factor": 2.0}, "'yarn'"),
        ({"rope_type": "dynamic", "factor": 2.0}, "'dynamic'"),
        ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}, "partial"),
    ],
)
def test_unsupported_rope_is_refused(scaling, message):
    spec = variant(rope_scaling=scaling)
    with pytest.raises(DrafterError, match=message):
        Eagle3Drafter(make_drafter(spec), target_tensors())


# ---------------------------------------------------------------------------------------------
# Building blocks


ROPE_LAYERS = [
    {"head_dim": dim, "rope_theta": theta, "rope_scaling": scaling}
    for dim in (8, 64, 128)
    for theta in (10000.0, 500000.0, 123.4)
    for scaling in (None, LLAMA3, {"rope_type": "linear", "factor": 3.0})
]


def test_inverse_frequencies_match_the_reference():
    equal = total = 0
    for changes in ROPE_LAYERS:
        layer = dataclasses.replace(tiny_spec().layers[0], **changes)
        mine, theirs = inverse_frequencies(layer), torch_inverse_frequencies(layer).numpy()
        assert mine.dtype == np.float32
        # torch's powf is not correctly rounded: a few powers are one ulp apart, which a division
        # or llama3's blend can turn into two; never more.
        np.testing.assert_array_max_ulp(mine, theirs, maxulp=2)
        equal, total = equal + int((mine == theirs).sum()), total + mine.size
    assert equal / total > 0.95


@pytest.mark.parametrize("changes", ROPE_LAYERS[::4])
def test_rope_matches_the_reference(changes):
    layer = dataclasses.replace(tiny_spec().layers[0], **changes)
    dim = layer.head_dim
    x = np.random.default_rng(0).standard_normal((3, 40, dim), dtype=np.float32)
    start = 25
    positions = torch.arange(start, start + 40)
    inv = torch_inverse_frequencies(layer)
    expected = torch_apply_rope(
        torch.from_numpy(x), *torch_rope_tables(positions, inv, torch.float32)
    )
    fused = RoPE(layer)(mx.array(x)[None], start)[0]
    tables = rope_tables(mx.array(positions.numpy()), mx.array(inv_np := inv.numpy()))
    explicit = apply_rope(mx.array(x), *tables)
    assert np.abs(np.array(fused) - expected.numpy()).max() <= 2e-5
    assert np.abs(np.array(explicit) - expected.numpy()).max() <= 2e-6
    assert inv_np.shape == (dim // 2,)


def test_rms_norm_has_hf_numerics():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 96), dtype=np.float32)
    w = (1 + 0.1 * rng.standard_normal(96)).astype(np.float32)
    for m_dtype, t_dtype, tol in (
        (mx.float32, torch.float32, 1e-6),
        (mx.bfloat16, torch.bfloat16, 0),
    ):
        got = rms_norm(mx.array(x).astype(m_dtype), mx.array(w).astype(m_dtype), 1e-6)
        want = torch_rms_norm(
            torch.from_numpy(x).to(t_dtype), torch.from_numpy(w).to(t_dtype), 1e-6
        )
        assert got.dtype == m_dtype
        diff = np.abs(np.array(got.astype(mx.float32)) - want.float().numpy()).max()
        assert diff <= tol, (m_dtype, diff)


# ---------------------------------------------------------------------------------------------
# Parity report and command


def test_parity_report():
    spec = variant("qwen3", 2, "per_tap", nbr=True, nout=True, vocab=REDUCED, window=3)
    report = eagle3_parity(make_drafter(spec), target_tensors(), steps=3, context=9)
    assert report["ok"] and report["tokens"]["agree"]
    names = [row["name"] for row in report["tensors"]]
    assert names == [
        "fused",
        "layers.0 output",
        "layers.1 output",
        "fed-back state",
        "logits, context rows",
        "logits, step 1",
        "logits, step 2",
        "logits, step 3",
    ]
    assert report["tensors"][4]["shape"] == [9, REDUCED]
    assert all(row["max_abs_diff"] <= TOL for row in report["tensors"])
    assert len(report["tokens"]["mlx"]) == 3
    text = parity_module.render_text(report)
    assert "layers.1 output" in text and text.splitlines()[-1].startswith("OK")


def test_parity_covers_block_drafters_and_refuses_missing_targets():
    for algorithm in ("dflash", "dspark"):
        assert parity(make_drafter(tiny_spec(algorithm)), target_tensors())["ok"]
    with pytest.raises(DrafterError, match="shares its embedding with the target"):
        parity(make_drafter(tiny_spec("eagle3")))


@pytest.fixture
def drafter_dirs(tmp_path):
    spec = variant("qwen3", 2, "per_tap", nout=True, vocab=64, window=4)
    shared = tmp_path / "shared"
    save_drafter(make_drafter(spec, dtype="BF16"), shared)
    own_spec = dataclasses.replace(spec, head=Head(lm_head="own", embedding="own"))
    own = tmp_path / "own"
    save_drafter(make_drafter(own_spec), own)
    target = tmp_path / "target"
    target.mkdir()
    tensors = target_tensors()
    write_safetensors(
        target / "model.safetensors",
        {
            "model.embed_tokens.weight": tensors["embed_tokens.weight"],
            "lm_head.weight": tensors["lm_head.weight"],
        },
    )
    return {"shared": shared, "own": own, "target": target}


def test_parity_command(drafter_dirs, capsys):
    code, out, err = run_cli(["parity", str(drafter_dirs["own"])], capsys)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].endswith("; cpu backend")
    assert lines[1].split() == ["tensor", "shape", "max", "|diff|"]
    assert any(line.startswith("logits, step 4") for line in lines)
    assert "agree" in out and lines[-1].startswith("OK: max |diff|")

    code, out, err = run_cli(
        [
            "parity",
            str(drafter_dirs["shared"]),
            "--target",
            str(drafter_dirs["target"]),
            "--steps",
            "2",
            "--json",
        ],
        capsys,
    )
    assert code == 0, err
    report = json.loads(out)
    assert report["ok"] and report["steps"] == 2 and report["max_abs_diff"] <= TOL
    assert report["backend"]["backend"] == "cpu"


def test_parity_command_needs_the_target_of_a_shared_head(drafter_dirs, capsys):
    code, out, err = run_cli(["parity", str(drafter_dirs["shared"])], capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1
    assert err.startswith("woodcock: error: the drafter shares its embedding with the target")
    assert "--target" in err


def test_parity_command_fails_past_the_tolerance(drafter_dirs, capsys, monkeypatch):
    monkeypatch.setattr(parity_module, "TOLERANCE", -1.0)
    code, out, _ = run_cli(["parity", str(drafter_dirs["own"])], capsys)
    assert code == 1
    assert "> tolerance" in out and out.splitlines()[-1].startswith("FAIL")


def test_parity_command_on_a_block_drafter(drafter_dirs, tmp_path, capsys):
    path = tmp_path / "dflash"
    save_drafter(random_drafter(tiny_spec("dflash")), path)
    code, out, err = run_cli(["parity", str(path), "--target", str(drafter_dirs["target"])], capsys)
    assert code == 0, err
    assert out.splitlines()[-1].startswith("OK")
