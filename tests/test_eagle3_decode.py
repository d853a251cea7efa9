"""Greedy and sampled decoding with real EAGLE-3 drafters on MLX: random ones (rarely right)
and the hand-written bigram drafter of woodcock.demo (mostly right), against plain mlx-lm."""

import mlx.core as mx
import numpy as np
import pytest
from helpers import generate_tokens, plain_greedy
from mlx_lm import load
from mlx_targets import sampling_target, tiny_target

from woodcock.demo import bigram_drafter, write_tiny_target
from woodcock.runtime.decode import Stats
from woodcock.runtime.eagle3 import Eagle3Drafter
from woodcock.runtime.target import MlxTarget
from woodcock.synthetic import random_drafter, tiny_spec


def random_eagle3(model, *, style, num_layers, taps, draft_vocab=None, **algorithm):
    args = model.args
    spec = tiny_spec(
        "eagle3",
        style=style,
        num_layers=num_layers,
        hidden_size=args.hidden_size,
        vocab_size=args.vocab_size,
        target_layers=args.num_hidden_layers,
        taps=taps,
        draft_vocab_size=draft_vocab,
        tap_norm="per_tap",
        **algorithm,
    )
    return random_drafter(spec, seed=5)


@pytest.mark.parametrize("model_type", ["qwen3", "llama"])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_with_random_eagle3_drafters(model_type, k):
    model = tiny_target(model_type, scale=0.5)
    shared = None
    for variant, drafter in enumerate(
        [
            random_eagle3(model, style="llama", num_layers=1, taps=(0, 2, 4)),
            random_eagle3(
                model,
                style="qwen3",
                num_layers=2,
                taps=(1, 4),
                draft_vocab=40,
                norm_output=True,
                norm_before_residual=True,
            ),
        ]
    ):
        target = MlxTarget(model, drafter.spec.taps.layer_ids)
        shared = target.shared_tensors()
        runtime = Eagle3Drafter(drafter, shared)
        for prompt in ([1, 2, 3], [9], list(range(20, 37))):
            stats = Stats()
            got = generate_tokens(prompt, target, runtime, max_tokens=24, num_draft=k, stats=stats)
            assert got == plain_greedy(model, prompt, 24), (variant, prompt)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    path = write_tiny_target(tmp_path_factory.mktemp("demo") / "target")
    model, tokenizer = load(str(path))
    return path, model, tokenizer


def bigram_pair(demo):
    """The demo target and woodcock.demo's hand-written bigram drafter on it: (model, tokenizer,
    MlxTarget, Eagle3Drafter)."""
    path, model, tokenizer = demo
    drafter = bigram_drafter(path)
    target = MlxTarget(model, drafter.spec.taps.layer_ids)
    return model, tokenizer, target, Eagle3Drafter(drafter, target.shared_tensors())


@pytest.mark.parametrize("k", [1, 3, 5, 8])
def test_greedy_with_a_mostly_right_drafter(demo, k):
    model, tokenizer, target, runtime = bigram_pair(demo)
    total = Stats()
    for text in ["The quick brown", "def add", "Paris is the", "One, two", "Small models"]:
        prompt = tokenizer.encode(text)
        stats = Stats()
        expected = plain_greedy(model, prompt, 48)
        assert (
            generate_tokens(prompt, target, runtime, max_tokens=48, num_draft=k, stats=stats)
            == expected
        )
        total.drafted += stats.drafted
        total.accepted += stats.accepted
        # EOS and max tokens landing inside accepted runs
        for cut in (5, 11, 17):
            eos = expected[cut]
            if eos in expected[:cut]:
                continue
            got = generate_tokens(
                prompt, target, runtime, max_tokens=48, num_draft=k, eos_ids=[eos]
            )
            assert got == expected[:cut]
            assert (
                generate_tokens(prompt, target, runtime, max_tokens=cut, num_draft=k)
                == expected[:cut]
            )
    assert total.tokens_per_round > min(1 + 0.7 * k, 2.5)  # mostly right: long accepted runs
    assert sum(total.accepted) < sum(total.drafted)  # but not always


def test_truncated_head_keeps_the_output(demo):
    path, model, tokenizer = demo
    drafter = bigram_drafter(path)
    target = MlxTarget(model, drafter.spec.taps.layer_ids)
    prompt = tokenizer.encode("The quick brown")
    expected = plain_greedy(model, prompt, 40)
    for keep in (8, 64, 200):
        head = np.sort(
            np.random.default_rng(keep).choice(drafter.spec.draft_vocab_size, keep, replace=False)
        )
        runtime = Eagle3Drafter(drafter, target.shared_tensors(), head_ids=head)
        assert generate_tokens(prompt, target, runtime, max_tokens=40, num_draft=4) == expected


def test_a_fixed_length_round_waits_for_the_device_once(demo, monkeypatch):
    """Drafts no host decision reads are computed in the verify's evaluation: one wait a round
    (a GPU's launch and synchronisation cost is paid per wait)."""
    model, tokenizer, target, runtime = bigram_pair(demo)
    prompt = tokenizer.encode("The quick brown")
    expected = plain_greedy(model, prompt, 30)
    evaluations = []
    evaluate = mx.eval
    monkeypatch.setattr(mx, "eval", lambda *arrays: evaluations.append(1) or evaluate(*arrays))
    stats = Stats()
    got = generate_tokens(prompt, target, runtime, max_tokens=30, num_draft=3, stats=stats)
    assert got == expected
    rounds = len(stats.drafted)
    assert rounds > 5 and len(evaluations) == rounds + 2  # + the prompt's chunk and first token


def test_a_batched_round_reads_every_sequences_draft_scores_in_one_wait(demo, monkeypatch):
    """A policy that cuts drafts by their scores reads them on the host: the drafters that
    draft together are read in one evaluation, then the verify in another, whatever the batch."""
    from woodcock.runtime.batch import SequenceBatch
    from woodcock.runtime.decode import SpeculativeSequence, batched_round
    from woodcock.runtime.policy import FixedPolicy
    from woodcock.serve.batching import own_state

    class CutUnlikely(FixedPolicy):
        needs_scores = True

        def verify_length(self, context, draft_probs, confidence):
            return int(np.cumprod(draft_probs > 0.3).sum())  # up to the first unlikely draft

    model, tokenizer, target, runtime = bigram_pair(demo)
    prompts = [tokenizer.encode(text) for text in ["The quick brown", "def add", "Paris is the"]]
    batch, sequences, tokens = SequenceBatch(target, 3), [], []
    for prompt in prompts:
        sequence = SpeculativeSequence(prompt, target, own_state(runtime), policy=CutUnlikely(4))
        tokens.append([step[0] for step in sequence.start()])
        sequence.rows = batch.add(target.cache)
        sequences.append(sequence)
    evaluations = []
    evaluate = mx.eval
    monkeypatch.setattr(mx, "eval", lambda *arrays: evaluations.append(1) or evaluate(*arrays))
    for _ in range(6):
        for mine, steps in zip(tokens, batched_round(batch, sequences), strict=True):
            mine += [step[0] for step in steps]
    assert len(evaluations) == 2 * 6
    cut = [sum(s.stats.drafted) < 4 * len(s.stats.drafted) for s in sequences]
    assert any(cut)  # the policy did cut drafts
    for prompt, mine in zip(prompts, tokens, strict=True):
        assert mine == plain_greedy(model, prompt, len(mine))


def test_auto_policy_decodes_plainly_where_no_draft_length_pays(demo, tmp_path):
    from woodcock.runtime.latency import LatencyProfile, write_profile
    from woodcock.runtime.policy import AutoPolicy

    model, tokenizer, target, runtime = bigram_pair(demo)
    prompt = tokenizer.encode("The quick brown")
    expected = plain_greedy(model, prompt, 30)

    def profile(first_row, next_row):
        verify = [first_row + next_row * (k - 1) for k in range(1, 17)]
        draft = [0.001 * k for k in range(1, 8)]
        file = tmp_path / f"{first_row}-{next_row}.json"
        write_profile(
            file,
            {
                "draft_kind": "chain",
                "verify_seconds": {"64": verify},
                "draft_seconds": {"full": draft},
            },
        )
        return LatencyProfile.load(file)

    # every verified row costs what the first does (the reference BLAS): no draft pays
    for profile_, plain in ((profile(0.02, 0.02), True), (profile(0.02, 0.001), False)):
        policy = AutoPolicy(profile_, max_length=7, prior=[0.6] * 7)
        stats = Stats()
        assert (
            generate_tokens(prompt, target, runtime, max_tokens=30, policy=policy, stats=stats)
            == expected
        )
        assert (set(stats.drafted) == {0}) == plain
        assert plain or sum(stats.accepted) > 0


def test_sampling_with_a_real_eagle3_drafter_follows_the_target():
    from stats_helpers import chi_square_exceeds, exact_marginals

    from woodcock.runtime.sampling import Sampling

    model = sampling_target("llama", num_hidden_layers=2, scale=0.25)
    drafter = random_eagle3(
        model, style="qwen3", num_layers=1, taps=(1, 2), draft_vocab=7, norm_output=True
    )
    target = MlxTarget(model, drafter.spec.taps.layer_ids)
    runtime = Eagle3Drafter(drafter, target.shared_tensors())
    sampling = Sampling(temperature=0.9, top_k=6)
    prompt = [5, 2, 7]
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


def test_sampling_in_a_batch_whose_drafters_draft_together_follows_the_target(demo, monkeypatch):
    from stats_helpers import chi_square_exceeds, exact_marginals

    from woodcock.runtime import eagle3
    from woodcock.runtime.batch import SequenceBatch
    from woodcock.runtime.decode import SpeculativeSequence, batched_round
    from woodcock.runtime.policy import FixedPolicy
    from woodcock.runtime.sampling import Sampling
    from woodcock.serve.batching import own_state

    # a mostly right drafter: most drafts are accepted, so a draft drawn from anything but the
    # distribution judged against (e.g. greedy drafts) moves the second token's distribution
    model, tokenizer, target, runtime = bigram_pair(demo)
    sampling = Sampling(temperature=1.0)
    prompt = tokenizer.encode("The quick brown")
    first_p, second_p = exact_marginals(model, prompt, sampling, 2)
    together = []
    original = eagle3.propose_together
    monkeypatch.setattr(
        eagle3, "propose_together", lambda *args: together.append(1) or original(*args)
    )
    first, second = np.zeros_like(first_p), np.zeros_like(second_p)
    accepted = 0
    for seed in range(400):
        mx.random.seed(seed)
        batch, sequences = SequenceBatch(target, 3), []
        for _ in range(3):  # three requests of the same prompt: three draws a run
            sequence = SpeculativeSequence(
                prompt, target, own_state(runtime), policy=FixedPolicy(3), sampling=sampling
            )
            first[sequence.start()[0][0]] += 1
            sequence.rows = batch.add(target.cache)
            sequences.append(sequence)
        for sequence, steps in zip(sequences, batched_round(batch, sequences), strict=True):
            second[steps[0][0]] += 1
            accepted += sequence.stats.accepted[-1]
    assert len(together) == 400 and accepted > 2 * 1200
    assert not chi_square_exceeds(first, first_p)
    assert not chi_square_exceeds(second, second_p)


def test_auto_policy_copies_as_far_as_the_profile_says_it_pays(tmp_path):
    from woodcock.runtime.latency import LatencyProfile, write_profile
    from woodcock.runtime.policy import AutoPolicy

    def policy(first_row, next_row):
        verify = [first_row + next_row * (k - 1) for k in range(1, 17)]
        file = tmp_path / f"{first_row}-{next_row}.json"
        write_profile(
            file,
            {
                "draft_kind": "chain",
                "verify_seconds": {"64": verify},
                "draft_seconds": {"full": [0.01] * 7},
            },
        )
        return AutoPolicy(LatencyProfile.load(file), max_length=7, prior=[0.6] * 7)

    assert policy(0.02, 0.02).copy_length(64, 6) == 0  # every row costs a plain step: no copy pays
    assert policy(0.02, 0.001).copy_length(64, 6) == 6
    cheap = policy(0.02, 0.005)  # a row costs a quarter of a step: 3 of 6 at the prior's 0.8
    assert cheap.copy_length(64, 6) == 3 and cheap.copy_length(64, 2) == 2
    drafts_before = cheap.acceptance()
    for _ in range(20):  # copies of six keep failing at their first token
        if verified := cheap.copy_length(64, 6):  # as the loop asks, then reports
            cheap.observe_copy(verified, 0)
    assert cheap.copy_length(64, 6) == 0
    assert cheap.copy_length(64, 5) == 3  # proposals of another length are estimated apart
    assert cheap.acceptance() == drafts_before  # what copies do says nothing about the drafter
    cheap.observe(3, 3)
    assert cheap.acceptance()[0] > drafts_before[0]
    # past the 16 measured rows the cost runs on at the row's slope; copies that keep being
    # accepted whole are verified further each round, up to whole
    looping = policy(0.02, 0.001)
    assert looping.profile.verify_cost(32, 64) == pytest.approx(0.02 + 0.001 * 31)
    assert looping.copy_length(64, 31) < 31  # at the prior's 0.8 a token
    for _ in range(100):
        looping.observe_copy(looping.copy_length(64, 31), looping.copy_length(64, 31))
    assert looping.copy_length(64, 31) == 31


def test_auto_policy_extends_drafts_as_far_as_the_profile_says_it_pays(tmp_path):
    from woodcock.runtime.latency import LatencyProfile, write_profile
    from woodcock.runtime.policy import AutoPolicy

    def policy(next_row, prior):
        verify = [0.02 + next_row * (k - 1) for k in range(1, 17)]
        file = tmp_path / f"{next_row}-{prior}.json"
        write_profile(
            file,
            {
                "draft_kind": "chain",
                "verify_seconds": {"64": verify},
                "draft_seconds": {"full": [0.001 * k for k in range(1, 8)]},
            },
        )
        return AutoPolicy(LatencyProfile.load(file), max_length=7, prior=[prior] * 7)

    assert policy(0.0001, 0.6).extension_length(64, 2, 8) == 8  # rows are nearly free
    assert policy(0.02, 0.95).extension_length(64, 2, 8) == 0  # a row costs a plain step
    # the copy counts only once both drafts are accepted: after unlikely drafts it is not worth
    # rows of a twentieth of a step, after likely ones most of it is
    assert policy(0.001, 0.2).extension_length(64, 2, 8) == 0
    assert (
        0
        < policy(0.001, 0.6).extension_length(64, 2, 8)
        < policy(0.001, 0.95).extension_length(64, 2, 8)
        < 8
    )
    failing = policy(0.001, 0.6)
    for _ in range(30):  # extensions of four keep failing at their first token
        if verified := failing.extension_length(64, 2, 4):
            failing.observe_extension(verified, 0)
    assert failing.extension_length(64, 2, 4) == 0
    # one estimate for copies of a length, in a round of their own or after drafts
    assert failing.copy_length(64, 4) < policy(0.001, 0.6).copy_length(64, 4)
    assert failing.extension_length(64, 2, 6) == policy(0.001, 0.6).extension_length(64, 2, 6) > 0


def test_auto_policy_tries_a_drafter_whose_prior_is_below_break_even(tmp_path):
    from woodcock.runtime.latency import LatencyProfile, write_profile
    from woodcock.runtime.policy import AutoPolicy

    file = tmp_path / "profile.json"
    # one draft pays when more than 0.55 of first drafts are accepted
    verify = [0.02 + 0.01 * (k - 1) for k in range(1, 17)]
    profile = {"verify_seconds": {"64": verify}, "draft_seconds": {"full": [0.001] * 7}}
    write_profile(file, {"draft_kind": "chain", **profile})

    def drafting_rounds(accepted_share: float) -> list[int]:
        policy = AutoPolicy(LatencyProfile.load(file), max_length=7, prior=[0.45] * 7)
        assert policy.profile.best_length(policy.acceptance(), 64) == 0  # the mean never drafts
        rounds = []
        for _ in range(300):
            if length := policy.draft_length(64):
                verified = policy.verify_length(64, np.ones(length), None)
                policy.observe(verified, verified if accepted_share == 1 else 0)
            rounds.append(length)
        return rounds

    good, bad = drafting_rounds(1.0), drafting_rounds(0.0)
    assert sum(k > 0 for k in good[-100:]) >= 95 and max(good) > 1  # found it pays, and longer
    assert 0 < sum(k > 0 for k in bad) <= 10  # tried, and soon left alone
    assert drafting_rounds(1.0) == good  # the draws are seeded: the same rounds again


def test_auto_policy_takes_a_prior_of_one_or_zero(tmp_path):
    from woodcock.runtime.latency import LatencyProfile, write_profile
    from woodcock.runtime.policy import AutoPolicy

    file = tmp_path / "profile.json"
    verify = [0.02 + 0.01 * (k - 1) for k in range(1, 17)]
    profile = {"verify_seconds": {"64": verify}, "draft_seconds": {"full": [0.001] * 7}}
    write_profile(file, {"draft_kind": "chain", **profile})
    # a drafter trained to a perfect hold-out on a tiny target records exactly 1.0
    policy = AutoPolicy(LatencyProfile.load(file), max_length=3, prior=[1.0, 0.0, 1.0])
    for _ in range(20):
        length = policy.draft_length(64)
        assert 0 <= length <= 3
        policy.observe(length, length)
    assert all(0 < rate < 1 for rate in policy.acceptance())
