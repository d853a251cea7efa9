"""Logit bias and the repetition, presence and frequency penalties under speculation: every
verified row is processed with the history as accepted so far, so greedy output is plain
mlx-lm decoding's with the same processors, sampling follows the processed distribution, and
the log-probabilities are the target's own."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors as mlx_lm_processors
from mlx_lm.sample_utils import make_sampler
from mlx_targets import sampling_target, tiny_target
from stats_helpers import chi_square_exceeds
from test_decode import MarkovDrafter, ScriptedDrafter

from woodcock.demo import bigram_drafter, write_tiny_target
from woodcock.runtime.decode import Stats, speculative_generate_step
from woodcock.runtime.eagle3 import Eagle3Drafter
from woodcock.runtime.ngram import PromptLookup
from woodcock.runtime.policy import FixedPolicy
from woodcock.runtime.sampling import (
    HistoryPenalty,
    Sampling,
    greedy_tokens,
    log_softmax,
    make_logits_processors,
    near_ties,
    process_logits,
)
from woodcock.runtime.target import MlxTarget
from woodcock.synthetic import random_drafter, tiny_spec

VOCAB = 96
# make_logits_processors' keyword arguments, as mlx-lm's take them
SETTINGS = {
    "bias": {"logit_bias": {3: 4.0, 17: -100.0, 40: 2.5, 41: 6.0}},
    "repetition": {"repetition_penalty": 1.8},
    "repetition-below-1": {"repetition_penalty": 0.6, "repetition_context_size": 6},
    "presence": {"presence_penalty": 1.5},
    "presence-negative": {"presence_penalty": -1.2, "presence_context_size": 5},
    "frequency": {"frequency_penalty": 0.9},
    "all": {
        "logit_bias": {5: 3.0, 9: -2.0},
        "repetition_penalty": 1.3,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.4,
        "frequency_context_size": 30,
    },
}
# a context size of 0 is the whole history (mlx-lm slices tokens[-0:])
WHOLE_HISTORY = {
    "whole-history": {
        "repetition_penalty": 1.8,
        "repetition_context_size": 0,
        "frequency_penalty": 0.9,
        "frequency_context_size": 0,
    }
}
PROMPTS = [[1, 2, 3], [7], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [5, 9, 5, 9, 5, 9, 5]]


def plain(model, prompt, max_tokens, processors, eos=()):
    """mlx-lm's greedy decoding with logits processors: (tokens, log-probabilities [n, V])."""
    tokens, logprobs = [], []
    steps = generate_step(
        mx.array(prompt), model, max_tokens=max_tokens, logits_processors=processors
    )
    for token, row in steps:
        if token in eos:
            break
        tokens.append(token)
        logprobs.append(np.array(row))
    return tokens, np.stack(logprobs)


def speculative(prompt, target, drafter, max_tokens, processors, **options):
    """The loop's tokens, their log-probabilities [n, V] and whether each came from a draft."""
    steps = speculative_generate_step(
        prompt, target, drafter, logits_processors=processors, logprobs=True, **options
    )
    tokens, logprobs, drafted = [], [], []
    for token, from_draft, row in steps:
        if len(tokens) == max_tokens:
            break
        tokens.append(token)
        logprobs.append(np.array(row))
        drafted.append(from_draft)
    return tokens, np.stack(logprobs), drafted


def random_eagle3(model, taps):
    args = model.args
    spec = tiny_spec(
        "eagle3",
        style="llama",
        num_layers=1,
        hidden_size=args.hidden_size,
        vocab_size=args.vocab_size,
        target_layers=args.num_hidden_layers,
        taps=taps,
        tap_norm="per_tap",
    )
    return random_drafter(spec, seed=5)


@pytest.fixture(scope="module")
def model():
    return tiny_target("qwen3", scale=0.5)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    path = write_tiny_target(tmp_path_factory.mktemp("demo") / "target")
    model, tokenizer = load(str(path))
    return path, model, tokenizer


@pytest.mark.parametrize("name", [*SETTINGS, *WHOLE_HISTORY])
def test_the_processors_are_mlx_lms_for_one_row_and_for_all_rows(name):
    rng = np.random.default_rng(0)
    settings = {**SETTINGS, **WHOLE_HISTORY}[name]
    ours, theirs = make_logits_processors(**settings), mlx_lm_processors(**settings)
    assert len(ours) == len(theirs)
    for history_length, k in ((1, 0), (3, 4), (12, 7), (40, 6)):
        history = rng.integers(0, 8, history_length).tolist()  # few ids: many repeats
        proposed = rng.integers(0, 8, k).tolist()
        given = rng.standard_normal((k + 1, VOCAB)).astype(np.float32) * 3
        logits = mx.array(given)
        expected = logits
        for processor in theirs:
            expected = mx.concatenate(
                [
                    processor(mx.array(history + proposed[:i]), expected[i : i + 1])
                    for i in range(k + 1)
                ]
            )
        expected = np.array(expected)
        assert np.array_equal(np.array(process_logits(ours, history, proposed, logits)), expected)
        assert np.array_equal(np.array(process_logits(theirs, history, proposed, logits)), expected)
        one_row = logits[:1]
        for processor in ours:
            one_row = processor(mx.array(history), one_row)
        assert np.array_equal(np.array(one_row), expected[:1])
        assert np.array_equal(np.array(logits), given)  # the caller's logits are left alone


def test_the_repetition_penalty_refuses_a_negative_factor_or_window():
    with pytest.raises(ValueError, match="non-negative"):
        HistoryPenalty("repetition", -1.0)
    with pytest.raises(ValueError, match="context_size must be at least 0"):
        HistoryPenalty("presence", 1.0, context_size=-2)


@pytest.mark.parametrize("name", SETTINGS)
@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_output_is_plain_decodings_with_the_same_processors(model, name, k):
    """A drafter that proposes plain decoding's own output (wrong every third token), so long
    runs of drafts are accepted and each verified row needs the drafts before it."""
    target = MlxTarget(model, [0, 2, 4])
    for prompt in PROMPTS:
        expected, expected_logprobs = plain(model, prompt, 40, mlx_lm_processors(**SETTINGS[name]))
        for processors in (make_logits_processors(**SETTINGS[name]), mlx_lm_processors(**SETTINGS[name])):
            drafter = ScriptedDrafter([None] + expected, VOCAB, lambda p: p % 3 == 0)
            stats = Stats()
            got, logprobs, _ = speculative(
                prompt, target, drafter.start(prompt), 40, processors,
                policy=FixedPolicy(k), stats=stats,
            )  # fmt: skip
            assert got == expected
            np.testing.assert_allclose(logprobs, expected_logprobs, atol=2e-4)
            assert sum(stats.accepted) > 0


@pytest.mark.parametrize("name", SETTINGS)
def test_greedy_with_an_eagle3_drafter_and_prompt_lookup(model, name):
    drafter = random_eagle3(model, (0, 2, 4))
    target = MlxTarget(model, drafter.spec.taps.layer_ids)
    runtime = Eagle3Drafter(drafter, target.shared_tensors())
    for prompt in PROMPTS:
        expected, expected_logprobs = plain(model, prompt, 32, mlx_lm_processors(**SETTINGS[name]))
        got, logprobs, _ = speculative(
            prompt, target, runtime, 32, make_logits_processors(**SETTINGS[name]),
            policy=FixedPolicy(4), lookup=PromptLookup(VOCAB),
        )  # fmt: skip
        assert got == expected, prompt
        np.testing.assert_allclose(logprobs, expected_logprobs, atol=2e-4)


@pytest.mark.parametrize("name", ["bias", "repetition", "presence", "all"])
def test_greedy_with_a_mostly_right_drafter_and_prompt_lookup(demo, name):
    path, model, tokenizer = demo
    drafter = bigram_drafter(path)
    target = MlxTarget(model, drafter.spec.taps.layer_ids)
    runtime = Eagle3Drafter(drafter, target.shared_tensors())
    settings = dict(SETTINGS[name])
    if "logit_bias" in settings:  # ids that exist in the demo's vocabulary
        settings["logit_bias"] = {i * 7 % 320: v for i, v in settings["logit_bias"].items()}
    total = Stats()
    for text in ["The quick brown", "Paris is the", "One, two, one, two, one"]:
        prompt = tokenizer.encode(text)
        eos = tokenizer.eos_token_ids
        expected, expected_logprobs = plain(model, prompt, 48, mlx_lm_processors(**settings), eos)
        stats = Stats()
        got, logprobs, _ = speculative(
            prompt, target, runtime, len(expected), make_logits_processors(**settings),
            policy=FixedPolicy(5), lookup=PromptLookup(model.args.vocab_size), stats=stats,
        )  # fmt: skip
        assert got == expected, text
        np.testing.assert_allclose(logprobs, expected_logprobs, atol=2e-4)
        total.accepted += stats.accepted
    assert sum(total.accepted) > 10  # the processed rows were judged with drafts before them


def test_without_processors_the_log_probabilities_are_the_targets(model):
    target = MlxTarget(model, [0, 2, 4])
    prompt = PROMPTS[2]
    expected, expected_logprobs = plain(model, prompt, 30, None)
    drafter = ScriptedDrafter([None] + expected, VOCAB, lambda p: p % 4 == 1).start(prompt)
    got, logprobs, drafted = speculative(prompt, target, drafter, 30, (), policy=FixedPolicy(3))
    assert got == expected and any(drafted)
    np.testing.assert_allclose(logprobs, expected_logprobs, atol=2e-4)
    assert np.allclose(np.exp(logprobs).sum(axis=-1), 1, atol=1e-4)


def processed_marginals(model, prompt, sampling, processors, tokens=3):
    """[P(token i) for i = 1..tokens] of plain sampling with the processors."""
    prefixes, weights, marginals = [list(prompt)], np.ones(1), []
    while True:
        logits = model(mx.array(prefixes))[:, -1]
        rows = [process_logits(processors, p, [], logits[i : i + 1]) for i, p in enumerate(prefixes)]
        joint = weights[:, None] * np.array(sampling.probabilities(mx.concatenate(rows)))
        marginals.append(joint.sum(axis=0))
        if len(marginals) == tokens:
            return marginals
        prefixes = [p + [t] for p in prefixes for t in range(joint.shape[1])]
        weights = joint.reshape(-1)


SAMPLED = [
    ("bias+presence", Sampling(temperature=1.0), {"logit_bias": {0: 2.0, 4: 1.5, 6: -3.0}, "presence_penalty": 2.0}),
    ("repetition+frequency", Sampling(temperature=0.8, top_k=8), {"repetition_penalty": 2.5, "frequency_penalty": 1.0}),
]  # fmt: skip


class UnprocessedTargetDrafter:
    """Drafts sampled from the target's own distribution without the processors: close to the
    processed one, so drafts are often accepted and a verified row's history includes them."""

    def __init__(self, model, prompt, rows):
        self.model, self.first = model, list(prompt[:1])
        self.head_target_ids = mx.arange(model.args.vocab_size)
        self.num_drafts = self.last_confidence = None
        self.rows = rows  # the model's last row by token prefix

    def reset(self):
        self.tokens = list(self.first)

    def add_context(self, tokens, taps):
        self.tokens += tokens.tolist()  # the token after each position

    def row(self, tokens):
        key = tuple(tokens)
        if key not in self.rows:
            self.rows[key] = self.model(mx.array([tokens]))[0, -1]
        return self.rows[key]

    def propose(self, k, sampler):
        drafted, rows = [], []
        for _ in range(k):
            row = self.row(self.tokens + drafted)
            drafted.append(sampler(row).item())
            rows.append(row)
        return mx.array(drafted, mx.int32), mx.stack(rows)


@pytest.mark.parametrize("drafter_kind", ["markov", "unprocessed-target"])
@pytest.mark.parametrize("sampling, settings", [s[1:] for s in SAMPLED], ids=[s[0] for s in SAMPLED])
def test_sampling_follows_the_processed_distribution(sampling, settings, drafter_kind):
    """A drafter far from the target (drafts are often rejected, the residual is sampled) or
    close to it (long accepted runs), and prompt lookup (a repetitive prompt: copies are judged
    too); the second token's distribution depends on the first through the penalties."""
    model = sampling_target()
    target = MlxTarget(model, [1])
    prompt = [4, 7, 4, 7]
    processors = make_logits_processors(**settings)
    expected = processed_marginals(model, prompt, sampling, processors)
    counts = np.zeros((3, 12))
    rows = {}  # shared by the runs: a prefix's row is the same in every one
    for seed in range(1500):
        mx.random.seed(seed)
        if drafter_kind == "markov":
            drafter = MarkovDrafter(12, seed=11, head_ids=[0, 2, 3, 5, 7, 8, 11])
        else:
            drafter = UnprocessedTargetDrafter(model, prompt, rows)
        steps = speculative_generate_step(
            prompt, target, drafter, policy=FixedPolicy(3), sampling=sampling,
            lookup=PromptLookup(12) if seed % 2 else None, logits_processors=processors,
        )  # fmt: skip
        for position in range(3):
            counts[position, next(steps)[0]] += 1
    for position in range(3):
        assert not chi_square_exceeds(counts[position], expected[position]), position
    # the same test catches sampling from the unprocessed target
    unprocessed = processed_marginals(model, prompt, sampling, [])
    assert chi_square_exceeds(counts[1], unprocessed[1])


def test_mlx_lm_samples_the_processed_distribution_we_compute():
    model = sampling_target()
    sampling, settings = SAMPLED[0][1:]
    prompt = [4, 7, 4, 7]
    first_p = processed_marginals(model, prompt, sampling, mlx_lm_processors(**settings), 1)[0]
    sampler = make_sampler(sampling.temperature)
    counts = np.zeros(12)
    for seed in range(1000):
        mx.random.seed(seed)
        steps = generate_step(
            mx.array(prompt), model, max_tokens=1, sampler=sampler,
            logits_processors=mlx_lm_processors(**settings),
        )  # fmt: skip
        counts[next(steps)[0]] += 1
    assert not chi_square_exceeds(counts, first_p)


def test_log_softmax_and_the_greedy_choice_are_mlx_lm_s_in_bf16():
    """Over a flat vocabulary bf16 rounds the log-probabilities of logits 0.5 and 0.50390625 to
    one value: mlx-lm's greedy choice is then the lower id, not the logits' argmax."""
    row = mx.zeros((32000,)).at[5].add(0.5).at[9].add(0.50390625).astype(mx.bfloat16)[None]
    theirs = row - mx.logsumexp(row, axis=-1, keepdims=True)  # mlx-lm's generate_step
    ours = log_softmax(row)
    assert ours.dtype == mx.bfloat16 and mx.array_equal(ours, theirs).item()
    assert mx.argmax(row).item() == 9
    assert greedy_tokens(row).item() == make_sampler(0.0)(theirs).item() == 5
    assert near_ties(row).item()
    # in fp32 the two stay apart, and a row with one clear maximum is never a near tie
    assert greedy_tokens(row.astype(mx.float32)).item() == 9
    assert not near_ties(row.astype(mx.float32)).item()
    assert not near_ties(mx.array([[0.0, 1.0, 0.0]], mx.bfloat16)).item()
