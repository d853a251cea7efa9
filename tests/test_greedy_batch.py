"""Greedy answers decoded many at a time (what `woodcock distill` generates with) equal mlx-lm's
one-prompt-at-a-time greedy decoding token for token, whatever the batch, the prefill grouping
and the order in which answers finish."""

import random
from collections import Counter

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, RotatingKVCache
from mlx_targets import tiny_target
from test_decode import bf16_tie_target, tied_positions

from woodcock.errors import DrafterError
from woodcock.runtime import greedy_batch
from woodcock.runtime.greedy_batch import greedy_answers
from woodcock.runtime.prefill import CPU_SIZES, GPU_SIZES, PrefillSizes
from woodcock.runtime.target import MlxTarget

MAX_TOKENS = 14


def plain(model, prompt, stop):
    answer = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=MAX_TOKENS):
        answer.append(token)
        if token in stop:
            break
    return answer


@pytest.fixture(scope="module")
def case():
    rng = random.Random(5)
    model = tiny_target("llama", scale=0.5)
    prompts = [
        [rng.randrange(96) for _ in range(rng.choice([1, 2, 5, 9, 17, 30, 41]))] for _ in range(13)
    ]
    unstopped = [plain(model, p, ()) for p in prompts]
    # a stop token that ends some answers early, at different lengths
    counts = Counter(t for answer in unstopped for t in answer[1:-1])
    stop = {counts.most_common(1)[0][0]}
    expected = [plain(model, p, stop) for p in prompts]
    assert 0 < sum(len(e) < MAX_TOKENS for e in expected) < len(prompts)
    return model, prompts, stop, expected


@pytest.mark.parametrize(
    "batch, sizes, padding",
    [
        (1, GPU_SIZES, 1.25),
        (1, CPU_SIZES, 1.25),
        (3, PrefillSizes(chunk=7, long_chunk=7, scores=0, group_tokens=20), 1.25),
        (3, PrefillSizes(chunk=8, long_chunk=3, scores=200, group_tokens=24), 99),
        (5, GPU_SIZES, 1.25),
        (20, PrefillSizes(chunk=4, long_chunk=4, scores=0, group_tokens=64), 99),
        (20, GPU_SIZES, 99),
        (20, CPU_SIZES, 99),
    ],
)
def test_answers_equal_one_prompt_at_a_time(case, monkeypatch, batch, sizes, padding):
    model, prompts, stop, expected = case
    monkeypatch.setattr(greedy_batch, "PADDING", padding)
    target = MlxTarget(model, ())
    answers = list(
        greedy_answers(
            target, prompts, batch=batch, max_tokens=MAX_TOKENS, stop_ids=stop, sizes=sizes
        )
    )
    assert sorted(a.index for a in answers) == list(range(len(prompts)))
    for answer in answers:
        assert answer.tokens == expected[answer.index], answer.index
        reason = "stop" if answer.tokens[-1] in stop else "length"
        assert answer.finish_reason == reason
        assert reason == "stop" or len(answer.tokens) == MAX_TOKENS
    if batch > 1:  # answers finish out of order when they differ in length
        assert [a.index for a in answers] != sorted(a.index for a in answers)


def test_answers_equal_mlx_lm_s_where_bf16_rounding_ties_tokens():
    """Where a step's argmax is not mlx-lm's choice, the row takes the position back and is fed
    mlx-lm's token: the answers stay plain decoding's."""
    model = bf16_tie_target()
    rng = random.Random(2)
    prompts = [[rng.randrange(96) for _ in range(rng.choice([1, 3, 8]))] for _ in range(9)]
    expected = [tied_positions(model, p, MAX_TOKENS) for p in prompts]
    assert sum(ties for _, ties in expected) >= 2  # the ties this test is about happened
    answers = greedy_answers(
        MlxTarget(model, ()), prompts, batch=4, max_tokens=MAX_TOKENS, stop_ids=()
    )
    for answer in answers:
        assert answer.tokens == expected[answer.index][0], answer.index


def test_one_token_answers_and_a_first_token_that_stops(case):
    model, prompts, stop, expected = case
    target = MlxTarget(model, ())
    ones = list(greedy_answers(target, prompts, batch=4, max_tokens=1, stop_ids=()))
    assert {a.index: a.tokens for a in ones} == {i: e[:1] for i, e in enumerate(expected)}
    assert {a.finish_reason for a in ones} == {"length"}
    firsts = {e[0] for e in expected}
    stopped = list(greedy_answers(target, prompts, batch=4, max_tokens=MAX_TOKENS, stop_ids=firsts))
    assert all(a.tokens == expected[a.index][:1] and a.finish_reason == "stop" for a in stopped)


def test_prefill_groups_fit_the_padded_token_budget(monkeypatch):
    sizes = PrefillSizes(chunk=10, long_chunk=10, scores=0, group_tokens=30)
    monkeypatch.setattr(greedy_batch, "PADDING", 99)
    prompts = [[1] * n for n in (3, 4, 25, 2, 9, 1)]
    waiting = list(range(len(prompts)))[::-1]
    groups = []
    while waiting:
        groups.append(greedy_batch._take_group(prompts, waiting, 4, sizes))
    # widths are capped at a chunk: (3, 4) then 25 -> 10 wide, 3 x 10 fits, a 4th would not
    assert groups == [[0, 1, 2], [3, 4, 5]]
    assert greedy_batch._take_group([[1] * 99], [0], 4, sizes) == [0]  # one always goes
    # padding: 4 + 5 + 9 tokens padded to 3 x 9 = 27 > 1.25 x 18, so 9 waits
    monkeypatch.setattr(greedy_batch, "PADDING", 1.25)
    prompts = [[1] * n for n in (4, 5, 9, 9)]
    waiting = [3, 2, 1, 0]
    assert greedy_batch._take_group(prompts, waiting, 4, sizes) == [0, 1]
    assert greedy_batch._take_group(prompts, waiting, 4, sizes) == [2, 3]


def test_a_model_without_plain_kv_caches_is_refused():
    model = tiny_target("llama", scale=0.5)
    target = MlxTarget(model, ())
    target.cache[0] = RotatingKVCache(max_size=8)
    target.reset = lambda: None
    with pytest.raises(DrafterError, match="plain KV cache"):
        list(greedy_answers(target, [[1, 2]], batch=2, max_tokens=3, stop_ids=()))
    assert isinstance(MlxTarget(model, ()).cache[0], KVCache)
