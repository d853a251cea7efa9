"""The speculative loop against plain mlx-lm decoding, with drafters whose behaviour the test
controls: a scripted one (exact acceptance patterns, EOS and max-tokens inside accepted runs)
and a random Markov one whose distribution q is far from the target's p (sampling exactness)."""

import itertools

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from helpers import generate_tokens
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler
from mlx_targets import sampling_target, tiny_target
from stats_helpers import chi_square_exceeds, exact_marginals

from woodcock.errors import DrafterError
from woodcock.runtime.decode import Stats, speculative_generate_step
from woodcock.runtime.ngram import MAX_COPY, PromptLookup
from woodcock.runtime.policy import FixedPolicy
from woodcock.runtime.sampling import Sampling
from woodcock.runtime.target import MlxTarget

PROMPTS = [[1, 2, 3], [7], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [5, 9, 5, 9, 5]]


class ScriptedDrafter:
    """Proposes the continuation of `script` (the target's own greedy output after the prompt),
    wrong wherever `wrong(position)` says; positions count generated tokens."""

    def __init__(self, script, vocab, wrong=lambda position: False):
        self.script, self.vocab, self.wrong = script, vocab, wrong
        self.head_target_ids = mx.arange(vocab)
        self.taps_seen = []

    def reset(self):
        self.rows = 0

    def add_context(self, tokens, taps):
        assert tokens.shape[0] == taps.shape[0]
        self.taps_seen.append(taps.shape)
        self.rows += tokens.shape[0]

    def propose(self, k, sampler):
        tokens = []
        for j in range(k):
            position = self.rows - self.prompt_rows + j + 2  # generated so far: rows - P + 1
            token = self.script[position] if position < len(self.script) else 0
            tokens.append((token + 1) % self.vocab if self.wrong(position) else token)
        logits = mx.zeros((k, self.vocab))
        return mx.array(tokens, mx.int32), logits

    def start(self, prompt):
        self.prompt_rows = len(prompt)  # rows after the first add_context: x_1..x_P + anchor
        return self


class MarkovDrafter:
    """q(next | previous draft token) from a fixed random table: a drafter that disagrees with
    the target a lot, sampled exactly as the loop asks."""

    num_drafts = None
    last_confidence = None
    confidence_reads_drafts = False

    def __init__(self, vocab, seed=0, scale=3.0, head_ids=None):
        rng = np.random.default_rng(seed)
        self.head_ids = np.arange(vocab) if head_ids is None else np.asarray(head_ids)
        self.head_target_ids = mx.array(self.head_ids, mx.int32)
        self.table = mx.array(rng.standard_normal((vocab, len(self.head_ids))) * scale, mx.float32)

    def reset(self):
        self.last = None

    def add_context(self, tokens, taps):
        self.last = tokens[-1]

    def propose(self, k, sampler):
        tokens, logits, last = [], [], self.last
        for _ in range(k):
            row = self.table[last]
            last = self.head_target_ids[sampler(row)]
            tokens.append(last)
            logits.append(row)
        return mx.stack(tokens).astype(mx.int32), mx.stack(logits)


def baseline(model, prompt, max_tokens, eos=(), sampler=None):
    out = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens, sampler=sampler):
        if token in eos:
            break
        out.append(token)
    return out


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def model(request):
    return tiny_target(request.param, scale=0.5)


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
@pytest.mark.parametrize(
    "pattern",
    [lambda p: False, lambda p: p % 3 == 0, lambda p: p % 4 == 1, lambda p: True],
    ids=["all-right", "every-third-wrong", "first-of-four-wrong", "all-wrong"],
)
def test_greedy_output_is_the_targets_own(model, k, pattern):
    target = MlxTarget(model, [0, 2, 4])
    for prompt in PROMPTS:
        expected = baseline(model, prompt, 40)
        drafter = ScriptedDrafter([None] + expected, 96, pattern).start(prompt)
        stats = Stats()
        got = generate_tokens(prompt, target, drafter, max_tokens=40, num_draft=k, stats=stats)
        assert got == expected
        if pattern(1) is False and pattern(2) is False and pattern(3) is False:
            assert stats.accepted[0] == k  # a right script is accepted whole
        if pattern(0) and pattern(1) and pattern(2):
            assert sum(stats.accepted) == 0


def bf16_tie_target():
    """A bf16 target with flat logits (about 1 at most over 96 tokens): bf16 rounds the
    log-probabilities of its top tokens to one value at some positions, where mlx-lm's greedy
    choice is the lowest id of the tie rather than the logits' argmax."""
    model = tiny_target("llama", scale=0.05)
    model.set_dtype(mx.bfloat16)
    return model


def tied_positions(model, prompt, max_tokens):
    """Plain decoding's tokens, and how many of them are not the argmax of their logits."""
    kept = []

    def keep(_, logits):
        kept.append(logits)
        return logits

    tokens = [
        token
        for token, _ in generate_step(
            mx.array(prompt), model, max_tokens=max_tokens, logits_processors=[keep]
        )
    ]
    # generate_step computes one step ahead: the last logits kept are past the last token
    return tokens, sum(mx.argmax(x).item() != t for x, t in zip(kept, tokens, strict=False))


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_output_is_mlx_lm_s_where_bf16_rounding_ties_tokens(k):
    model = bf16_tie_target()
    target = MlxTarget(model, [0, 2, 4])
    ties = 0
    for prompt in PROMPTS:
        expected, tied = tied_positions(model, prompt, 40)
        ties += tied
        drafter = ScriptedDrafter([None] + expected, 96, lambda p: p % 3 == 0).start(prompt)
        assert generate_tokens(prompt, target, drafter, max_tokens=40, num_draft=k) == expected
    assert ties >= 2  # the ties this test is about happened


class CyclingPolicy:
    """Draft lengths from a fixed cycle; 0 is a plain decoding step."""

    needs_scores = False

    def __init__(self, lengths):
        self.lengths = itertools.cycle(lengths)

    def draft_length(self, context):
        return next(self.lengths)

    def observe(self, verified, accepted):
        pass

    def copy_length(self, context, proposed):
        return proposed

    def observe_copy(self, verified, accepted):
        pass

    def extension_length(self, context, drafted, proposed):
        return proposed

    def observe_extension(self, verified, accepted):
        pass


def test_plain_decoding_rounds_mixed_with_drafting_rounds(model):
    target = MlxTarget(model, [0, 2, 4])
    for prompt in PROMPTS:
        expected = baseline(model, prompt, 30)
        drafter = ScriptedDrafter([None] + expected, 96, lambda p: p % 5 == 0).start(prompt)
        stats = Stats()
        policy = CyclingPolicy([0, 3, 0, 0, 2])
        got = generate_tokens(prompt, target, drafter, max_tokens=30, policy=policy, stats=stats)
        assert got == expected
        assert stats.drafted[:5] == [0, 3, 0, 0, 2] and stats.accepted[0] == 0
        # a plain decoding round still hands the drafter its row (anchor + one per token)
        rows = sum(shape[0] for shape in drafter.taps_seen)
        assert rows == len(prompt) + stats.rounds + sum(stats.accepted)


class RecordingPolicy(CyclingPolicy):
    """Copies at most `most_copied` tokens in a round of their own and `most_extended` after
    drafts; records what it is told."""

    def __init__(self, lengths, most_copied, most_extended=MAX_COPY):
        super().__init__(lengths)
        self.most_copied, self.most_extended = most_copied, most_extended
        self.observed, self.observed_copies, self.observed_extensions = [], [], []

    def observe(self, verified, accepted):
        self.observed.append((verified, accepted))

    def copy_length(self, context, proposed):
        return min(proposed, self.most_copied)

    def observe_copy(self, verified, accepted):
        self.observed_copies.append((verified, accepted))

    def extension_length(self, context, drafted, proposed):
        return min(proposed, self.most_extended)

    def observe_extension(self, verified, accepted):
        self.observed_extensions.append((verified, accepted))


def with_lookup(prompt, target, drafter, policy):
    """(40 tokens, stats) generated with prompt lookup."""
    stats = Stats()
    tokens = generate_tokens(
        prompt, target, drafter, max_tokens=40, policy=policy, stats=stats, lookup=PromptLookup(96)
    )
    return tokens, stats


def looping(model):
    """Every attention output projection zeroed: each position's logits depend on its own token
    only, so greedy decoding falls into a short loop that prompt lookup can copy."""
    for layer in model.layers:
        layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("architecture", ["qwen3", "llama"])
def test_prompt_lookup_rounds_between_drafter_rounds(architecture):
    model = looping(tiny_target(architecture, scale=0.5))
    target = MlxTarget(model, [0, 2, 4])
    for prompt in PROMPTS:
        expected = baseline(model, prompt, 40)
        drafter = MarkovDrafter(96, seed=3, head_ids=np.arange(0, 96, 3))
        policy = RecordingPolicy([2, 0, 3], most_copied=5)
        got, stats = with_lookup(prompt, target, drafter, policy)
        assert got == expected
        assert any(stats.copied) and not all(stats.copied), stats.copied
        copied = [(k, m) for k, m, c in zip(stats.drafted, stats.accepted, stats.copied, strict=True) if c]
        assert sum(m for _, m in copied) > len(copied)  # the loop is copied, not guessed
        # the policy learns from drafts and copies apart, and caps the copies
        rounds = zip(stats.drafted, stats.accepted, stats.copied, stats.extended, strict=True)
        drafted = [(k - e, min(m, k - e)) for k, m, c, e in rounds if not c]
        assert policy.observed == drafted and policy.observed_copies == copied
        assert max(k for k, _ in copied) == 5
        assert len(stats.acceptance_by_position()) <= 3
        assert stats.copied_tokens_per_round == np.mean([m + 1 for _, m in copied])


@pytest.mark.parametrize("architecture", ["qwen3", "llama"])
def test_drafts_that_close_a_repeat_are_extended_by_a_copy(architecture):
    model = looping(tiny_target(architecture, scale=0.5))
    target = MlxTarget(model, [0, 2, 4])
    extended_somewhere = False
    for prompt in PROMPTS:
        expected = baseline(model, prompt, 40)
        drafter = ScriptedDrafter([None] + expected, 96, lambda p: p % 7 == 3).start(prompt)
        policy = RecordingPolicy([2, 3, 0], most_copied=0, most_extended=6)
        got, stats = with_lookup(prompt, target, drafter, policy)
        assert got == expected
        assert not any(stats.copied)
        rounds = list(zip(stats.drafted, stats.accepted, stats.extended, strict=True))
        # the drafter's part is what the policy drafted; the policy hears of it apart from the
        # copies, which it hears of only when every draft was accepted
        assert [(k - e, min(m, k - e)) for k, m, e in rounds] == policy.observed
        tried = [(e, m - (k - e)) for k, m, e in rounds if e and m >= k - e]
        assert policy.observed_extensions == tried
        assert all(e <= 6 for _, _, e in rounds)
        extended_somewhere |= any(e and m > k - e for k, m, e in rounds)  # copies accepted
    assert extended_somewhere


def test_eos_and_max_tokens_inside_an_accepted_run(model):
    target = MlxTarget(model, [1, 3])
    prompt = PROMPTS[0]
    expected = baseline(model, prompt, 30)
    drafter = ScriptedDrafter([None] + expected, 96).start(prompt)
    # with k = 5, tokens 7..11 are the second round's accepted drafts: an EOS among them
    eos_at = next(i for i in range(7, 12) if expected[i] not in expected[:i])
    eos = expected[eos_at]
    stats = Stats()
    got = generate_tokens(
        prompt, target, drafter, max_tokens=30, num_draft=5, eos_ids=[eos], stats=stats
    )
    assert got == baseline(model, prompt, 30, eos=[eos]) == expected[: expected.index(eos)]
    assert stats.accepted[:2] == [5, 5]
    for limit in (1, 4, 7, 12):
        drafter = ScriptedDrafter([None] + expected, 96).start(prompt)
        assert (
            generate_tokens(prompt, target, drafter, max_tokens=limit, num_draft=5)
            == expected[:limit]
        )


def test_drafter_context_is_the_verified_rows(model):
    target = MlxTarget(model, [0, 2, 4])
    prompt = PROMPTS[2]
    expected = baseline(model, prompt, 12)
    drafter = ScriptedDrafter([None] + expected, 96, lambda p: p % 4 == 2).start(prompt)
    stats = Stats()
    generate_tokens(prompt, target, drafter, max_tokens=12, num_draft=4, stats=stats)
    # prefill: one row per prompt token; then one row per accepted draft plus the new anchor
    assert drafter.taps_seen[0] == (len(prompt), 3 * 64)
    assert [shape[0] for shape in drafter.taps_seen[1:]] == [m + 1 for m in stats.accepted][
        : len(drafter.taps_seen) - 1
    ]
    assert target.offset == len(prompt) + sum(m + 1 for m in stats.accepted)


@pytest.mark.parametrize("architecture", ["qwen3", "llama"])
def test_a_prefill_computes_the_head_for_the_last_position_alone(architecture):
    model = tiny_target(architecture)
    target = MlxTarget(model, [0, 2, 4])
    tokens = mx.array(PROMPTS[2])
    logits, taps = target.forward(tokens)
    target.reset()
    if hasattr(model, "lm_head"):  # llama here: a head of its own
        owner, name = model, "lm_head"
    else:  # qwen3 here: the embedding, tied
        owner, name = model.model.embed_tokens, "as_linear"
    head, heads = getattr(owner, name), []
    setattr(owner, name, lambda x: heads.append(x.shape) or head(x))
    last, prefill_taps = target.prefill(tokens)
    mx.eval(last, prefill_taps)
    assert heads == [(1, 1, 64)]  # one position went through the head
    assert mx.array_equal(last, logits[-1]) and mx.array_equal(prefill_taps, taps)
    assert target.offset == len(PROMPTS[2]) and isinstance(model.model.norm, nn.RMSNorm)


def test_greedy_with_a_random_drafter_and_a_reduced_head(model):
    target = MlxTarget(model, [4])
    for prompt in PROMPTS:
        drafter = MarkovDrafter(96, seed=3, head_ids=np.arange(0, 96, 3))
        assert generate_tokens(prompt, target, drafter, max_tokens=25, num_draft=3) == baseline(
            model, prompt, 25
        )


def test_untrimmable_targets_and_bad_taps_are_refused(model):
    with pytest.raises(DrafterError, match=r"tap ids \[2, 9\] must be ascending ids in \[0, 4\]"):
        MlxTarget(model, [2, 9])
    original = model.make_cache if hasattr(model, "make_cache") else None
    from mlx_lm.models.cache import ArraysCache

    model.make_cache = lambda: [ArraysCache(1) for _ in model.layers]
    try:
        with pytest.raises(DrafterError, match=r"KV cache \(ArraysCache\) cannot be rolled back"):
            MlxTarget(model, [1])
    finally:
        if original is None:
            del model.make_cache
        else:
            model.make_cache = original


# ------------------------------------------------------------------------------------------
# Sampling: the emitted tokens are distributed as the target's own samples


SAMPLINGS = [
    Sampling(temperature=1.0),
    Sampling(temperature=0.6),
    Sampling(temperature=1.3, top_p=0.8),
    Sampling(temperature=1.0, top_k=4),
]


@pytest.mark.parametrize(
    "sampling", SAMPLINGS, ids=lambda s: f"t{s.temperature}-p{s.top_p}-k{s.top_k}"
)
def test_sampling_reproduces_the_target_distribution(sampling):
    model = sampling_target()
    target = MlxTarget(model, [1])
    prompt = [3, 1]
    first_p, second_p = exact_marginals(model, prompt, sampling, 2)
    runs = 1500
    first, second = np.zeros(12), np.zeros(12)
    for seed in range(runs):
        mx.random.seed(seed)
        drafter = MarkovDrafter(12, seed=11, head_ids=[0, 2, 3, 5, 7, 8, 11])
        tokens = generate_tokens(
            prompt, target, drafter, max_tokens=2, num_draft=3, sampling=sampling
        )
        first[tokens[0]] += 1
        second[tokens[1]] += 1
    assert not chi_square_exceeds(first, first_p)
    assert not chi_square_exceeds(second, second_p)
    # the same test catches sampling from the drafter instead of the target
    drafter_q = np.array(sampling.probabilities(MarkovDrafter(12, seed=11).table[prompt[-1]]))
    assert chi_square_exceeds(first, drafter_q) or np.allclose(drafter_q, first_p, atol=0.05)


def test_sampled_rounds_of_auto_verify_every_draft_and_follow_the_target(tmp_path):
    """auto cuts the drafts by the drafter's probability of each, which a sampled round must not:
    verifying a draft only where the drafter found it likely skews the output towards the
    drafter (the acceptance rule is exact only where whether a draft is verified is settled
    before it is drawn). Here a draft is kept by the cut only where the drafter gives it more
    than about 0.25, which moves the second token's distribution by 0.05 in total variation."""
    from woodcock.runtime.latency import LatencyProfile, write_profile
    from woodcock.runtime.policy import AutoPolicy

    write_profile(
        tmp_path / "latency.json",
        {
            "draft_kind": "chain",
            "verify_seconds": {"64": [1.0 + 0.5 * k for k in range(16)]},
            "draft_seconds": {"full": [0.001 * k for k in range(1, 8)]},
        },
    )
    profile = LatencyProfile.load(tmp_path / "latency.json")
    model = sampling_target()
    target = MlxTarget(model, [1])
    sampling = Sampling(temperature=1.0)
    prompt = [4, 7, 4, 7]
    _, second_p = exact_marginals(model, prompt, sampling, 2)
    second, drafted = np.zeros(12), []
    for seed in range(1500):
        mx.random.seed(seed)
        policy = AutoPolicy(profile, max_length=1, prior=[0.99], strength=1e6)
        stats = Stats()
        tokens = generate_tokens(
            prompt,
            target,
            MarkovDrafter(12, seed=11),
            max_tokens=2,
            policy=policy,
            sampling=sampling,
            stats=stats,
        )
        second[tokens[1]] += 1
        drafted += stats.drafted
    assert set(drafted) == {1}  # every round drafted one token and verified it
    assert not chi_square_exceeds(second, second_p)


def test_a_sampled_plain_decoding_round_follows_the_target():
    model = sampling_target()
    target = MlxTarget(model, [1])
    sampling = Sampling(temperature=1.0)
    _, second_p = exact_marginals(model, [3, 1], sampling, 2)
    second = np.zeros(12)
    for seed in range(1500):
        mx.random.seed(seed)
        drafter = MarkovDrafter(12, seed=11)
        tokens = generate_tokens(
            [3, 1], target, drafter, max_tokens=2, policy=CyclingPolicy([0]), sampling=sampling
        )
        second[tokens[1]] += 1
    assert not chi_square_exceeds(second, second_p)


def sampled_with_lookup(prompt, target, drafter, max_tokens, num_draft, sampling):
    """(tokens, stats) of 1500 sampled runs with prompt lookup, seeds 0..1499."""
    for seed in range(1500):
        mx.random.seed(seed)
        stats = Stats()
        tokens = generate_tokens(
            prompt,
            target,
            drafter,
            max_tokens=max_tokens,
            num_draft=num_draft,
            sampling=sampling,
            stats=stats,
            lookup=PromptLookup(12),
        )
        yield tokens, stats


def test_sampled_rounds_that_copy_follow_the_target():
    """The second token comes from a round that copies whenever the first one closes a repeat
    (about half of the runs here); its marginal is still the target's."""
    model = sampling_target()
    target = MlxTarget(model, [1])
    sampling = Sampling(temperature=1.0)
    # the lookup sees [b, y, b, first] and copies when first = y: pick the prompt where that
    # is nearest to even odds
    prompt = min(
        ([0, b, y, b] for b in range(12) for y in range(12) if y != b),
        key=lambda p: abs(exact_marginals(model, p, sampling, 1)[0][p[2]] - 0.5),
    )
    _, second_p = exact_marginals(model, prompt, sampling, 2)
    second, copied = np.zeros(12), 0
    drafter = MarkovDrafter(12, seed=11, head_ids=[0, 2, 3, 5, 7, 8, 11])
    for tokens, stats in sampled_with_lookup(prompt, target, drafter, 2, 3, sampling):
        second[tokens[1]] += 1
        copied += stats.copied[0]
    assert 300 < copied < 1200, copied
    assert not chi_square_exceeds(second, second_p)


def test_sampled_drafts_extended_by_a_copy_follow_the_target():
    """Round one drafts one token from the Markov drafter; when it closes a repeat of the
    prompt the lookup copies on after it. Tokens two and three (the draft's and the copy's rows)
    keep the target's marginals. The prompt is the one where the rejection rule has most to
    reject in the copy's row among those extending in 30..70 % of the runs."""
    model = sampling_target()
    target = MlxTarget(model, [1])
    sampling = Sampling(temperature=1.0)

    def drafter(b, c):
        return MarkovDrafter(12, seed=11, head_ids=sorted({b, c}))

    def next_token(sequences):
        """{sequence: the target's next-token probabilities}, in one forward (equal lengths)"""
        probs = np.array(sampling.probabilities(model(mx.array(sequences))[:, -1]))
        return dict(zip(map(tuple, sequences), probs, strict=True))

    def cases(a, b, c):
        """(token, draft, copy): with the history [a, b, c, token] the draft extends when
        (token, draft) is (a, b) or (b, c), and then the copy is tried"""
        return (a, b, c), (b, c, a)

    triples = list(itertools.permutations(range(12), 3))
    p = next_token([[0, *t] for t in triples])
    p |= next_token([[0, *t, token] for t in triples for token, _, _ in cases(*t)])
    p |= next_token([[0, *t, token, d] for t in triples for token, d, _ in cases(*t)])

    def odds(a, b, c):
        """(P(extended), P(the copied token is tried and must be rejected))"""
        prompt = (0, a, b, c)
        first, q, extended, rejected = p[prompt], drafter(b, c), 0.0, 0.0
        for token, draft, copy in cases(a, b, c):
            q_draft = np.array(sampling.probabilities(q.table[token]))[list(q.head_ids).index(draft)]
            p_draft = p[(*prompt, token)][draft]
            extended += first[token] * q_draft
            tried = first[token] * min(q_draft, p_draft)
            rejected += tried * (1 - p[(*prompt, token, draft)][copy])
        return extended, rejected

    chances = {t: odds(*t) for t in triples}
    a, b, c = max(
        (t for t, (extended, _) in chances.items() if 0.3 < extended < 0.7),
        key=lambda t: chances[t][1],
    )
    prompt = [0, a, b, c]
    _, second_p, third_p = exact_marginals(model, prompt, sampling, 3)
    second, third, extended = np.zeros(12), np.zeros(12), 0
    for tokens, stats in sampled_with_lookup(prompt, target, drafter(b, c), 3, 1, sampling):
        second[tokens[1]] += 1
        third[tokens[2]] += 1
        extended += stats.extended[0] > 0
        assert not stats.copied[0]
    assert 300 < extended < 1200, extended
    assert not chi_square_exceeds(second, second_p)
    assert not chi_square_exceeds(third, third_p)


def test_mlx_lm_samples_the_distribution_we_compute():
    """Our p is mlx-lm's sampler's: its own samples pass the same test."""
    model = sampling_target()
    prompt = [3, 1]
    for sampling in SAMPLINGS:
        (first_p,) = exact_marginals(model, prompt, sampling, 1)
        sampler = make_sampler(
            temp=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k
        )
        mx.random.seed(0)
        counts = np.zeros(12)
        logits = model(mx.array([prompt]))[:, -1]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        for _ in range(1500):
            counts[sampler(logprobs).item()] += 1
        assert not chi_square_exceeds(counts, first_p)


def test_speculative_generate_step_reports_draft_provenance(model):
    target = MlxTarget(model, [0, 2, 4])
    prompt = PROMPTS[0]
    expected = baseline(model, prompt, 10)
    drafter = ScriptedDrafter([None] + expected, 96, lambda p: p == 3).start(prompt)
    steps = speculative_generate_step(prompt, target, drafter, policy=FixedPolicy(4))
    provenance = [from_draft for (_, from_draft), _ in zip(steps, range(10), strict=False)]
    # first token from the prefill; round 1 accepts drafts 2 (position 3 is wrong): 1 + 1 target
    assert provenance[:5] == [False, True, False, True, True]
