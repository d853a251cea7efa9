"""How prompts are cut into prefill forwards: every token once, in order, the shorter chunks on
the CPU once a forward's scores would pass the budget, and the same output whatever the cut."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_targets import tiny_target

from woodcock.runtime import decode
from woodcock.runtime.prefill import CPU_SIZES, GPU_SIZES, PrefillSizes, prefill_sizes
from woodcock.runtime.target import MlxTarget


def covers(spans, length):
    return [s for span in spans for s in range(*span)] == list(range(length))


@pytest.mark.parametrize("sizes", [CPU_SIZES, GPU_SIZES, PrefillSizes(8, 3, 200, 24)])
@pytest.mark.parametrize("length", [1, 2, 127, 256, 257, 511, 4096, 4099])
@pytest.mark.parametrize("rows, cached", [(1, 0), (1, 700), (3, 0)])
def test_spans_cover_the_prompt_once_in_order(sizes, length, rows, cached):
    spans = sizes.spans(length, rows=rows, cached=cached)
    assert covers(spans, length)
    for start, end in spans[:-1]:
        keys = cached + start + sizes.chunk
        too_many = sizes.scores and rows * sizes.chunk * keys > sizes.scores
        assert end - start == (sizes.long_chunk if too_many else sizes.chunk)
    assert sizes.spans(0) == []


def test_the_cpu_takes_shorter_chunks_once_the_keys_are_many():
    lengths = [end - start for start, end in CPU_SIZES.spans(1024)]
    assert lengths == [256, 256] + [128] * 4
    assert {end - start for start, end in CPU_SIZES.spans(1024, cached=600)} == {128}
    assert {end - start for start, end in CPU_SIZES.spans(256, rows=4)} == {128}
    assert {end - start for start, end in GPU_SIZES.spans(4096, rows=32, cached=9000)} == {512}
    assert prefill_sizes() is CPU_SIZES  # the tests run on MLX's CPU backend


@pytest.mark.parametrize(
    "sizes", [CPU_SIZES, GPU_SIZES, PrefillSizes(5, 2, 40, 8), PrefillSizes(1, 1, 0, 1)]
)
def test_the_cut_does_not_change_the_first_token_or_the_cache(sizes):
    model = tiny_target("llama", scale=0.5)
    prompt = np.random.default_rng(3).integers(0, model.args.vocab_size, 300).tolist()
    whole = MlxTarget(model, (1,))
    logits, taps = whole.forward(mx.array(prompt, mx.int32))
    target = MlxTarget(model, (1,))
    last, chunked_taps = decode._prefill(target, mx.array(prompt, mx.int32), sizes=sizes)
    assert target.offset == len(prompt)
    assert mx.argmax(last).item() == mx.argmax(logits[-1]).item()
    assert mx.allclose(last, logits[-1], atol=1e-4).item()
    assert mx.allclose(chunked_taps, taps, atol=1e-4).item()
    for alone, chunked in zip(whole.cache, target.cache, strict=True):
        for a, b in ((alone.keys, chunked.keys), (alone.values, chunked.values)):
            assert mx.allclose(a[..., : len(prompt), :], b[..., : len(prompt), :], atol=1e-4).item()
