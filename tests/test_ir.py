import dataclasses
import json

import numpy as np
import pytest

from woodcock.errors import DrafterError
from woodcock.ir import (
    DecoderLayer,
    Drafter,
    DrafterSpec,
    DSpark,
    Head,
    Taps,
    Target,
    VocabCounts,
    VocabMap,
    spec_from_dict,
    spec_to_dict,
)
from woodcock.synthetic import random_drafter, random_weights, tiny_spec


def replace_layer(spec, index=0, **changes):
    layers = list(spec.layers)
    layers[index] = dataclasses.replace(layers[index], **changes)
    return dataclasses.replace(spec, layers=tuple(layers))


@pytest.mark.parametrize("algorithm", ["eagle3", "dflash", "dspark"])
@pytest.mark.parametrize("style", ["llama", "qwen3"])
def test_valid_specs_build_and_survive_json(algorithm, style):
    spec = tiny_spec(algorithm, style=style, num_layers=2, draft_vocab_size=40, tap_norm="concat")
    drafter = random_drafter(spec)
    assert drafter.spec is spec
    text = json.dumps(spec_to_dict(spec))
    assert spec_from_dict(json.loads(text)) == spec


def test_eagle3_tensor_shapes():
    spec = tiny_spec("eagle3", num_layers=2, style="qwen3", tap_norm="per_tap", draft_vocab_size=50)
    shapes = spec.tensor_shapes()
    h = spec.hidden_size
    assert shapes["fc.weight"] == (h, 3 * h)
    assert [n for n in shapes if n.startswith("fc_norm.")] == [
        f"fc_norm.{j}.weight" for j in range(3)
    ]
    assert shapes["layers.0.self_attn.q_proj.weight"] == (4 * 8, 2 * h)  # [embed ; hidden]
    assert shapes["layers.1.self_attn.q_proj.weight"] == (4 * 8, h)
    assert "layers.0.hidden_norm.weight" in shapes and "layers.1.hidden_norm.weight" not in shapes
    assert shapes["layers.1.self_attn.k_norm.weight"] == (8,)
    assert shapes["lm_head.weight"] == (50, h)
    assert "embed_tokens.weight" not in shapes  # shared with the target


def test_target_hidden_size_may_differ_for_own_heads():
    spec = tiny_spec("eagle3")
    spec = dataclasses.replace(
        spec,
        target=dataclasses.replace(spec.target, hidden_size=48),
        head=Head(lm_head="own", embedding="own"),
    )
    assert spec.tensor_shapes()["fc.weight"] == (32, 3 * 48)


@pytest.mark.parametrize(
    "markov_head_type, extra",
    [
        ("vanilla", {}),
        (
            "gated",
            {"markov_head.gate_proj.weight": (8, 32 + 8), "markov_head.gate_proj.bias": (8,)},
        ),
        (
            "rnn",
            {"markov_head.joint_proj.weight": (24, 16 + 32), "markov_head.joint_proj.bias": (24,)},
        ),
    ],
)
def test_dspark_heads(markov_head_type, extra):
    spec = tiny_spec("dspark", markov_head_type=markov_head_type, draft_vocab_size=60)
    shapes = spec.tensor_shapes()
    assert shapes["markov_head.markov_w1.weight"] == (96, 8)  # indexed by target id
    assert shapes["markov_head.markov_w2.weight"] == (60, 8)  # projects to the draft vocab
    assert shapes["confidence_head.proj.weight"] == (1, 32 + 8)
    for name, shape in extra.items():
        assert shapes[name] == shape
    plain = tiny_spec("dspark", markov_rank=0, confidence_head_with_markov=False)
    assert not any(n.startswith("markov_head") for n in plain.tensor_shapes())
    assert plain.tensor_shapes()["confidence_head.proj.weight"] == (1, 32)


SPEC = tiny_spec("eagle3")
BLOCK = tiny_spec("dflash")


@pytest.mark.parametrize(
    "build, message",
    [
        (
            lambda: dataclasses.replace(SPEC, taps=Taps((1, 2, 5))),
            r"taps.layer_ids\[2\] = 5: expected an id in \[0, 4\]",
        ),
        (lambda: Taps((3, 1)), r"layer_ids = \[3, 1\]: expected strictly ascending"),
        (lambda: Taps((2, 2)), "strictly ascending"),
        (lambda: Taps(()), "at least one tapped layer"),
        (
            lambda: Taps((1,), convention="layer_output"),
            "convention = 'layer_output': expected one of 'after_layers'",
        ),
        (
            lambda: replace_layer(SPEC, num_key_value_heads=3),
            "num_key_value_heads = 3: expected a divisor of num_attention_heads",
        ),
        (lambda: replace_layer(SPEC, head_dim=True), "head_dim = True: expected an integer"),
        (lambda: replace_layer(SPEC, head_dim=7), "head_dim = 7: expected an even number"),
        (lambda: replace_layer(SPEC, rms_norm_eps=0.0), "rms_norm_eps = 0.0"),
        (
            lambda: replace_layer(SPEC, rope_scaling={"rope_type": "magic"}),
            "rope_scaling.rope_type = 'magic'",
        ),
        (
            lambda: replace_layer(SPEC, rope_scaling={"rope_type": "yarn"}),
            r"rope_scaling.factor = None: expected a number \(rope_type 'yarn' needs it\)",
        ),
        (
            lambda: replace_layer(
                SPEC, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1}
            ),
            "rope_scaling.high_freq_factor = None",
        ),
        (
            lambda: replace_layer(SPEC, rope_scaling={"rope_type": "linear", "factor": True}),
            "rope_scaling.factor = True: expected a number",
        ),
        (
            lambda: replace_layer(
                SPEC,
                rope_scaling={"rope_type": "longrope", "short_factor": [1.0], "long_factor": 2.0},
            ),
            "rope_scaling.long_factor = 2.0: expected a list of numbers",
        ),
        (
            lambda: replace_layer(SPEC, style="gpt2"),
            "style = 'gpt2': expected one of 'llama', 'qwen3'",
        ),
        (
            lambda: replace_layer(SPEC, attention="block_causal"),
            r"layers\[0\].attention = 'block_causal': expected 'causal'",
        ),
        (
            lambda: replace_layer(SPEC, input="hidden"),
            r"layers\[0\].input = 'hidden': expected 'embed_and_hidden'",
        ),
        (
            lambda: replace_layer(BLOCK, input="embed_and_hidden"),
            r"layers\[0\].input = 'embed_and_hidden': expected 'hidden'",
        ),
        (
            lambda: replace_layer(BLOCK, attention="causal"),
            "expected 'block_bidirectional' or 'block_causal'",
        ),
        (
            lambda: replace_layer(tiny_spec("eagle3", num_layers=2), 1, hidden_size=64),
            r"layers\[1\].hidden_size = 64: expected 32 like layers\[0\]",
        ),
        (
            lambda: dataclasses.replace(SPEC, draft_vocab_size=97),
            r"draft_vocab_size = 97: expected a size in \[1, 96\]",
        ),
        (
            lambda: dataclasses.replace(
                SPEC, target=dataclasses.replace(SPEC.target, hidden_size=48)
            ),
            "head.embedding = 'shared'",
        ),
        (
            lambda: dataclasses.replace(
                BLOCK, algorithm=dataclasses.replace(BLOCK.algorithm, mask_token_id=96)
            ),
            "algorithm.mask_token_id = 96",
        ),
        (
            lambda: dataclasses.replace(BLOCK.algorithm, block_size=1),
            "block_size = 1: expected room for at least one draft",
        ),
        (
            lambda: dataclasses.replace(
                BLOCK, algorithm=dataclasses.replace(BLOCK.algorithm, block_size=10**12)
            ),
            r"algorithm.block_size = 1000000000000: expected at most the layers' context",
        ),
        (
            lambda: tiny_spec("dspark", markov_rank=0),
            "confidence_head_with_markov = True: expected false when markov_rank is 0",
        ),
        (lambda: tiny_spec("dspark", markov_head_type="lstm"), "markov_head_type = 'lstm'"),
        (
            lambda: dataclasses.replace(
                SPEC, fusion=dataclasses.replace(SPEC.fusion, hidden_norm=True)
            ),
            "fusion.hidden_norm = True",
        ),
        (lambda: dataclasses.replace(SPEC, layers=()), "layers = \\[\\]: expected at least one"),
        (
            lambda: Target(num_hidden_layers=0, hidden_size=8, vocab_size=8),
            "num_hidden_layers = 0: expected a positive integer",
        ),
    ],
)
def test_bad_specs_name_the_field_the_value_and_what_was_expected(build, message):
    with pytest.raises(DrafterError, match=message):
        build()


def test_bad_weights_and_vocab_maps():
    spec = tiny_spec("eagle3", draft_vocab_size=8)
    weights = random_weights(spec)
    ids = np.array([0, 3, 5, 9, 10, 40, 41, 95])

    def build(ids=ids, **changes):
        return Drafter(spec, VocabMap(ids), {**weights, **changes})

    build()  # the baseline is valid
    with pytest.raises(
        DrafterError, match=r"weights\['fc.weight'\].shape = \(32, 95\): expected \(32, 96\)"
    ):
        build(**{"fc.weight": np.zeros((32, 95), np.float32)})
    with pytest.raises(DrafterError, match=r"unexpected tensor\(s\) extra.weight"):
        build(**{"extra.weight": np.zeros(1, np.float32)})
    with pytest.raises(DrafterError, match=r"weights\['norm.weight'\].dtype = 'int32'"):
        build(**{"norm.weight": np.zeros(32, np.int32)})
    missing = dict(weights)
    del missing["norm.weight"]
    with pytest.raises(DrafterError, match=r"missing tensor\(s\) norm.weight"):
        Drafter(spec, VocabMap(ids), missing)
    with pytest.raises(
        DrafterError, match=r"draft_to_target\[7\] = 96: expected a target id in \[0, 96\)"
    ):
        build(ids=np.array([0, 3, 5, 9, 10, 40, 41, 96]))
    with pytest.raises(DrafterError, match=r"draft_to_target\[3\] = 5: .*repeats 5 at \[2\]"):
        build(ids=np.array([0, 3, 5, 5, 10, 40, 41, 95]))
    with pytest.raises(DrafterError, match=r"draft_to_target\[2\] = 1: .*comes after 3"):
        build(ids=np.array([0, 3, 1, 9, 10, 40, 41, 95]))
    with pytest.raises(DrafterError, match=r"draft_to_target.shape = \(3,\): expected \(8,\)"):
        build(ids=np.array([0, 1, 2]))
    with pytest.raises(
        DrafterError, match="draft_to_target = None: expected a map of 8 target ids"
    ):
        build(ids=None)
    full = tiny_spec("eagle3")
    with pytest.raises(DrafterError, match="expected none: the draft vocab is the target's"):
        Drafter(full, VocabMap(np.arange(96)), random_weights(full))


def test_vocab_counts_must_cover_the_target_vocab():
    spec = tiny_spec("eagle3")
    with pytest.raises(DrafterError, match=r"vocab.counts.shape = \(10,\): expected \(96,\)"):
        Drafter(spec, VocabMap(counts=VocabCounts(np.ones(10, np.int64))), random_weights(spec))
    with pytest.raises(DrafterError, match="non-negative"):
        VocabCounts(-np.ones(96, np.int64))


def test_json_form_is_strict():
    data = spec_to_dict(tiny_spec("dspark"))
    data["layers"][0]["flash"] = True
    with pytest.raises(DrafterError, match=r"layers\[0\]: unknown key\(s\) flash"):
        spec_from_dict(data)
    data = spec_to_dict(tiny_spec("dspark"))
    del data["algorithm"]["markov_rank"]
    with pytest.raises(DrafterError, match=r"algorithm: missing key\(s\) markov_rank"):
        spec_from_dict(data)
    data = spec_to_dict(tiny_spec("dspark"))
    data["algorithm"]["name"] = "medusa"
    with pytest.raises(
        DrafterError,
        match="algorithm.name = 'medusa': expected one of 'eagle3', 'dflash', 'dspark'",
    ):
        spec_from_dict(data)
    data = spec_to_dict(tiny_spec("eagle3"))
    del data["layers"][0][
        "rope_scaling"
    ]  # has no Python default, but every key is required on disk
    with pytest.raises(DrafterError, match=r"layers\[0\]: missing key\(s\) rope_scaling"):
        spec_from_dict(data)
    data = spec_to_dict(tiny_spec("eagle3"))
    del data["layers"][0]["mlp_bias"]  # has a Python default; still required on disk
    with pytest.raises(DrafterError, match=r"missing key\(s\) mlp_bias"):
        spec_from_dict(data)
    data = spec_to_dict(tiny_spec("eagle3"))
    data["taps"]["layer_ids"] = [1, 2, 9]
    with pytest.raises(DrafterError, match=r"taps.layer_ids\[2\] = 9"):
        spec_from_dict(data)


def test_ir_is_frozen_and_weights_are_read_only():
    drafter = random_drafter(tiny_spec("eagle3"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        drafter.spec.head = Head(lm_head="shared", embedding="shared")
    with pytest.raises(ValueError):
        drafter.weights["fc.weight"][0, 0] = 1.0
    assert isinstance(drafter.spec.algorithm, type(tiny_spec("eagle3").algorithm))
    assert isinstance(tiny_spec("dspark").algorithm, DSpark)
    assert isinstance(tiny_spec("eagle3").layers[0], DecoderLayer)
    assert isinstance(tiny_spec("eagle3"), DrafterSpec)


def test_parameter_counts_split_own_and_shared():
    spec = tiny_spec("dflash", draft_vocab_size=40)
    spec = dataclasses.replace(spec, head=Head(lm_head="shared", embedding="shared"))
    counts = random_drafter(spec).parameter_counts()
    assert counts["shared"] == 96 * 32 + 40 * 32
    assert counts["own"] == sum(int(np.prod(s)) for s in spec.tensor_shapes().values())
