"""Greedy answers decoded many at a time (what `woodcock distill` generates with) equal mlx-lm's
one-prompt-at-a-time greedy decoding token for token, whatever the batch, the prefill grouping
and the order in which answers finish."""

import dataclasses
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

    def groups(new_tokens, parent=None, room=4):
        parent = parent or [None] * len(new_tokens)
        waiting, prefilled, taken = list(range(len(new_tokens)))[::-1], {}, []
        while waiting:
            taken.append(
                greedy_batch._take_group(new_tokens, parent, prefilled, waiting, room, sizes)
            )
            prefilled |= dict.fromkeys(taken[-1])
        return taken

    # widths are capped at a chunk: (3, 4) then 25 -> 10 wide, 3 x 10 fits, a 4th would not
    assert groups([3, 4, 25, 2, 9, 1]) == [[0, 1, 2], [3, 4, 5]]
    assert groups([99]) == [[0]]  # one always goes
    # a prompt whose parent's cache is not made yet (in the group, or waiting itself) is passed
    # over, and a later one joins instead
    assert groups([3, 2, 2, 2], [None, 0, 1, None]) == [[0, 3], [1], [2]]
    assert groups([1] * 6, [None, 0, 0, 0, 0, None], room=3) == [[0], [1, 2, 3], [4, 5]]
    # padding: 4 + 5 + 9 tokens padded to 3 x 9 = 27 > 1.25 x 18, so 9 waits
    monkeypatch.setattr(greedy_batch, "PADDING", 1.25)
    assert groups([4, 5, 9, 9]) == [[0, 1], [2, 3]]


def test_each_prompt_starts_from_the_longest_head_that_begins_its_own():
    heads = [(1, 2, 3), (1, 2), (1, 2, 3, 4), (1, 2, 4), (), (1, 2, 3), (5,), (1,)]
    parent, children = greedy_batch._prefix_forest(heads)
    # an empty head starts nothing; of two equal heads, one starts the other
    assert parent == [1, 7, 5, 1, None, 0, None, None]
    assert children == [[5], [0, 3], [], [], [], [2], [], [1]]
    prompts = [[*h, 9] for h in heads]
    order = greedy_batch._joining_order(prompts, parent, children)
    # shortest first, and each prompt's descendants right after it, depth first
    assert order == [4, 6, 7, 1, 0, 5, 2, 3]


@pytest.fixture(scope="module")
def conversations():
    """Prompts that begin with each other's heads, as the turns of one conversation do: a chain,
    siblings, a duplicate, one whose head is another's whole head plus nothing, and strangers."""
    rng = random.Random(8)
    model = tiny_target("llama", scale=0.5)

    def tokens(n):
        return [rng.randrange(96) for _ in range(n)]

    first = tokens(6)
    second = first[:-1] + tokens(9)
    third = second[:-1] + tokens(13)
    prompts = [
        third,
        tokens(4),
        first,
        second,
        second[:-1] + tokens(3),  # a sibling of third
        list(second),  # the same tokens as second under another id
        first[:-1] + [first[-1] ^ 1],  # the same head as first, another last token
        tokens(1),
        third[:-1] + tokens(30),
    ]
    expected = [plain(model, p, ()) for p in prompts]
    return model, prompts, expected


@pytest.mark.parametrize(
    "batch, sizes",
    [
        (1, CPU_SIZES),
        (2, PrefillSizes(chunk=4, long_chunk=2, scores=60, group_tokens=12)),
        (4, dataclasses.replace(GPU_SIZES, shared_heads=True)),
        (9, PrefillSizes(chunk=5, long_chunk=5, scores=0, group_tokens=40)),
        (4, GPU_SIZES),  # the GPU's sizes prefill every head whole
    ],
)
def test_prompts_sharing_a_head_prefill_it_once_and_answer_as_alone(
    conversations, monkeypatch, batch, sizes
):
    model, prompts, expected = conversations
    prefilled = []
    forward = greedy_batch.SequenceBatch.forward

    def counting(self, tokens):
        prefilled.append(sum(t.shape[0] for t in tokens))
        return forward(self, tokens)

    monkeypatch.setattr(greedy_batch.SequenceBatch, "forward", counting)
    monkeypatch.setattr(greedy_batch, "PADDING", 99)
    answers = greedy_answers(
        MlxTarget(model, ()), prompts, batch=batch, max_tokens=MAX_TOKENS, stop_ids=(), sizes=sizes
    )
    assert {a.index: a.tokens for a in answers} == dict(enumerate(expected))
    heads = [tuple(p[:-1]) for p in prompts]

    def starts(j, i):  # head j begins head i and is shorter, or the same and given earlier
        shorter = len(heads[j]) < len(heads[i]) or (heads[j] == heads[i] and j < i)
        return shorter and heads[i][: len(heads[j])] == heads[j]

    own = [
        len(h) - max((len(heads[j]) for j in range(len(heads)) if starts(j, i)), default=0)
        for i, h in enumerate(heads)
    ]
    assert own[5] == 0 and own[6] == 0  # second's twin, and first's head again, compute nothing
    assert sum(own) < sum(map(len, heads)) / 2
    assert sum(prefilled) == (sum(own) if sizes.shared_heads else sum(map(len, heads)))


def test_a_model_without_plain_kv_caches_is_refused():
    model = tiny_target("llama", scale=0.5)
    target = MlxTarget(model, ())
    target.cache[0] = RotatingKVCache(max_size=8)
    target.reset = lambda: None
    with pytest.raises(DrafterError, match="plain KV cache"):
        list(greedy_answers(target, [[1, 2]], batch=2, max_tokens=3, stop_ids=()))
    assert isinstance(MlxTarget(model, ()).cache[0], KVCache)
