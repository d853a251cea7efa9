"""woodcock.runtime.cpu_kernels against mlx-lm's own functions, and their use by MlxTarget."""

import importlib
import threading

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models import activations, base, llama
from mlx_lm.models.cache import make_prompt_cache
from mlx_targets import CONFIGS, tiny_target

from woodcock.runtime import cpu_kernels
from woodcock.runtime.target import MlxTarget


def test_exp_is_accurate_over_the_float32_range_and_zero_below_it():
    x = np.linspace(-86.0, 86.0, 200_001, dtype=np.float32)
    ours = np.array(cpu_kernels.exp(mx.array(x)), dtype=np.float64)
    exact = np.exp(x.astype(np.float64))
    assert np.max(np.abs(ours / exact - 1)) < 1.5e-7
    edges = np.array(cpu_kernels.exp(mx.array([-np.inf, -200.0, -87.8, 0.0, 100.0, np.inf])))
    assert edges[:4].tolist() == [0.0, 0.0, 0.0, 1.0]
    assert np.isfinite(edges[4:]).all() and (edges[4:] > 2e38).all()


def test_swiglu_matches_mlx_lm():
    mx.random.seed(1)
    gate = mx.concatenate(
        [
            mx.random.normal((3, 5, 40)) * 6,
            mx.array([-100.0, 100.0, 0.0])[None, None, :].astype(mx.float32) * mx.ones((3, 5, 3)),
        ],
        axis=-1,
    )
    x = mx.random.normal(gate.shape)
    np.testing.assert_allclose(
        np.array(cpu_kernels.swiglu(gate, x)),
        np.array(activations.swiglu(gate, x)),
        rtol=1e-6,
        atol=1e-6,
    )


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4), (6, 2)])
@pytest.mark.parametrize("rows,length", [(1, 1), (1, 9), (2, 2), (3, 17), (5, 40)])
@pytest.mark.parametrize("mask", [None, "causal"])
def test_attention_matches_mlx_lm(heads, kv_heads, rows, length, mask):
    mx.random.seed(heads * 100 + rows * 10 + length)
    queries = mx.random.normal((1, heads, rows, 16)) * 2
    keys = mx.random.normal((1, kv_heads, length, 16)) * 2
    values = mx.random.normal((1, kv_heads, length, 16))
    args = dict(cache=None, scale=0.25, mask=mask)
    np.testing.assert_allclose(
        np.array(cpu_kernels.scaled_dot_product_attention(queries, keys, values, **args)),
        np.array(base.scaled_dot_product_attention(queries, keys, values, **args)),
        atol=2e-6,
    )


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (6, 2)])
def test_attention_with_a_mask_per_batch_row_matches_mlx_lm(heads, kv_heads):
    """The masks of woodcock.runtime.batch: row b's queries at positions lengths[b] + t."""
    mx.random.seed(heads)
    lengths, rows = [3, 11, 0], 4
    length = max(lengths) + rows
    queries = mx.random.normal((3, heads, rows, 16)) * 2
    keys = mx.random.normal((3, kv_heads, length, 16)) * 2
    values = mx.random.normal((3, kv_heads, length, 16))
    positions = mx.array(lengths)[:, None, None, None] + mx.arange(rows)[None, None, :, None]
    mask = mx.arange(length)[None, None, None, :] <= positions
    args = dict(cache=None, scale=0.25, mask=mask)
    np.testing.assert_allclose(
        np.array(cpu_kernels.scaled_dot_product_attention(queries, keys, values, **args)),
        np.array(base.scaled_dot_product_attention(queries, keys, values, **args)),
        atol=2e-6,
    )


def test_inputs_it_does_not_cover_go_to_mlx_lm_unchanged():
    mx.random.seed(0)
    q, k, v = (
        mx.random.normal((1, 4, 3, 8)),
        mx.random.normal((1, 2, 6, 8)),
        mx.random.normal((1, 2, 6, 8)),
    )
    band = mx.array(np.tril(np.ones((3, 6), bool), 3) & np.triu(np.ones((3, 6), bool), 1))
    cases = [
        (q, k, v, dict(mask=band)),
        (q.astype(mx.float16), k.astype(mx.float16), v.astype(mx.float16), dict(mask="causal")),
        (q, k, v, dict(mask="causal", sinks=mx.zeros((4,)))),
    ]
    for q_, k_, v_, extra in cases:
        ours = cpu_kernels.scaled_dot_product_attention(q_, k_, v_, cache=None, scale=0.3, **extra)
        stock = base.scaled_dot_product_attention(q_, k_, v_, cache=None, scale=0.3, **extra)
        assert mx.array_equal(ours, stock).item()
    gate = mx.random.normal((2, 8)).astype(mx.bfloat16)
    assert mx.array_equal(cpu_kernels.swiglu(gate, gate), activations.swiglu(gate, gate)).item()


class _Counting:
    def __init__(self, function):
        self.function, self.calls = function, 0

    def __call__(self, *args):
        self.calls += 1
        return self.function(*args)


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_a_multi_row_forward_runs_the_kernels_and_a_single_row_does_not(model_type, monkeypatch):
    model = tiny_target(model_type, seed=3, scale=0.3)
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    target = MlxTarget(model, [1, 4])
    assert cpu_kernels.install_kernels(model) == 2 * len(model.layers)  # attention and MLP
    attention = _Counting(cpu_kernels._scaled_exp_parts)
    sigmoid = _Counting(cpu_kernels._negated_exp_parts)
    monkeypatch.setattr(cpu_kernels, "_scaled_exp_parts", attention)
    monkeypatch.setattr(cpu_kernels, "_negated_exp_parts", sigmoid)
    tokens = mx.array([5, 9, 2, 7, 1, 30])

    logits, _ = target.forward(tokens[:4])
    assert (attention.calls, sigmoid.calls) == (4, 4)
    logits_next, _ = target.forward(tokens[4:5])
    assert (attention.calls, sigmoid.calls) == (4, 4)
    assert module.scaled_dot_product_attention is base.scaled_dot_product_attention
    assert module.swiglu is activations.swiglu

    cache = make_prompt_cache(model)
    stock = model(tokens[None, :4], cache=cache)[0]
    stock_next = model(tokens[None, 4:5], cache=cache)[0]
    np.testing.assert_allclose(np.array(logits), np.array(stock), atol=1e-4)
    np.testing.assert_allclose(np.array(logits_next), np.array(stock_next), atol=1e-4)


def _random_model(model_type: str):
    if model_type != "qwen2":
        return tiny_target(model_type, seed=4, scale=0.3)
    module = importlib.import_module("mlx_lm.models.qwen2")
    config = {**CONFIGS["llama"], "model_type": "qwen2"}
    model = module.Model(module.ModelArgs.from_dict(config))
    mx.random.seed(4)
    model.update(tree_map(lambda p: mx.random.normal(p.shape) * 0.3, model.parameters()))
    return model


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_the_installed_forward_is_mlx_lms_own_with_the_kernels(model_type, monkeypatch):
    """Bit for bit what mlx-lm's own modules compute with the kernels in its functions' place
    (so a release of mlx-lm that changes these forwards fails here)."""
    model = _random_model(model_type)
    assert cpu_kernels.install_kernels(model) == 2 * len(model.layers)
    prompt, block = mx.array([5, 9, 2, 7, 1]), mx.array([30, 3, 8])

    def prompt_and_block():
        cache = make_prompt_cache(model)
        return [model(tokens[None], cache=cache) for tokens in (prompt, block)]

    with cpu_kernels.kernels_in_use():
        installed = prompt_and_block()
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    monkeypatch.setattr(
        module, "scaled_dot_product_attention", cpu_kernels.scaled_dot_product_attention
    )
    monkeypatch.setattr(module, "swiglu", cpu_kernels.swiglu)
    for ours, theirs in zip(installed, prompt_and_block(), strict=True):
        assert mx.array_equal(ours, theirs).item()


def _stock_logits(model, tokens):
    logits = model(tokens[None], cache=make_prompt_cache(model))[0]
    mx.eval(logits)
    return logits


def test_installing_leaves_the_parameters_and_every_other_forward_as_they_were():
    model = tiny_target("llama", seed=2, scale=0.3)
    nn.quantize(model, group_size=32, bits=8)
    tokens = mx.array([5, 9, 2, 7, 1])
    before = tree_flatten(model.parameters())
    assert "model.layers.0.self_attn.q_proj.scales" in dict(before)
    stock = _stock_logits(model, tokens)
    assert cpu_kernels.install_kernels(model) == 8
    assert cpu_kernels.install_kernels(model) == 8
    after = tree_flatten(model.parameters())
    assert [name for name, _ in after] == [name for name, _ in before]
    assert all(a is b for (_, a), (_, b) in zip(after, before, strict=True))
    assert isinstance(model.layers[0].self_attn, llama.Attention)
    assert isinstance(model.layers[0].mlp, llama.MLP)
    # a plain mlx-lm forward of several rows (a prompt, training's feature runner): as before
    assert mx.array_equal(_stock_logits(model, tokens), stock).item()
    with cpu_kernels.kernels_in_use():
        fast = _stock_logits(model, tokens)
    np.testing.assert_allclose(np.array(fast), np.array(stock), atol=1e-4)


def test_the_kernels_stop_with_a_failed_forward(monkeypatch):
    model = tiny_target("llama", seed=1)
    cpu_kernels.install_kernels(model)
    sigmoid = _Counting(cpu_kernels._negated_exp_parts)
    monkeypatch.setattr(cpu_kernels, "_negated_exp_parts", sigmoid)
    with pytest.raises(RuntimeError), cpu_kernels.kernels_in_use():
        raise RuntimeError("failed forward")
    _stock_logits(model, mx.array([1, 2, 3]))
    assert sigmoid.calls == 0


def test_a_forward_in_another_thread_during_a_verify_runs_mlx_lms_kernels(monkeypatch):
    model = tiny_target("llama", seed=3, scale=0.3)
    tokens = mx.array([5, 9, 2, 7])
    stock = _stock_logits(model, tokens)
    target = MlxTarget(model, [1, 4])
    verifying, go_on = threading.Event(), threading.Event()
    fast_exp = cpu_kernels._scaled_exp_parts
    callers = []

    def pausing(*args):
        callers.append(threading.current_thread())
        if not verifying.is_set():
            verifying.set()
            go_on.wait(timeout=60)
        return fast_exp(*args)

    monkeypatch.setattr(cpu_kernels, "_scaled_exp_parts", pausing)
    verified = {}

    def verify():
        logits, _ = target.forward(tokens)
        mx.eval(logits)
        verified["logits"] = logits

    thread = threading.Thread(target=verify)
    thread.start()
    try:
        assert verifying.wait(timeout=60)
        # the verify is building its graph on the kernels: mlx-lm's own functions are untouched
        assert llama.scaled_dot_product_attention is base.scaled_dot_product_attention
        assert llama.swiglu is activations.swiglu
        meanwhile = _stock_logits(model, tokens)
    finally:
        go_on.set()
        thread.join(timeout=60)
    assert mx.array_equal(meanwhile, stock).item()
    assert callers and set(callers) == {thread}
    np.testing.assert_allclose(np.array(verified["logits"]), np.array(stock), atol=1e-4)


def test_a_model_of_no_known_family_has_nothing_installed():
    assert cpu_kernels.install_kernels(nn.Sequential(nn.Linear(4, 4), nn.ReLU())) == 0
