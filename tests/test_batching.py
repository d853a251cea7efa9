"""Continuous batching with speculation at the loop's level: sequences that join and leave a
SequenceBatch between rounds, each with its own drafter, answer token for token what each gives
alone and what plain mlx-lm decoding gives; sampling with a seed draws the same as alone."""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from test_decode import bf16_tie_target, tied_positions
from test_serve import runtime_pair

from woodcock.errors import DrafterError
from woodcock.runtime import block, eagle3
from woodcock.runtime.batch import SequenceBatch
from woodcock.runtime.decode import (
    GREEDY,
    SpeculativeSequence,
    Stats,
    batched_round,
    speculative_generate_step,
)
from woodcock.runtime.ngram import NgramDrafter
from woodcock.runtime.policy import FixedPolicy
from woodcock.runtime.sampling import Sampling
from woodcock.runtime.target import MlxTarget
from woodcock.serve.batching import DraftingChoice, own_state

PROMPTS = [list(range(10, 30)), [3, 4, 5], list(range(40, 90)), [7, 7, 7, 8], list(range(60, 33, -1))]


def alone(target, drafter, lookup, prompt, max_tokens, sampling=GREEDY, key=None):
    steps = speculative_generate_step(
        prompt, target, drafter, policy=FixedPolicy(3), lookup=lookup, sampling=sampling, key=key
    )
    tokens = []
    for token, _ in steps:
        tokens.append(token)
        if len(tokens) == max_tokens:
            return tokens


def batched(target, drafter, lookup, prompts, max_tokens, *, joins, leaves=None, max_rows=3, sampling=GREEDY, seeds=None, longest=None):
    """Each prompt joins at round joins[i] (when a row is free, else later), runs until
    max_tokens tokens (or leaves[i] rounds after it joined); each one's tokens."""
    batch = SequenceBatch(target, max_rows)
    leaves = leaves or [None] * len(prompts)
    tokens = [[] for _ in prompts]
    running, waiting, joined_at = [], list(range(len(prompts))), {}
    round_number = 0
    while waiting or running:
        for i in [i for i in waiting if joins[i] <= round_number]:
            if len(running) == max_rows:
                break
            waiting.remove(i)
            sequence = SpeculativeSequence(
                prompts[i],
                target,
                own_state(drafter),
                policy=FixedPolicy(3),
                lookup=own_state(lookup) if lookup is not None else None,
                sampling=sampling,
                key=None if seeds is None else mx.random.key(seeds[i]),
            )
            tokens[i] += [step[0] for step in sequence.start()]
            sequence.rows = batch.add(target.cache)
            running.append((i, sequence))
            joined_at[i] = round_number
        round_number += 1
        if not running:
            continue
        for (i, _), steps in zip(running, batched_round(batch, [s for _, s in running], longest), strict=True):
            tokens[i] += [step[0] for step in steps]
        for i, sequence in list(running):
            over = leaves[i] is not None and round_number - joined_at[i] >= leaves[i]
            if len(tokens[i]) >= max_tokens or over:
                batch.remove(sequence.rows)
                running.remove((i, sequence))
                tokens[i] = tokens[i][:max_tokens]
    assert len(batch) == 0
    return tokens


@pytest.mark.parametrize("kind", ["eagle3", "eagle3+lookup", "dflash", "dspark", "ngram"])
def test_every_sequence_of_a_batch_answers_as_it_does_alone(kind):
    target, drafter, lookup = runtime_pair(kind)
    expected = [alone(target, drafter, lookup, p, 24) for p in PROMPTS]
    for prompt, tokens in zip(PROMPTS, expected, strict=True):
        assert tokens == [t for t, _ in generate_step(mx.array(prompt), target.model, max_tokens=24)]
    # joining at different rounds, more prompts than rows: the fourth and fifth wait for a slot
    got = batched(target, drafter, lookup, PROMPTS, 24, joins=[0, 0, 2, 3, 3])
    assert got == expected


def test_a_batch_answers_mlx_lm_s_tokens_where_bf16_rounding_ties_them():
    model = bf16_tie_target()
    target = MlxTarget(model, ())
    expected = [tied_positions(model, p, 24) for p in PROMPTS]
    assert sum(ties for _, ties in expected) >= 2  # the ties this test is about happened
    got = batched(target, NgramDrafter(target.vocab_size), None, PROMPTS, 24, joins=[0, 0, 2, 3, 3])
    assert got == [tokens for tokens, _ in expected]


def test_proposals_cut_short_in_a_batch_change_the_speed_only():
    target, drafter, lookup = runtime_pair("eagle3+lookup")
    prompts = [list(range(10, 20)) * 3, [5, 6, 7, 5, 6, 7, 5, 6], PROMPTS[2]]  # repeats: long copies
    expected = [alone(target, drafter, lookup, p, 30) for p in prompts]
    assert batched(target, drafter, lookup, prompts, 30, joins=[0, 0, 0], longest=2) == expected


@pytest.mark.parametrize(("kind", "module"), [("eagle3+lookup", eagle3), ("dspark", block)])
def test_plain_batched_rounds_draft_nothing_and_keep_the_output(monkeypatch, kind, module):
    target, drafter, lookup = runtime_pair(kind)
    expected = [alone(target, drafter, lookup, p, 20) for p in PROMPTS[:3]]
    calls, together = [], []
    original = drafter.propose
    drafter.propose = lambda *args: calls.append(args) or original(*args)  # own_state copies it
    original_together = module.propose_together

    def spy(drafters, lengths, samplers):
        together.append(list(lengths))
        return original_together(drafters, lengths, samplers)

    monkeypatch.setattr(module, "propose_together", spy)
    assert batched(target, drafter, lookup, PROMPTS[:3], 20, joins=[0, 0, 0], longest=0) == expected
    assert calls == [] and together == []
    assert batched(target, drafter, lookup, PROMPTS[:3], 20, joins=[0, 0, 0], longest=3) == expected
    # the drafters of a batch draft together (each as far as its own policy says), one alone
    # where no other drafts in that round
    assert together and all(len(lengths) > 1 and max(lengths) <= 3 for lengths in together)
    assert all(k <= 3 for k, _ in calls)


def test_drafting_choice_takes_the_faster_way_and_retries_the_other():
    choice = DraftingChoice(explore=4, weight=0.5)
    assert choice.drafts(1) and choice.drafts(3)  # alone: always; 3 requests: not measured yet
    choice.observe(3, True, 12, 0.2)  # 60 tokens/s drafting
    assert not choice.drafts(3)  # plain steps not measured yet
    choice.observe(3, False, 3, 0.1)  # 30 tokens/s plain
    assert [choice.drafts(3) for _ in range(8)] == [True, True, True, False] * 2
    choice.observe(3, True, 2, 0.1)  # drafting slows down: 0.5 * 60 + 0.5 * 20 = 40
    choice.observe(3, True, 2, 0.1)  # 30
    choice.observe(3, True, 1, 0.1)  # 20
    assert choice.rates[(3, True)] == pytest.approx(20.0)
    assert [choice.drafts(3) for _ in range(4)] == [False, False, False, True]
    assert choice.drafts(1) and choice.drafts(2)  # another batch size is measured on its own


def test_a_sequence_that_leaves_mid_batch_leaves_the_others_unchanged():
    target, drafter, lookup = runtime_pair("eagle3")
    expected = [alone(target, drafter, lookup, p, 30) for p in PROMPTS[:3]]
    # the second leaves after two rounds (a cancelled request), its row taken by the last
    got = batched(target, drafter, lookup, PROMPTS[:3], 30, joins=[0, 0, 1], leaves=[None, 2, None], max_rows=2)
    assert got[0] == expected[0] and got[2] == expected[2]
    assert got[1] == expected[1][: len(got[1])] and 2 <= len(got[1]) < 30


def test_sampling_with_a_seed_draws_in_a_batch_what_it_draws_alone():
    target, drafter, lookup = runtime_pair("eagle3")
    sampling = Sampling(temperature=1.0)
    seeds = [11, 12, 13]
    expected = [
        alone(target, drafter, lookup, p, 20, sampling, mx.random.key(s)) for p, s in zip(PROMPTS[:3], seeds, strict=True)
    ]
    again = alone(target, drafter, lookup, PROMPTS[0], 20, sampling, mx.random.key(seeds[0]))
    assert again == expected[0]  # the key decides the draws
    assert expected[0] != alone(target, drafter, lookup, PROMPTS[0], 20, sampling, mx.random.key(99))
    got = batched(target, drafter, lookup, PROMPTS[:3], 20, joins=[0, 1, 1], sampling=sampling, seeds=seeds)
    assert got == expected


def test_batch_rows_roll_back_on_their_own_and_refuse_what_they_cannot():
    target, drafter, lookup = runtime_pair("ngram")
    batch = SequenceBatch(target, 2)
    slots = []
    for prompt in ([1, 2, 3], [4, 5, 6, 7, 8]):
        target.reset()
        mx.eval(target.forward(mx.array(prompt)))
        slots.append(batch.add(target.cache))
    assert [s.offset for s in slots] == [3, 5]
    mx.eval(batch.forward([mx.array([9, 10]), mx.array([11])]))
    assert [s.offset for s in slots] == [5, 6]
    slots[0].rollback(2)
    assert [s.offset for s in slots] == [3, 6]
    with pytest.raises(DrafterError, match="cannot drop 7"):
        slots[1].rollback(7)
    with pytest.raises(DrafterError, match="the batch is full"):
        batch.add(target.cache)
    kept = batch.remove(slots[0])  # the second moves into the first row
    assert kept[0].offset == 3 and slots[1].row == 0 and slots[1].offset == 6
    # what stays in a row is what the sequence computed alone
    target.reset()
    alone_logits, _ = target.forward(mx.array([4, 5, 6, 7, 8, 11, 12]))
    (batch_logits, _), = batch.forward([mx.array([12])])
    assert mx.allclose(batch_logits[0], alone_logits[-1], atol=1e-4)


def test_a_model_whose_cache_cannot_roll_back_per_row_is_refused():
    from mlx_lm.models.cache import RotatingKVCache

    target, _, _ = runtime_pair("ngram")
    target.cache[1] = RotatingKVCache(max_size=8)
    with pytest.raises(DrafterError, match="plain KV cache in every layer; this model's caches are KVCache, RotatingKVCache"):
        SequenceBatch(target, 2)


def test_stats_count_each_sequences_own_rounds():
    target, drafter, lookup = runtime_pair("eagle3")
    batch = SequenceBatch(target, 2)
    sequences = []
    for prompt in PROMPTS[:2]:
        sequence = SpeculativeSequence(prompt, target, own_state(drafter), policy=FixedPolicy(2), stats=Stats())
        sequence.start()
        sequence.rows = batch.add(target.cache)
        sequences.append(sequence)
    for _ in range(3):
        batched_round(batch, sequences[::-1])  # any order
    for sequence in sequences:
        assert sequence.stats.rounds == 3 and sequence.stats.drafted == [2, 2, 2]
        emitted = 1 + sum(sequence.stats.accepted) + 3
        assert sequence.rows.offset == len(sequence.prompt) + emitted - 1  # all but the anchor
