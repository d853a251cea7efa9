"""Exactness under stress: long generations with many rollbacks, prompts longer than the
prefill chunk and the drafter's window, every draft length 1..16, both drafter kinds, EOS and
stop strings at every position of an accepted run, a target with a rotating KV cache (sliding
window layers) and a 4-bit quantized target; sampling follows the target (chi-square)."""

from __future__ import annotations

import dataclasses
import importlib

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from helpers import generate_tokens, plain_greedy
from mlx.utils import tree_map
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_targets import tiny_target
from stats_helpers import chi_square_exceeds, exact_marginals

from woodcock.demo import bigram_drafter, write_tiny_target
from woodcock.errors import DrafterError
from woodcock.runtime.block import BlockDrafter
from woodcock.runtime.decode import Stats, speculative_generate_step
from woodcock.runtime.eagle3 import Eagle3Drafter
from woodcock.runtime.generate import finish_text
from woodcock.runtime.ngram import NgramDrafter
from woodcock.runtime.policy import FixedPolicy
from woodcock.runtime.prefill import prefill_sizes
from woodcock.runtime.sampling import Sampling
from woodcock.runtime.target import MlxTarget
from woodcock.synthetic import random_drafter, tiny_spec

BLOCK_SIZE = 16  # with sample_from_anchor: 16 drafts a round


def random_spec(model, algorithm, *, taps, window=None, **fields):
    facts = MlxTarget(model, ())  # what the runtime reads off the model, whatever its family
    spec = tiny_spec(
        algorithm,
        style="qwen3" if algorithm != "eagle3" else "llama",
        hidden_size=facts.hidden_size,
        vocab_size=facts.vocab_size,
        target_layers=facts.num_layers,
        taps=taps,
        **({"tap_norm": "per_tap"} if algorithm == "eagle3" else {}),
        **fields,
    )
    layers = tuple(
        dataclasses.replace(layer, sliding_window=window, max_position_embeddings=8192)
        for layer in spec.layers
    )
    return dataclasses.replace(spec, layers=layers)


def runtime_drafter(kind, model, *, window=None, seed=5):
    """A random (so often wrong) drafter of `kind` for `model`, with its target."""
    facts = MlxTarget(model, ())
    layers = facts.num_layers
    if kind == "eagle3":
        spec = random_spec(model, "eagle3", taps=(0, layers // 2, layers), window=window)
    else:
        spec = random_spec(
            model,
            "dspark",
            taps=(1, layers),
            window=window,
            block_size=BLOCK_SIZE,
            sample_from_anchor=True,
            markov_head_type="vanilla",
            mask_token_id=facts.vocab_size - 1,
        )
    drafter = random_drafter(spec, seed=seed)
    target = MlxTarget(model, spec.taps.layer_ids)
    shared = target.shared_tensors()
    runtime = Eagle3Drafter(drafter, shared) if kind == "eagle3" else BlockDrafter(drafter, shared)
    return target, runtime


@pytest.fixture(scope="module")
def model():
    return tiny_target("qwen3", scale=0.5)


@pytest.fixture(scope="module", params=["eagle3", "block"])
def pair(request, model):
    return request.param, *runtime_drafter(request.param, model)


def test_a_long_generation_with_many_rollbacks_is_the_targets_own(model, pair):
    kind, target, drafter = pair
    stats = Stats()
    prompt = [3, 14, 15, 92, 65]
    got = generate_tokens(prompt, target, drafter, max_tokens=1000, num_draft=4, stats=stats)
    assert got == plain_greedy(model, prompt, 1000)
    rejected_rounds = sum(a < d for a, d in zip(stats.accepted, stats.drafted, strict=True))
    assert rejected_rounds > 300, "the drafter should be wrong often"


def test_every_draft_length_from_1_to_16(model, pair):
    kind, target, drafter = pair
    prompt = [7, 1, 8, 2, 8]
    expected = plain_greedy(model, prompt, 40)
    for k in range(1, 17):
        stats = Stats()
        got = generate_tokens(
            prompt, target, drafter, max_tokens=40, policy=FixedPolicy(k), stats=stats
        )
        assert got == expected, k
        assert max(stats.drafted) == k


@pytest.mark.parametrize("kind", ["eagle3", "block"])
def test_prompts_longer_than_the_prefill_chunk_and_the_drafter_window(model, kind):
    target, drafter = runtime_drafter(kind, model, window=24)
    rng = np.random.default_rng(1)
    # one token past the first prefill forward, and into the fourth (on a CPU: of the shorter
    # chunks taken once the keys are many)
    spans = prefill_sizes().spans(1 << 12)
    for length in (spans[0][1] + 1, spans[3][0] + 37):
        prompt = rng.integers(0, model.args.vocab_size, length).tolist()
        got = generate_tokens(prompt, target, drafter, max_tokens=48, num_draft=5)
        assert got == plain_greedy(model, prompt, 48), length


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo target and its bigram drafter: right most of the time, so accepted runs are long."""
    path = write_tiny_target(tmp_path_factory.mktemp("demo") / "target")
    model, tokenizer = load(str(path))
    drafter = bigram_drafter(path)
    target = MlxTarget(model, drafter.spec.taps.layer_ids)
    return model, tokenizer, target, Eagle3Drafter(drafter, target.shared_tensors())


def accepted_runs(stats: Stats, emitted: int, longest: int):
    """(first position, length) of each round's emitted tokens (accepted drafts + the target's
    own) with at least `longest` of them, within `emitted` tokens."""
    start = 0
    for accepted in stats.accepted:
        length = accepted + 1
        if length >= longest and start + length <= emitted:
            yield start, length
        start += length


def test_eos_and_stop_strings_at_every_position_of_an_accepted_run(demo):
    model, tokenizer, target, drafter = demo
    prompt = tokenizer.encode("The quick brown fox")
    k = 6
    stats = Stats()
    reference = generate_tokens(prompt, target, drafter, max_tokens=120, num_draft=k, stats=stats)
    assert reference == plain_greedy(model, prompt, 120)
    runs = list(accepted_runs(stats, len(reference), longest=4))
    assert len(runs) >= 2, "the bigram drafter should have long accepted runs"
    checked = 0
    for start, length in runs[:3]:
        for position in range(start, start + length):
            # EOS: the token at `position`, wherever it occurs first
            eos = (reference[position],)
            got = generate_tokens(prompt, target, drafter, max_tokens=120, num_draft=k, eos_ids=eos)
            assert got == plain_greedy(model, prompt, 120, eos), position
            # stop string: the text of the tokens from `position` on (it may span rounds)
            stop = tokenizer.decode(reference[position : position + 2])
            if not stop.strip():
                continue
            fast = speculative_generate_step(prompt, target, drafter, policy=FixedPolicy(k))
            slow = generate_step(mx.array(prompt), model, max_tokens=120)
            got_text = finish_text((t for t, _ in fast), tokenizer, max_tokens=120, stop=[stop])
            want = finish_text((t for t, _ in slow), tokenizer, max_tokens=120, stop=[stop])
            assert (got_text.text, got_text.tokens) == (want.text, want.tokens), position
            assert want.finish_reason == "stop"
            checked += 1
    assert checked >= 4


def scaled(model, scale: float, seed: int):
    mx.random.seed(seed)
    model.update(
        tree_map(
            lambda p: mx.random.normal(p.shape) * scale * (p.ndim > 1) + (p.ndim == 1),
            model.parameters(),
        )
    )
    mx.eval(model.parameters())
    return model


def sliding_window_target(vocab_size=96, window=8):
    """Gemma-3-style: every other layer attends over a sliding window of `window` tokens, and
    mlx-lm gives those layers a RotatingKVCache."""
    module = importlib.import_module("mlx_lm.models.gemma3_text")
    config = dict(
        model_type="gemma3_text",
        hidden_size=64,
        num_hidden_layers=4,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=vocab_size,
        sliding_window=window,
        sliding_window_pattern=2,
        rms_norm_eps=1e-6,
        query_pre_attn_scalar=16,
        max_position_embeddings=4096,
    )
    return scaled(module.Model(module.ModelArgs.from_dict(config)), 0.5, seed=2)


def test_the_sliding_window_target_really_rotates():
    model = sliding_window_target()
    kinds = [type(c).__name__ for c in model.make_cache()]
    assert "RotatingKVCache" in kinds


@pytest.mark.parametrize("kind", ["eagle3", "block"])
def test_greedy_with_a_rotating_cache_target(kind):
    model = sliding_window_target()
    target, drafter = runtime_drafter(kind, model)
    for prompt in ([1, 2, 3], list(range(10, 40))):
        got = generate_tokens(prompt, target, drafter, max_tokens=200, num_draft=4)
        assert got == plain_greedy(model, prompt, 200)


@pytest.mark.parametrize("family", ["qwen2", "gemma4_text", "gemma3", "gpt2"])
@pytest.mark.parametrize("kind", ["eagle3", "block", "ngram"])
def test_greedy_on_targets_built_unlike_the_common_families(family, kind):
    """mlx_targets.CONFIGS says what each family does differently: the runtime must find the
    layer list the forward runs, a layer's hidden state in what it returns, and the token
    embedding under its family's name."""
    model = tiny_target(family, scale=0.5, seed=1)
    if kind == "ngram":
        target = MlxTarget(model, ())
        drafter = NgramDrafter(target.vocab_size)
    else:
        target, drafter = runtime_drafter(kind, model)
    prompt = [5, 6, 7, 8, 9, 5, 6, 7]
    assert generate_tokens(prompt, target, drafter, max_tokens=40, num_draft=4) == plain_greedy(
        model, prompt, 40
    )


def test_a_target_whose_head_has_its_own_name_is_refused_a_shared_head_drafter():
    """internlm2 calls its head `output`: a drafter that shares the target's head is refused
    (not given the embedding in its place); prompt lookup needs no head and runs."""
    model = tiny_target("internlm2", scale=0.5, seed=1)
    with pytest.raises(DrafterError, match="its head is not one `lm_head`"):
        runtime_drafter("eagle3", model)
    target = MlxTarget(model, ())
    prompt = [5, 6, 7, 8, 9, 5, 6, 7]
    got = generate_tokens(
        prompt, target, NgramDrafter(target.vocab_size), max_tokens=20, num_draft=4
    )
    assert got == plain_greedy(model, prompt, 20)


def quantized_target(vocab_size=96, num_hidden_layers=4):
    model = tiny_target(
        "qwen3", seed=3, scale=0.5, vocab_size=vocab_size, num_hidden_layers=num_hidden_layers
    )
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("kind", ["eagle3", "block"])
def test_greedy_with_a_4bit_target(kind):
    model = quantized_target()
    assert hasattr(model.model.layers[0].self_attn.q_proj, "scales")
    target, drafter = runtime_drafter(kind, model)
    for prompt in ([1, 2, 3], list(range(10, 40))):
        got = generate_tokens(prompt, target, drafter, max_tokens=300, num_draft=4)
        assert got == plain_greedy(model, prompt, 300)


def sampled_marginals(model, kind, prompt, runs, sampling):
    vocab = model.args.vocab_size
    target, drafter = runtime_drafter(kind, model, seed=9)
    first, second = np.zeros(vocab), np.zeros(vocab)
    for seed in range(runs):
        mx.random.seed(seed)
        tokens = generate_tokens(
            prompt, target, drafter, max_tokens=2, num_draft=3, sampling=sampling
        )
        first[tokens[0]] += 1
        second[tokens[1]] += 1
    return first, second


def test_sampling_with_a_4bit_target_follows_the_target():
    model = quantized_target(vocab_size=12, num_hidden_layers=2)
    sampling = Sampling(temperature=1.0)
    prompt = [3, 1, 4]
    first_p, second_p = exact_marginals(model, prompt, sampling, 2)
    first, second = sampled_marginals(model, "eagle3", prompt, 1200, sampling)
    assert not chi_square_exceeds(first, first_p)
    assert not chi_square_exceeds(second, second_p)


def test_sampling_with_a_rotating_cache_target_follows_the_target():
    model = sliding_window_target(vocab_size=12, window=4)
    sampling = Sampling(temperature=1.0)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5]  # longer than the window: the cache has rotated
    first_p, second_p = exact_marginals(model, prompt, sampling, 2)
    first, second = sampled_marginals(model, "eagle3", prompt, 600, sampling)
    assert not chi_square_exceeds(first, first_p)
    assert not chi_square_exceeds(second, second_p)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["eagle3", "block"])
def test_long_generations_from_long_prompts_at_every_draft_length(model, kind):
    target, drafter = runtime_drafter(kind, model, window=24)
    rng = np.random.default_rng(7)
    prompt = rng.integers(0, model.args.vocab_size, 2 * prefill_sizes().chunk + 5).tolist()
    expected = plain_greedy(model, prompt, 160)  # the drafter's window of 24 wraps 6 times
    for k in range(1, 17):
        got = generate_tokens(prompt, target, drafter, max_tokens=160, policy=FixedPolicy(k))
        assert got == expected, k
