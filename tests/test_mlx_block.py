"""The MLX block drafters (DFlash, DSpark) against the torch reference: greedy drafts, logits and
confidence over several rounds of the loop's API, every flag of the spec, k below and above the
number of draft slots, shared heads, and a drafter at the seed checkpoint's shape read back from
the speculators format."""

import dataclasses

import mlx.core as mx
import numpy as np
import pytest
import torch
from helpers import generate_tokens
from mlx_lm.generate import generate_step
from mlx_targets import tiny_target

from woodcock.errors import DrafterError
from woodcock.formats import speculators
from woodcock.ir import Drafter, Head, Taps, Target
from woodcock.loading import load_drafter
from woodcock.parity import block_parity
from woodcock.reference import TorchDrafter
from woodcock.runtime.block import BlockDrafter, can_propose_together, propose_together
from woodcock.runtime.decode import Stats
from woodcock.runtime.target import MlxTarget
from woodcock.serve.batching import own_state
from woodcock.synthetic import random_drafter, tiny_spec

V, H = 96, 32  # tiny_spec's target vocab and hidden size
REDUCED = 40
ATOL = 1e-4


def greedy(row):
    return mx.argmax(row)


def make_spec(
    algorithm,
    *,
    layers=1,
    block=4,
    anchor=False,
    attention="block_bidirectional",
    window=None,
    style="qwen3",
    vocab=None,
    head="shared",
    embedding="shared",
    tap_norm="none",
    biases=False,
    rope_scaling=None,
    layer_changes=(),
    vocab_size=V,
    **algorithm_fields,
):
    """tiny_spec with the block fields set; layer_changes: per-layer overrides (index, dict)."""
    spec = tiny_spec(
        algorithm,
        num_layers=layers,
        vocab_size=vocab_size,
        style=style,
        draft_vocab_size=vocab,
        tap_norm=tap_norm,
        block_size=block,
        sample_from_anchor=anchor,
        **algorithm_fields,
    )
    changed = []
    for i, layer in enumerate(spec.layers):
        fields = {
            "attention": attention,
            "sliding_window": window,
            "rope_scaling": rope_scaling,
            "attention_bias": biases,
            "mlp_bias": biases,
        }
        fields |= dict(layer_changes).get(i, {})
        changed.append(dataclasses.replace(layer, **fields))
    return dataclasses.replace(
        spec,
        layers=tuple(changed),
        head=Head(lm_head=head, embedding=embedding),
        fusion=dataclasses.replace(spec.fusion, fc_bias=biases),
    )


def make_drafter(spec, seed=0, scale=0.3):
    """Matrices larger than random_drafter's (std `scale`) so that attention is far from
    uniform and the drafts differ from slot to slot."""
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
        "lm_head.weight": 0.5 * rng.standard_normal((vocab, hidden), dtype=np.float32),
    }


def assert_close(mlx_value, torch_value, what):
    a, b = np.array(mlx_value), torch_value.numpy()
    assert a.shape == b.shape, what
    diff = float(np.abs(a - b).max())
    assert diff <= ATOL, f"{what}: max |diff| {diff}"


def run_rounds(drafter, tensors=None, *, rounds=4, seed=3, sampler=greedy):
    """Drive BlockDrafter through add_context/propose like the decoding loop (the context grows
    by a few verified rows each round, the anchor moves) and check each proposal against
    TorchDrafter.block_draft on the whole context so far. Returns the drafts of every round."""
    spec = drafter.spec
    algorithm = spec.algorithm
    reference = TorchDrafter(drafter, tensors)
    runtime = BlockDrafter(drafter, tensors)
    rng = np.random.default_rng(seed)
    width = len(spec.taps.layer_ids) * spec.target.hidden_size
    taps = np.zeros((0, width), np.float32)
    new = 5
    tokens = rng.integers(0, spec.target.vocab_size, size=new)
    seen = []
    for _ in range(rounds):
        rows = rng.standard_normal((new, width), dtype=np.float32)
        taps = np.concatenate([taps, rows])
        runtime.add_context(mx.array(tokens.astype(np.int32)), mx.array(rows))
        anchor = int(tokens[-1])
        drafted, logits = runtime.propose(runtime.num_drafts, sampler)
        confidence = runtime.last_confidence
        expected = reference.block_draft(torch.from_numpy(taps), anchor)
        assert np.array(drafted).tolist() == expected.tokens.tolist()
        assert drafted.dtype == mx.int32
        assert_close(logits, expected.logits, "logits")
        if expected.confidence is None:
            assert confidence is None
        else:
            assert_close(confidence, expected.confidence, "confidence")
        seen.append(np.array(drafted).tolist())
        # The verifier accepts some drafts and adds its own token: the next anchor.
        accepted = int(rng.integers(0, runtime.num_drafts + 1))
        new = accepted + 1
        bonus = int(rng.integers(0, spec.target.vocab_size))
        tokens = np.array(np.array(drafted).tolist()[:accepted] + [bonus])
    assert runtime.context_length == taps.shape[0]
    assert algorithm.num_drafts == runtime.num_drafts
    return seen


CASES = {
    # DFlash
    "dflash": make_spec("dflash", style="llama"),
    "dflash-anchor-b2-causal-window-reduced-own": make_spec(
        "dflash",
        layers=2,
        block=2,
        anchor=True,
        attention="block_causal",
        window=3,
        vocab=REDUCED,
        head="own",
        embedding="own",
        tap_norm="per_tap",
    ),
    "dflash-b16-mixed-layers-concat-reduced-rope-biases": make_spec(
        "dflash",
        layers=2,
        block=16,
        vocab=REDUCED,
        tap_norm="concat",
        biases=True,
        style="llama",
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        layer_changes=[(0, {"attention": "block_causal", "sliding_window": 5})],
    ),
    # DSpark
    "dspark-vanilla-anchor": make_spec("dspark", anchor=True),
    "dspark-vanilla-b16-causal-own-pertap": make_spec(
        "dspark",
        layers=2,
        block=16,
        attention="block_causal",
        head="own",
        tap_norm="per_tap",
    ),
    "dspark-gated-conf-plain-reduced-own": make_spec(
        "dspark",
        layers=2,
        attention="block_causal",
        vocab=REDUCED,
        head="own",
        markov_head_type="gated",
        confidence_head_with_markov=False,
    ),
    "dspark-gated-anchor-b2-window": make_spec(
        "dspark", block=2, anchor=True, window=2, markov_head_type="gated"
    ),
    "dspark-rnn-anchor-b16-window-reduced": make_spec(
        "dspark",
        layers=2,
        block=16,
        anchor=True,
        window=4,
        vocab=REDUCED,
        markov_head_type="rnn",
    ),
    "dspark-rnn-b2-no-conf-biases": make_spec(
        "dspark", block=2, markov_head_type="rnn", confidence_head=False, biases=True
    ),
    "dspark-rnn-b4-causal-embedding-own": make_spec(
        "dspark", layers=2, attention="block_causal", embedding="own", markov_head_type="rnn"
    ),
    "dspark-rank0-conf": make_spec(
        "dspark", anchor=True, markov_rank=0, confidence_head_with_markov=False
    ),
    "dspark-rank0-no-conf": make_spec(
        "dspark", markov_rank=0, confidence_head=False, confidence_head_with_markov=False
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_rounds_match_reference(name):
    spec = CASES[name]
    drafter = make_drafter(spec)
    seen = run_rounds(drafter, target_tensors())
    # The drafts are not all one token: the comparison would not notice a wrong slot order.
    assert len({token for tokens in seen for token in tokens}) > 1 or spec.algorithm.num_drafts == 1


@pytest.mark.parametrize(
    ("algorithm", "vocab"), [("dflash", None), ("dspark", 1037), ("dspark", None)]
)
def test_large_vocabulary_blocked_head(algorithm, vocab):
    """A vocabulary large enough for the CPU's blocked head layout, not a multiple of the block
    (the last block is padded), full and reduced."""
    size = 1300
    spec = make_spec(algorithm, vocab_size=size, vocab=vocab, block=4, anchor=algorithm == "dspark")
    tensors = target_tensors(vocab=size)
    drafter = make_drafter(spec)
    if mx.default_device().type == mx.cpu:
        assert "head_blocks" in BlockDrafter(drafter, tensors)._fast
    run_rounds(drafter, tensors, rounds=2)


@pytest.mark.parametrize(
    "name",
    [
        "dflash",
        "dspark-vanilla-anchor",
        "dspark-gated-conf-plain-reduced-own",
        "dspark-rnn-b2-no-conf-biases",
        "dspark-rnn-anchor-b16-window-reduced",
    ],
)
def test_sampled_drafts_condition_the_markov_head(name):
    """A sampler that is not argmax: each later slot's Markov bias must read the token actually
    drafted before it (as a target id), checked with the reference's teacher-forced heads."""
    spec = CASES[name]
    drafter = make_drafter(spec, seed=4)
    tensors = target_tensors()
    reference = TorchDrafter(drafter, tensors)
    runtime = BlockDrafter(drafter, tensors)
    algorithm = spec.algorithm
    rng = np.random.default_rng(5)
    taps = rng.standard_normal((7, 3 * H), dtype=np.float32)
    anchor = 11
    runtime.add_context(mx.array([3] * 6 + [anchor], mx.int32), mx.array(taps))
    drafted, logits = runtime.propose(runtime.num_drafts, lambda row: mx.argmin(row))
    drafted = np.array(drafted).tolist()
    head_ids = np.array(runtime.head_target_ids)
    assert drafted == [int(head_ids[j]) for j in np.array(logits).argmin(axis=-1)]
    size, first = algorithm.block_size, 0 if algorithm.sample_from_anchor else 1
    p = taps.shape[0]
    ids = torch.tensor([anchor] + [algorithm.mask_token_id] * (size - 1))
    out = reference.block_forward(
        reference.fuse(torch.from_numpy(taps)), torch.arange(p), ids, torch.arange(p, p + size)
    )
    before = [anchor] * (1 + first) + drafted[: size - 1 - first]
    expected, confidence = reference.markov_heads(out.hidden, out.logits, torch.tensor(before))
    assert_close(logits, expected[first:], "Markov-corrected logits")
    if confidence is not None:
        assert_close(runtime.last_confidence, confidence[first:], "confidence")
    assert_close(runtime.block_hidden(), out.hidden, "block hidden")


@pytest.mark.parametrize(
    "name", ["dflash", "dspark-vanilla-anchor", "dspark-rnn-anchor-b16-window-reduced"]
)
def test_propose_k_is_the_prefix(name):
    spec = CASES[name]
    drafter = make_drafter(spec)
    runtime = BlockDrafter(drafter, target_tensors())
    rng = np.random.default_rng(6)
    runtime.add_context(mx.array([1, 2, 3, 4], mx.int32), mx.array(rng.standard_normal((4, 3 * H))))
    full, full_logits = runtime.propose(runtime.num_drafts, greedy)
    full_confidence = runtime.last_confidence
    for k in range(1, runtime.num_drafts + 1):
        drafted, logits = runtime.propose(k, greedy)
        assert drafted.shape == (k,) and logits.shape == (k, spec.draft_vocab_size)
        assert np.array(drafted).tolist() == np.array(full).tolist()[:k]
        np.testing.assert_allclose(np.array(logits), np.array(full_logits)[:k], atol=1e-6)
        if full_confidence is None:
            assert runtime.last_confidence is None
        else:
            assert runtime.last_confidence.shape == (k,)
            np.testing.assert_allclose(
                np.array(runtime.last_confidence), np.array(full_confidence)[:k], atol=1e-6
            )
    with pytest.raises(DrafterError, match=f"k = {runtime.num_drafts + 1}: expected 1 to"):
        runtime.propose(runtime.num_drafts + 1, greedy)
    with pytest.raises(DrafterError, match="k = 0"):
        runtime.propose(0, greedy)


@pytest.mark.parametrize("name", list(CASES))
def test_drafters_propose_together_as_each_proposes_alone(name):
    """Three drafters of one model with contexts of different lengths (so the blocks sit at
    different positions, windows cut differently) and different draft counts, round after
    round: together, each drafts what it drafts alone."""
    drafter = make_drafter(CASES[name])
    tensors = target_tensors()
    shared = BlockDrafter(drafter, tensors)
    together = [own_state(shared) for _ in range(3)]
    alone = [BlockDrafter(drafter, tensors) for _ in range(3)]
    assert can_propose_together(together)
    assert not can_propose_together([together[0], alone[0]])
    most = shared.num_drafts
    rng = np.random.default_rng(9)
    for new_rows in ([7, 2, 4], [1, 3, 2], [2, 1, 5]):
        lengths = [int(k) for k in rng.integers(1, most + 1, 3)]
        for row, n in enumerate(new_rows):
            tokens = mx.array(rng.integers(0, V, n).astype(np.int32))
            taps = mx.array(rng.standard_normal((n, 3 * H), dtype=np.float32))
            together[row].add_context(tokens, taps)
            alone[row].add_context(tokens, taps)
        got = propose_together(together, lengths, [greedy] * 3)
        for mine, theirs, k, (tokens, logits) in zip(together, alone, lengths, got, strict=True):
            expected_tokens, expected_logits = theirs.propose(k, greedy)
            assert np.array(tokens).tolist() == np.array(expected_tokens).tolist()
            np.testing.assert_allclose(np.array(logits), np.array(expected_logits), atol=1e-5)
            if theirs.last_confidence is None:
                assert mine.last_confidence is None
            else:
                np.testing.assert_allclose(
                    np.array(mine.last_confidence), np.array(theirs.last_confidence), atol=1e-5
                )
            assert mine.context_length == theirs.context_length
    with pytest.raises(DrafterError, match=f"k = {most + 1}: expected 1 to"):
        propose_together(together, [1, most + 1, 1], [greedy] * 3)


def test_num_drafts_and_head_ids():
    anchor = make_drafter(make_spec("dspark", block=4, anchor=True, vocab=REDUCED))
    runtime = BlockDrafter(anchor, target_tensors())
    assert runtime.num_drafts == 4 and runtime.spec == anchor.spec
    ids = runtime.head_target_ids
    assert ids.dtype == mx.int32 and ids.shape == (REDUCED,)
    assert np.array(ids).tolist() == anchor.vocab.draft_to_target.tolist()
    plain = BlockDrafter(make_drafter(make_spec("dflash", block=4)), target_tensors())
    assert plain.num_drafts == 3
    assert np.array(plain.head_target_ids).tolist() == list(range(V))


def test_reset_and_repeated_propose():
    drafter = make_drafter(CASES["dspark-rnn-anchor-b16-window-reduced"])
    runtime = BlockDrafter(drafter, target_tensors())
    rng = np.random.default_rng(7)
    taps = mx.array(rng.standard_normal((6, 3 * H), dtype=np.float32))
    tokens = mx.array([5, 6, 7, 8, 9, 10], mx.int32)
    runtime.add_context(tokens, taps)
    first = [np.array(a) for a in runtime.propose(8, greedy)]
    again = [np.array(a) for a in runtime.propose(8, greedy)]  # no new context: same proposal
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(a, b)
    runtime.add_context(mx.array([1, 2], mx.int32), taps[:2])
    assert runtime.context_length == 8
    runtime.reset()
    assert runtime.context_length == 0 and runtime.last_confidence is None
    with pytest.raises(DrafterError, match="no context rows"):
        runtime.propose(1, greedy)
    runtime.add_context(tokens, taps)
    for a, b in zip(first, runtime.propose(8, greedy), strict=True):
        np.testing.assert_array_equal(a, np.array(b))


def test_context_in_one_call_or_several():
    """The cache appends rows at their true positions: one call or row by row, same drafts."""
    drafter = make_drafter(CASES["dspark-vanilla-b16-causal-own-pertap"])
    tensors = target_tensors()
    rng = np.random.default_rng(8)
    taps = mx.array(rng.standard_normal((9, 3 * H), dtype=np.float32))
    tokens = mx.array(rng.integers(0, V, 9).astype(np.int32))
    whole = BlockDrafter(drafter, tensors)
    whole.add_context(tokens, taps)
    pieces = BlockDrafter(drafter, tensors)
    for start, stop in ((0, 1), (1, 5), (5, 5), (5, 9)):
        pieces.add_context(tokens[start:stop], taps[start:stop])
    a, b = whole.propose(15, greedy), pieces.propose(15, greedy)
    assert np.array(a[0]).tolist() == np.array(b[0]).tolist()
    np.testing.assert_allclose(np.array(a[1]), np.array(b[1]), atol=1e-5)


def test_errors():
    spec = make_spec("dflash")
    drafter = make_drafter(spec)
    with pytest.raises(DrafterError, match=r"target_tensors\['embed_tokens.weight'\] missing"):
        BlockDrafter(drafter)
    with pytest.raises(DrafterError, match=r"target_tensors\['lm_head.weight'\] missing"):
        BlockDrafter(drafter, {"embed_tokens.weight": target_tensors()["embed_tokens.weight"]})
    wrong = {name: array[:, :8] for name, array in target_tensors().items()}
    with pytest.raises(DrafterError, match=r"shape = \(96, 8\): expected \(96, 32\)"):
        BlockDrafter(drafter, wrong)
    eagle = random_drafter(tiny_spec("eagle3"))
    with pytest.raises(DrafterError, match="expected 'dflash' or 'dspark'"):
        BlockDrafter(eagle, target_tensors())
    runtime = BlockDrafter(drafter, target_tensors())
    with pytest.raises(DrafterError, match=r"expected \[n\] and \[n, 96\]"):
        runtime.add_context(mx.array([1, 2], mx.int32), mx.zeros((2, 95)))
    with pytest.raises(DrafterError, match=r"expected \[n\] and \[n, 96\]"):
        runtime.add_context(mx.array([1, 2], mx.int32), mx.zeros((3, 96)))


def test_bfloat16_weights_and_taps():
    """bf16 checkpoint weights are widened exactly; bf16 taps are read as fp32."""
    spec = make_spec("dspark", anchor=True, markov_head_type="gated")
    drafter = make_drafter(spec)
    bf16 = random_drafter(spec, dtype="BF16")
    bf16 = Drafter(
        spec,
        drafter.vocab,
        {
            name: (a.astype(np.float32) * (1 if name.endswith("norm.weight") else 7.5)).astype(
                a.dtype
            )
            for name, a in bf16.weights.items()
        },
    )
    tensors = target_tensors()
    runtime = BlockDrafter(bf16, tensors)
    reference = TorchDrafter(bf16, tensors)
    taps = np.random.default_rng(9).standard_normal((5, 3 * H), dtype=np.float32)
    runtime.add_context(mx.array([1, 2, 3, 4, 5], mx.int32), mx.array(taps).astype(mx.bfloat16))
    drafted, logits = runtime.propose(4, greedy)
    rounded = torch.from_numpy(taps).to(torch.bfloat16).float()
    expected = reference.block_draft(rounded, 5)
    assert np.array(drafted).tolist() == expected.tokens.tolist()
    assert_close(logits, expected.logits, "logits")


def seed_shaped_spec():
    """The seed checkpoint's shape (block 16, 5 layers, 5 taps, vanilla rank-8 Markov head,
    confidence head with Markov features, full vocabulary) at tiny dimensions."""
    spec = make_spec("dspark", layers=5, block=16, anchor=True, markov_rank=8)
    return dataclasses.replace(
        spec,
        taps=Taps((1, 4, 8, 12, 15)),
        target=Target(num_hidden_layers=None, hidden_size=H, vocab_size=V, name_or_path="t"),
    )


def test_seed_shaped_drafter_through_the_speculators_format(tmp_path):
    drafter = make_drafter(seed_shaped_spec(), scale=0.1)
    speculators.write(drafter, tmp_path / "seed")
    loaded = load_drafter(tmp_path / "seed")
    assert loaded.spec.algorithm == drafter.spec.algorithm
    assert len(loaded.spec.layers) == 5 and len(loaded.spec.taps.layer_ids) == 5
    assert loaded.spec.head == Head(lm_head="shared", embedding="shared")
    run_rounds(loaded, target_tensors(), rounds=3)
    report = block_parity(loaded, target_tensors())
    assert report["ok"], report


@pytest.mark.parametrize(
    "name", ["dflash", "dspark-rnn-b4-causal-embedding-own", "dspark-gated-conf-plain-reduced-own"]
)
def test_block_parity_report(name):
    spec = CASES[name]
    report = block_parity(make_drafter(spec), target_tensors(), context=9, seed=2)
    assert report["ok"], report
    assert report["algorithm"] == spec.algorithm.name and report["context"] == 9
    assert report["steps"] == spec.algorithm.num_drafts
    names = [row["name"] for row in report["tensors"]]
    assert names[0] == "fused context" and "backbone logits" in names
    assert sum(name.startswith("layers.") for name in names) == len(spec.layers)
    assert ("confidence" in names) == bool(getattr(spec.algorithm, "confidence_head", False))
    assert report["tokens"]["agree"] and len(report["tokens"]["mlx"]) == report["steps"]
    assert report["max_abs_diff"] <= report["tolerance"] == 1e-4


def test_block_parity_needs_the_target_when_shared():
    with pytest.raises(DrafterError, match="shares its lm_head and embedding"):
        block_parity(make_drafter(make_spec("dflash")))


@pytest.mark.parametrize("algorithm", ["dflash", "dspark"])
def test_speculative_loop_with_a_block_drafter(algorithm):
    """Through the decoding loop on a tiny mlx-lm target: the output is the target's own greedy
    output, and the drafter's context is exactly the verified positions."""
    model = tiny_target("qwen3", scale=0.5)
    args = model.args
    spec = make_spec(algorithm, layers=2, block=4, anchor=algorithm == "dspark")
    spec = dataclasses.replace(
        spec,
        target=Target(
            num_hidden_layers=args.num_hidden_layers,
            hidden_size=args.hidden_size,
            vocab_size=args.vocab_size,
        ),
        taps=Taps((1, 2, 4)),
        layers=tuple(
            dataclasses.replace(layer, hidden_size=args.hidden_size, head_dim=16)
            for layer in spec.layers
        ),
    )
    drafter = make_drafter(spec)
    target = MlxTarget(model, spec.taps.layer_ids)
    runtime = BlockDrafter(drafter, target.shared_tensors())
    for prompt in ([1, 2, 3], [9], list(range(20, 37))):
        stats = Stats()
        got = generate_tokens(prompt, target, runtime, max_tokens=20, num_draft=3, stats=stats)
        expected = []
        for token, _ in generate_step(mx.array(prompt), model, max_tokens=20):
            expected.append(token)
        assert got == expected
        assert runtime.context_length == len(prompt) + sum(stats.accepted) + stats.rounds
