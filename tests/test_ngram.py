"""The prompt-lookup drafter: its matching rule on hand-made histories and against a brute-force
reference, and the speculative loop with it emitting exactly mlx-lm's greedy output."""

import mlx.core as mx
import pytest
from helpers import generate_tokens
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.generate import generate_step
from mlx_targets import tiny_target

from woodcock.errors import DrafterError
from woodcock.runtime.decode import Stats
from woodcock.runtime.ngram import NgramDrafter, PromptLookup
from woodcock.runtime.sampling import Sampling
from woodcock.runtime.target import MlxTarget

GREEDY = Sampling().sample


def drafter_with(history, **kwargs):
    drafter = NgramDrafter(kwargs.pop("vocab", 100), **kwargs)
    drafter.add_context(mx.array(history, mx.int32), None)
    return drafter


def reference(history, k, max_ngram=3, min_ngram=1, after=()):
    """Brute force: the longest suffix of history + after with an earlier occurrence in the
    history that the history continues, its most recent one, then an overlapping copy; else the
    last token k times."""
    seen = list(history) + list(after)
    size = len(seen)
    for n in range(min(max_ngram, size), min_ngram - 1, -1):
        suffix = seen[size - n :]
        for start in range(len(history) - n - 1, -1, -1):
            if seen[start : start + n] == suffix:
                out = list(seen)
                for j in range(k):
                    out.append(out[start + n + j])
                return out[size:]
    return [seen[-1]] * k


def test_longest_suffix_wins():
    history = [5, 2, 8, 4, 2, 6, 0, 5, 2]  # (5, 2) -> 8 at 0; the unigram 2 -> 6 is more recent
    assert drafter_with(history).continuation(1) == [8]
    drafter = drafter_with(history)
    assert drafter.continuation(3) == [8, 4, 2] and drafter.last_match == 2
    assert drafter_with(history, max_ngram=1).continuation(2) == [6, 0]


def test_most_recent_occurrence():
    history = [3, 1, 3, 2, 9, 3]  # 3 -> 1 at 0, 3 -> 2 at 2: the later one
    drafter = drafter_with(history)
    assert drafter.continuation(2) == [2, 9] and drafter.last_match == 1


def test_no_match_repeats_the_last_token():
    drafter = drafter_with([1, 2, 3])
    assert drafter.continuation(4) == [3, 3, 3, 3] and drafter.last_match == 0
    # min_ngram 2: a unigram match does not count
    drafter = drafter_with([7, 1, 8, 1], min_ngram=2)
    assert drafter.continuation(2) == [1, 1] and drafter.last_match == 0
    assert drafter_with([7, 1, 8, 1]).continuation(2) == [8, 1]
    assert drafter_with([4]).continuation(3) == [4, 4, 4]


def test_continuation_runs_on_across_k():
    history = [10, 11, 12, 13, 10, 11]
    # (10, 11) matched at 0: copy 12 13 10 11, then on into the drafts themselves
    assert drafter_with(history).continuation(8) == [12, 13, 10, 11, 12, 13, 10, 11]
    assert drafter_with([6, 6, 6]).continuation(5) == [6] * 5  # period 1
    assert drafter_with([1, 2, 1, 2, 1]).continuation(4) == [2, 1, 2, 1]


@settings(max_examples=300, deadline=None)
@given(
    history=st.lists(st.integers(0, 4), min_size=1, max_size=40),
    cuts=st.lists(st.integers(0, 40), max_size=4),
    k=st.integers(1, 7),
    max_ngram=st.integers(1, 4),
    min_offset=st.integers(0, 3),
)
def test_matches_brute_force_whatever_the_chunking(history, cuts, k, max_ngram, min_offset):
    min_ngram = max(1, max_ngram - min_offset)
    drafter = NgramDrafter(5, max_ngram=max_ngram, min_ngram=min_ngram)
    bounds = sorted({0, len(history), *[c for c in cuts if c < len(history)]})
    for a, b in zip(bounds, bounds[1:], strict=False):
        drafter.add_context(mx.array(history[a:b], mx.int32), None)
        prefix = history[:b]
        assert drafter.continuation(k) == reference(prefix, k, max_ngram, min_ngram)
    drafter.reset()
    drafter.add_context(history)  # a plain list works too
    assert drafter.continuation(k) == reference(history, k, max_ngram, min_ngram)


@settings(max_examples=300, deadline=None)
@given(
    history=st.lists(st.integers(0, 4), min_size=1, max_size=30),
    after=st.lists(st.integers(0, 4), max_size=6),
    k=st.integers(1, 9),
    max_ngram=st.integers(1, 4),
)
def test_continuation_after_drafts_matches_brute_force(history, after, k, max_ngram):
    drafter = NgramDrafter(5, max_ngram=max_ngram, min_ngram=1)
    drafter.add_context(history)
    assert drafter.continuation(k, after) == reference(history, k, max_ngram, 1, after)
    assert drafter.history == history  # the drafts are not added


@pytest.mark.parametrize(
    "sampler",
    [GREEDY, Sampling(temperature=1.0).sample, Sampling(temperature=0.7, top_p=0.9).sample],
    ids=["greedy", "categorical", "top-p"],
)
def test_propose_puts_all_mass_on_the_copied_tokens(sampler):
    drafter = drafter_with([10, 11, 12, 13, 10, 11], vocab=32)
    tokens, logits = drafter.propose(5, sampler)
    assert tokens.dtype == mx.int32 and tokens.shape == (5,)
    assert logits.dtype == mx.float32 and logits.shape == (5, 32)
    assert tokens.tolist() == [12, 13, 10, 11, 12]
    assert mx.argmax(logits, axis=-1).tolist() == tokens.tolist()
    q = Sampling(temperature=1.0).probabilities(logits)
    assert mx.allclose(q.sum(axis=-1), mx.ones(5)).item()
    assert q[mx.arange(5), tokens].tolist() == [1.0] * 5
    # proposing again without new context gives the same drafts
    assert drafter.propose(5, sampler)[0].tolist() == tokens.tolist()


def test_protocol_and_errors():
    drafter = NgramDrafter(8, max_ngram=2)
    assert drafter.head_target_ids.dtype == mx.int32
    assert drafter.head_target_ids.tolist() == list(range(8))
    with pytest.raises(DrafterError, match="no context"):
        drafter.propose(2, GREEDY)
    drafter.add_context(mx.array([1, 2, 1], mx.int32), mx.zeros((3, 4)))  # taps are ignored
    with pytest.raises(DrafterError, match="k = 0"):
        drafter.propose(0, GREEDY)
    with pytest.raises(DrafterError, match="expected \\[n\\]"):
        drafter.add_context(mx.zeros((2, 2), mx.int32), None)
    with pytest.raises(DrafterError, match="one token per row"):
        drafter.propose(2, lambda logits: mx.argmax(logits))
    drafter.reset()
    assert drafter.history == []
    with pytest.raises(DrafterError, match="no context"):
        drafter.propose(1, GREEDY)
    with pytest.raises(DrafterError, match="min_ngram = 3, max_ngram = 2"):
        NgramDrafter(8, max_ngram=2, min_ngram=3)
    with pytest.raises(DrafterError, match="vocab_size = 0"):
        NgramDrafter(0)


def test_prompt_lookup_extends_drafts_that_close_a_repeat():
    lookup = PromptLookup(50, max_copy=9)
    lookup.add_context([1, 2, 3, 4, 5, 6, 7, 8])
    assert lookup.copy_length() == 0
    # drafts 2 3 4 repeat three tokens: copy six after them, within 9 drafts in all
    assert lookup.match_length([2, 3, 4]) == 3
    assert lookup.copy_length([2, 3, 4]) == 6
    assert lookup.continuation(6, [2, 3, 4]) == [5, 6, 7, 8, 2, 3]
    assert lookup.copy_length([9, 3, 4]) == 4  # "3 4" only: 9 is new
    assert lookup.copy_length([1, 2, 3, 4, 5, 6]) == 3  # room for 3 more
    assert lookup.copy_length([1, 2, 3, 4, 5, 6, 7, 8, 1]) == 0  # no room
    assert lookup.copy_length([9, 4]) == 0  # a one-token repeat is not enough
    assert lookup.history == [1, 2, 3, 4, 5, 6, 7, 8]


def test_match_length_is_what_a_proposal_copies_after():
    drafter = drafter_with([1, 2, 3, 4, 2, 3], max_ngram=4)
    assert drafter.match_length() == 2
    assert drafter.continuation(2) == [4, 2] and drafter.last_match == 2
    assert drafter_with([1, 2, 3]).match_length() == 0
    assert drafter_with([5, 6, 5], min_ngram=2).match_length() == 0  # only a 1-token match


def test_prompt_lookup_copies_only_after_a_repeat():
    lookup = PromptLookup(50)
    lookup.add_context(mx.array([1, 2, 3, 4], mx.int32))
    assert lookup.copy_length() == 0  # nothing repeats
    lookup.add_context([9, 3])
    assert lookup.copy_length() == 0  # a one-token repeat is not enough
    lookup.add_context([4])
    assert lookup.copy_length() == 2 * 2  # "3 4" occurred before: as long again as the match
    assert lookup.continuation(lookup.copy_length()) == [9, 3, 4, 9]
    loop = PromptLookup(50, max_match=6, max_copy=5)
    loop.add_context(list(range(10)) * 3)
    assert loop.match_length() == 6 and loop.copy_length() == 5
    assert PromptLookup(50).max_copy == 31
    with pytest.raises(DrafterError, match="max_copy = 0"):
        PromptLookup(50, max_copy=0)
    with pytest.raises(DrafterError, match="min_ngram = 3, max_ngram = 2"):
        PromptLookup(50, min_match=3, max_match=2)


# -- end to end: the loop with this drafter is plain greedy decoding ---------------------------

PROMPTS = {
    "plain": [1, 2, 3],
    "single": [7],
    "ramp": [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50],
    "repeat": [5, 9, 13, 5, 9, 13, 5, 9, 13, 5, 9, 13, 5, 9],
    "phrase": [20, 21, 22, 23, 24, 60, 61, 20, 21, 22, 23, 24, 60, 61, 20, 21, 22],
}


def baseline(model, prompt, max_tokens):
    steps = generate_step(mx.array(prompt), model, max_tokens=max_tokens)
    return [token for token, _ in steps]


def markov(model):
    """The same model with every attention output projection zeroed: each position's logits
    then depend on its own token only, so greedy decoding falls into a short loop that the
    n-gram drafter can copy (a random target rarely repeats itself otherwise)."""
    for layer in model.layers:
        layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
    mx.eval(model.parameters())
    return model


@pytest.fixture(
    scope="module",
    params=["qwen3", "llama", "qwen3-markov", "llama-markov"],
)
def model(request):
    architecture, _, kind = request.param.partition("-")
    model = tiny_target(architecture, scale=0.5)
    return markov(model) if kind else model


@pytest.fixture(scope="module")
def expected(model):
    return {name: baseline(model, prompt, 48) for name, prompt in PROMPTS.items()}


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6])
def test_greedy_output_is_mlx_lms(model, expected, k):
    target = MlxTarget(model, [1])
    for name, prompt in PROMPTS.items():
        stats = Stats()
        got = generate_tokens(
            prompt, target, NgramDrafter(96), max_tokens=48, num_draft=k, stats=stats
        )
        assert got == expected[name], (name, k)
        assert stats.drafted and all(d == k for d in stats.drafted)


@pytest.mark.parametrize("architecture", ["qwen3", "llama"])
def test_drafts_are_accepted_on_repetitive_text(architecture):
    model = markov(tiny_target(architecture, scale=0.5))
    target = MlxTarget(model, [1])
    # A prompt that repeats the target's own loop: the very first drafts copy it and hold.
    loop = [7] + baseline(model, [7], 15)
    for prompt in (loop, PROMPTS["repeat"], PROMPTS["phrase"]):
        want = baseline(model, prompt, 40)
        for k in (1, 3, 6):
            stats = Stats()
            got = generate_tokens(
                prompt, target, NgramDrafter(96), max_tokens=40, num_draft=k, stats=stats
            )
            assert got == want
            assert sum(stats.accepted) > 0 and stats.tokens_per_round > 1.5, stats.accepted
            if prompt is loop:
                assert stats.accepted[0] == k


def test_sampling_runs_with_one_hot_q():
    target = MlxTarget(markov(tiny_target("qwen3", scale=0.5)), [1])
    mx.random.seed(3)
    stats = Stats()
    got = generate_tokens(
        PROMPTS["repeat"],
        target,
        NgramDrafter(96),
        max_tokens=32,
        num_draft=3,
        sampling=Sampling(temperature=0.8),
        stats=stats,
    )
    assert len(got) == 32 and all(0 <= t < 96 for t in got)
