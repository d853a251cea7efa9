"""Speculative decoding with DFlash and DSpark block drafters on MLX: greedy output identical to
plain decoding, sampling distributed as the target's, the confidence policy, and the CLI."""

import dataclasses
import json

import mlx.core as mx
import numpy as np
import pytest
from helpers import generate_tokens
from mlx_lm.generate import generate_step
from mlx_targets import sampling_target, tiny_target
from stats_helpers import chi_square_exceeds, exact_marginals

from woodcock.formats import speculators
from woodcock.loading import load_drafter
from woodcock.runtime.block import BlockDrafter
from woodcock.runtime.decode import Stats
from woodcock.runtime.latency import LatencyProfile, write_profile
from woodcock.runtime.policy import ConfidencePolicy
from woodcock.runtime.sampling import Sampling
from woodcock.runtime.target import MlxTarget
from woodcock.synthetic import random_drafter, tiny_spec


def baseline(model, prompt, max_tokens):
    return [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens)]


def block_spec(
    model,
    algorithm,
    *,
    taps=(1, 2, 4),
    num_layers=1,
    attention="block_bidirectional",
    window=None,
    **fields,
):
    args = model.args
    spec = tiny_spec(
        algorithm,
        style="qwen3",
        num_layers=num_layers,
        hidden_size=args.hidden_size,
        vocab_size=args.vocab_size,
        target_layers=args.num_hidden_layers,
        taps=taps,
        **fields,
    )
    layers = tuple(
        dataclasses.replace(layer, attention=attention, sliding_window=window)
        for layer in spec.layers
    )
    return dataclasses.replace(spec, layers=layers)


VARIANTS = [
    ("dflash", {"block_size": 2}),
    ("dflash", {"block_size": 4, "num_layers": 2, "attention": "block_causal", "window": 6}),
    ("dflash", {"block_size": 8, "sample_from_anchor": True}),
    ("dspark", {"block_size": 4, "markov_head_type": "vanilla"}),
    ("dspark", {"block_size": 5, "markov_head_type": "gated", "sample_from_anchor": False}),
    ("dspark", {"block_size": 16, "markov_head_type": "rnn", "draft_vocab_size": 40}),
    ("dspark", {"block_size": 3, "markov_rank": 0, "confidence_head_with_markov": False}),
]


@pytest.mark.parametrize("model_type", ["qwen3", "llama"])
@pytest.mark.parametrize("algorithm, fields", VARIANTS, ids=lambda v: str(v))
def test_greedy_block_decoding_is_the_targets_own(model_type, algorithm, fields):
    model = tiny_target(model_type, scale=0.5)
    drafter = random_drafter(block_spec(model, algorithm, **fields), seed=2)
    target = MlxTarget(model, drafter.spec.taps.layer_ids)
    runtime = BlockDrafter(drafter, target.shared_tensors())
    for prompt in ([1, 2, 3], [9], list(range(30, 45))):
        expected = baseline(model, prompt, 30)
        for k in sorted({1, runtime.num_drafts}):
            assert generate_tokens(prompt, target, runtime, max_tokens=30, num_draft=k) == expected


def test_seed_shaped_dspark_through_the_speculators_format(tmp_path):
    """Block 16, 5 layers, 5 taps, vanilla Markov head, confidence head with Markov features,
    full vocabulary: written as speculators writes it, read back, generates exactly."""
    model = tiny_target("qwen3", scale=0.5, num_hidden_layers=6)
    spec = block_spec(
        model, "dspark", taps=(1, 2, 3, 4, 6), num_layers=5, block_size=16, markov_rank=8
    )
    speculators.write(random_drafter(spec, "BF16", seed=4), tmp_path / "dspark")
    drafter = load_drafter(tmp_path / "dspark")
    target = MlxTarget(model, drafter.spec.taps.layer_ids)
    runtime = BlockDrafter(drafter, target.shared_tensors())
    stats = Stats()
    for prompt in ([5, 6, 7], [11] * 6):
        assert generate_tokens(
            prompt, target, runtime, max_tokens=40, num_draft=16, stats=stats
        ) == baseline(model, prompt, 40)
    assert set(stats.drafted) == {16}


@pytest.mark.parametrize(
    "fields",
    [{"markov_head_type": "vanilla"}, {"markov_head_type": "rnn", "sample_from_anchor": False}],
)
def test_sampling_with_a_dspark_drafter_follows_the_target(fields):
    model = sampling_target()
    spec = block_spec(model, "dspark", taps=(1,), block_size=4, mask_token_id=11, **fields)
    drafter = random_drafter(spec, seed=9)
    # a drafter far from the target: make its logits loud
    weights = {
        k: (np.asarray(v) * (8.0 if k.startswith("markov_head") else 1.0)).astype(np.float32)
        for k, v in drafter.weights.items()
    }
    drafter = type(drafter)(drafter.spec, drafter.vocab, weights)
    target = MlxTarget(model, [1])
    runtime = BlockDrafter(drafter, target.shared_tensors())
    sampling = Sampling(temperature=1.0)
    prompt = [3, 1]
    first_p, second_p = exact_marginals(model, prompt, sampling, 2)
    first, second = np.zeros(12), np.zeros(12)
    for seed in range(1200):
        mx.random.seed(seed)
        tokens = generate_tokens(
            prompt, target, runtime, max_tokens=2, num_draft=3, sampling=sampling
        )
        first[tokens[0]] += 1
        second[tokens[1]] += 1
    assert not chi_square_exceeds(first, first_p)
    assert not chi_square_exceeds(second, second_p)


def synthetic_profile(path, verify_step=0.01, base=0.05):
    write_profile(
        path,
        {
            "machine": {},
            "draft_kind": "block",
            "verify_seconds": {"64": [base + verify_step * k for k in range(1, 17)]},
            "draft_seconds": {"full": [0.02]},
        },
    )
    return LatencyProfile.load(path)


def test_confidence_policy_verifies_a_confident_prefix_and_stays_exact(tmp_path):
    model = tiny_target("qwen3", scale=0.5)
    drafter = random_drafter(
        block_spec(model, "dspark", block_size=8, sample_from_anchor=True), seed=1
    )
    target = MlxTarget(model, drafter.spec.taps.layer_ids)
    runtime = BlockDrafter(drafter, target.shared_tensors())
    policy = ConfidencePolicy(synthetic_profile(tmp_path / "latency.json"), runtime.num_drafts)
    stats = Stats()
    for prompt in ([1, 2, 3], list(range(30, 45))):
        assert generate_tokens(
            prompt, target, runtime, max_tokens=30, policy=policy, stats=stats
        ) == baseline(model, prompt, 30)
    assert all(0 <= k <= 8 for k in stats.drafted)
    # cheap verification and confident drafts: verify everything; each extra row a third of
    # the first: verify one when it is likely right, none (a plain step) when it is not
    assert policy.profile.best_length([0.99] * 8, 64, verify_only=True) == 8
    costly = synthetic_profile(tmp_path / "costly.json", verify_step=0.5, base=1.0)
    assert costly.best_length([0.9, 0.3] + [0.3] * 6, 64, verify_only=True) == 1
    assert costly.best_length([0.3] * 8, 64, verify_only=True) == 0


@pytest.mark.parametrize("with_markov", [True, False])
def test_a_sampled_confidence_round_cuts_only_by_confidences_that_do_not_read_the_drafts(
    tmp_path, with_markov
):
    """A confidence head reading the Markov features computes slot j's confidence from draft
    j-1, so a cut by it would depend on the drafts drawn: sampling, such a drafter's rounds
    verify the whole block; a head reading the hidden states alone keeps its cut."""
    model = sampling_target()
    spec = block_spec(
        model,
        "dspark",
        taps=(1,),
        block_size=4,
        mask_token_id=11,
        markov_rank=4,
        confidence_head=True,
        confidence_head_with_markov=with_markov,
    )
    drafter = random_drafter(spec, seed=9)
    weights = dict(drafter.weights)  # confidences spread from near 0 to near 1
    weights["confidence_head.proj.weight"] = weights["confidence_head.proj.weight"] * 8
    drafter = dataclasses.replace(drafter, weights=weights)
    target = MlxTarget(model, [1])
    runtime = BlockDrafter(drafter, target.shared_tensors())
    assert runtime.confidence_reads_drafts == with_markov
    # a row more costs nearly what the first does, the rows after it next to nothing: the
    # whole block is verified where the confidences are high, else none of it
    write_profile(
        tmp_path / "latency.json",
        {
            "draft_kind": "block",
            "verify_seconds": {"64": [1.0, 1.88, 1.885] + [1.89 + 0.02 * k for k in range(13)]},
            "draft_seconds": {"full": [0.001]},
        },
    )
    profile = LatencyProfile.load(tmp_path / "latency.json")
    stats = Stats()
    for seed in range(40):
        mx.random.seed(seed)
        generate_tokens(
            [3, 1],
            target,
            runtime,
            max_tokens=8,
            stats=stats,
            sampling=Sampling(temperature=1.0),
            policy=ConfidencePolicy(profile, runtime.num_drafts),
        )
    if with_markov:
        assert set(stats.drafted) == {runtime.num_drafts}
    else:
        assert len(set(stats.drafted)) > 1


def test_prompt_lookup_between_block_rounds_stays_exact(tmp_path):
    from woodcock.runtime.ngram import PromptLookup

    model = tiny_target("llama", scale=0.5)
    for layer in model.layers:  # each position's logits from its own token: greedy loops
        layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
    drafter = random_drafter(
        block_spec(model, "dspark", block_size=4, sample_from_anchor=True), seed=2
    )
    target = MlxTarget(model, drafter.spec.taps.layer_ids)
    runtime = BlockDrafter(drafter, target.shared_tensors())
    policy = ConfidencePolicy(synthetic_profile(tmp_path / "latency.json"), runtime.num_drafts)
    for prompt in ([1, 2, 3], list(range(30, 45))):
        stats = Stats()
        assert generate_tokens(
            prompt, target, runtime, max_tokens=40, policy=policy, stats=stats, lookup=PromptLookup(96)
        ) == baseline(model, prompt, 40)
        assert any(stats.copied) and not all(stats.copied)
        assert max(k for k, c in zip(stats.drafted, stats.copied, strict=True) if c) <= 4  # at most a block
        assert max(stats.extended) <= 4  # copies after the drafts too


def test_generate_with_a_dspark_drafter_prints_slots_and_lengths(tmp_path, capsys):
    from woodcock.cli import main
    from woodcock.demo import write_tiny_target
    from woodcock.loading import save_drafter

    target_dir = write_tiny_target(tmp_path / "target")
    config = json.loads((target_dir / "config.json").read_text())
    spec = tiny_spec(
        "dspark",
        style="qwen3",
        hidden_size=64,
        vocab_size=config["vocab_size"],
        target_layers=4,
        block_size=6,
    )
    save_drafter(random_drafter(spec, seed=3), tmp_path / "dspark")
    synthetic_profile(tmp_path / "latency.json")
    for policy in ("fixed:4", f"confidence:{tmp_path / 'latency.json'}"):
        try:
            main(
                [
                    "generate",
                    "--target",
                    str(target_dir),
                    "--drafter",
                    str(tmp_path / "dspark"),
                    "--prompt",
                    "The quick",
                    "--max-tokens",
                    "24",
                    "--policy",
                    policy,
                    "--no-chat",
                ]
            )
        except SystemExit as e:
            assert not e.code
        out = capsys.readouterr().out
        assert (
            "acceptance by position:" in out
            and f"draft length ({policy})" in out
            and "per round" in out
        )
