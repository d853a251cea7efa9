"""SafeAILab and SpecForge EAGLE-3, z-lab DFlash, DeepSpec and SpecForge DSpark: tiny checkpoints
built here the way the reference notes and the public sources describe their files, read into
the IR; write/read round trips; and what each reader and writer refuses, in one line."""

import dataclasses
import json

import ml_dtypes
import numpy as np
import pytest
from helpers import assert_same_drafter, base_is_mmap

from woodcock.cli import main
from woodcock.errors import DrafterError
from woodcock.formats import deepspec, safeailab, specforge, specforge_dspark, zlab_dflash
from woodcock.formats.detect import FORMATS, detect, format_named
from woodcock.ir import Head, Taps
from woodcock.synthetic import random_drafter, tiny_spec
from woodcock.tensorfile import read_safetensors, write_safetensors

V, VD, H, HEADS, KV, FFN = 96, 40, 32, 4, 2, 64
RNG = np.random.default_rng(0)


def rand(*shape, dtype=np.float32):
    return (0.1 * RNG.standard_normal(shape)).astype(dtype)


def write_config(path, config):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))


def edit_config(path, edit):
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))


def edit_tensors(path, edit):
    tensors, metadata = read_safetensors(path / "model.safetensors")
    tensors = {k: np.array(v) for k, v in tensors.items()}
    edit(tensors)
    write_safetensors(path / "model.safetensors", tensors, metadata)


def only_format(path):
    """The one format whose signature matches (detection must be unambiguous)."""
    matching = [fmt.NAME for fmt in FORMATS if fmt.matches(path)]
    assert len(matching) == 1, matching
    return matching[0]


def one_line(error):
    assert "\n" not in str(error.value)
    return str(error.value)


# ---------------------------------------------------------------------------------------------
# EAGLE-3 checkpoints (1 Llama layer; d2t offsets and t2d mask for a 40-of-96 draft vocabulary)

DRAFT_IDS = np.sort(RNG.choice(V, VD, replace=False)).astype(np.int64)


def eagle3_tensors(prefix="midlayer.", head_dim=H // HEADS, dtype=np.float32):
    q, kv = HEADS * head_dim, KV * head_dim
    tensors = {
        "fc.weight": rand(H, 3 * H, dtype=dtype),
        f"{prefix}hidden_norm.weight": 1 + rand(H, dtype=dtype),
        f"{prefix}input_layernorm.weight": 1 + rand(H, dtype=dtype),
        f"{prefix}self_attn.q_proj.weight": rand(q, 2 * H, dtype=dtype),
        f"{prefix}self_attn.k_proj.weight": rand(kv, 2 * H, dtype=dtype),
        f"{prefix}self_attn.v_proj.weight": rand(kv, 2 * H, dtype=dtype),
        f"{prefix}self_attn.o_proj.weight": rand(H, q, dtype=dtype),
        f"{prefix}post_attention_layernorm.weight": 1 + rand(H, dtype=dtype),
        f"{prefix}mlp.gate_proj.weight": rand(FFN, H, dtype=dtype),
        f"{prefix}mlp.up_proj.weight": rand(FFN, H, dtype=dtype),
        f"{prefix}mlp.down_proj.weight": rand(H, FFN, dtype=dtype),
        "norm.weight": 1 + rand(H, dtype=dtype),
        "lm_head.weight": rand(VD, H, dtype=dtype),
    }
    t2d = np.zeros(V, np.bool_)
    t2d[DRAFT_IDS] = True
    tensors["d2t"] = DRAFT_IDS - np.arange(VD)
    tensors["t2d"] = t2d
    return tensors


def safeailab_config():
    """eagle/traineagle3/config.json, shrunk."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": H,
        "initializer_range": 0.02,
        "intermediate_size": FFN,
        "max_position_embeddings": 2048,
        "model_type": "llama",
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV,
        "num_hidden_layers": 1,
        "pad_token_id": 0,
        "rms_norm_eps": 1e-05,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        "transformers_version": "4.28.1",
        "use_cache": True,
        "vocab_size": V,
        "draft_vocab_size": VD,
    }


@pytest.fixture
def safeailab_dir(tmp_path):
    path = tmp_path / "safeailab"
    write_config(path, safeailab_config())
    tensors = eagle3_tensors()
    write_safetensors(path / "model.safetensors", tensors)
    return path, tensors


def test_safeailab_checkpoint_reads_with_taps(safeailab_dir):
    path, tensors = safeailab_dir
    assert only_format(path) == "safeailab"
    with pytest.raises(DrafterError, match="does not store its taps") as info:
        safeailab.read(path)
    one_line(info)
    drafter = safeailab.read(path, taps=[2, 18, 33])
    spec = drafter.spec
    assert spec.taps.layer_ids == (2, 18, 33) and spec.target.num_hidden_layers is None
    layer = spec.layers[0]
    assert (layer.style, layer.input, layer.head_dim, layer.num_key_value_heads) == (
        "llama",
        "embed_and_hidden",
        H // HEADS,
        KV,
    )
    assert (layer.rms_norm_eps, layer.rope_theta, layer.rope_scaling) == (1e-5, 10000.0, None)
    assert spec.head == Head(lm_head="own", embedding="shared")
    assert (spec.algorithm.norm_before_residual, spec.algorithm.norm_output) == (False, False)
    assert np.array_equal(drafter.vocab.draft_to_target, DRAFT_IDS)
    for name, array in tensors.items():
        if name not in ("d2t", "t2d"):
            canonical = name.replace("midlayer.", "layers.0.")
            assert drafter.weights[canonical].tobytes() == array.tobytes()


def test_safeailab_reads_pytorch_model_bin_first(tmp_path):
    torch = pytest.importorskip("torch")
    path = tmp_path / "bin"
    write_config(path, safeailab_config())
    tensors = eagle3_tensors(dtype=ml_dtypes.bfloat16)
    state = {
        name: torch.from_numpy(a.view(np.uint16).astype(np.int16)).view(torch.bfloat16)
        if a.dtype == ml_dtypes.bfloat16
        else torch.from_numpy(a)
        for name, a in tensors.items()
    }
    state["embed_tokens.weight"] = torch.from_numpy(rand(V, H)).to(torch.bfloat16)
    torch.save(state, path / "pytorch_model.bin")
    drafter = safeailab.read(path, taps=[2, 4, 5])
    assert drafter.spec.head.embedding == "own"
    weight = drafter.weights["layers.0.self_attn.q_proj.weight"]
    assert weight.dtype == ml_dtypes.bfloat16
    assert weight.tobytes() == tensors["midlayer.self_attn.q_proj.weight"].tobytes()
    # views of the file itself (not of torch's map): converting copies and releases them
    assert all(base_is_mmap(a) for a in drafter.weights.values())
    assert drafter.weights["embed_tokens.weight"].tobytes() == (
        state["embed_tokens.weight"].view(torch.int16).numpy().tobytes()
    )
    (path / "pytorch_model.bin").write_bytes(b"not a zip")
    with pytest.raises(DrafterError, match="not a readable torch state dict"):
        safeailab.read(path, taps=[2, 4, 5])


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c.update(head_dim=16), "head_dim = 16: SafeAILab ignores it"),
        (lambda c: c.update(attention_bias=True), "attention_bias = true"),
        (lambda c: c.update(rope_scaling={"type": "dynamic", "factor": 2.0}), "only linear"),
        (lambda c: c.update(qk_layernorm=True), r"unknown key\(s\) qk_layernorm"),
        (lambda c: c.update(target_hidden_size=H), "embed_tokens.weight, which is missing"),
        (lambda c: c.pop("draft_vocab_size"), "missing key draft_vocab_size"),
    ],
)
def test_safeailab_refusals(safeailab_dir, edit, message):
    path, _ = safeailab_dir
    edit_config(path, edit)
    with pytest.raises(DrafterError, match=message) as info:
        safeailab.read(path, taps=[2, 4, 5])
    one_line(info)


def test_safeailab_linear_rope_runs_at_base_10000(safeailab_dir):
    path, _ = safeailab_dir
    edit_config(
        path, lambda c: c.update(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0})
    )
    layer = safeailab.read(path, taps=[2, 4, 5]).spec.layers[0]
    assert (layer.rope_theta, layer.rope_scaling) == (
        10000.0,
        {"rope_type": "linear", "factor": 2.0},
    )


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda t: t.pop("d2t"), "there is no d2t"),
        (lambda t: t["d2t"].__setitem__(0, t["d2t"][0] + 1), "d2t and t2d disagree"),
        (lambda t: t.update({"layers.1.mlp.up_proj.weight": rand(FFN, H)}), "unexpected tensor"),
    ],
)
def test_safeailab_bad_tensors(safeailab_dir, damage, message):
    path, _ = safeailab_dir
    edit_tensors(path, damage)
    with pytest.raises(DrafterError, match=message) as info:
        safeailab.read(path, taps=[2, 4, 5])
    one_line(info)


def specforge_config(**extra):
    """configs/qwen3-4b-eagle3.json, shrunk (head_dim honoured: 16, not hidden / heads)."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "head_dim": 16,
        "hidden_act": "silu",
        "hidden_size": H,
        "initializer_range": 0.02,
        "intermediate_size": FFN,
        "max_position_embeddings": 40960,
        "max_window_layers": 36,
        "model_type": "llama",
        "num_attention_heads": HEADS,
        "num_hidden_layers": 1,
        "num_key_value_heads": KV,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": V,
        "draft_vocab_size": VD,
        **extra,
    }


@pytest.fixture
def specforge_dir(tmp_path):
    path = tmp_path / "specforge"
    write_config(path, specforge_config())
    tensors = eagle3_tensors(head_dim=16)  # the SGLang export: no embedding
    write_safetensors(path / "model.safetensors", tensors)
    return path, tensors


def test_specforge_sglang_export_reads(specforge_dir):
    path, tensors = specforge_dir
    assert only_format(path) == "specforge"
    with pytest.raises(DrafterError, match="is not recorded: .* pass them with --taps") as info:
        specforge.read(path)
    one_line(info)
    drafter = specforge.read(path, taps=[2, 18, 33])
    spec = drafter.spec
    assert spec.layers[0].head_dim == 16 and spec.layers[0].rope_theta == 1e6
    assert spec.head == Head(lm_head="own", embedding="shared")
    assert spec.fusion.tap_norm == "none"
    assert np.array_equal(drafter.vocab.draft_to_target, DRAFT_IDS)


def test_specforge_records_taps_output_of_layer(specforge_dir):
    path, _ = specforge_dir
    edit_config(
        path, lambda c: c.update(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 17, 32]})
    )
    assert specforge.read(path).spec.taps.layer_ids == (2, 18, 33)
    with pytest.raises(DrafterError, match=r"--taps \[1, 17, 32\] disagrees"):
        specforge.read(path, taps=[1, 17, 32])


def test_specforge_hf_export_with_embedding_and_fc_norm(specforge_dir):
    path, _ = specforge_dir
    edit_config(path, lambda c: c.update(fc_norm=True))
    edit_tensors(
        path,
        lambda t: t.update(
            {
                "embed_tokens.weight": rand(V, H),
                **{f"fc_norm.{j}.weight": rand(H) for j in range(3)},
            }
        ),
    )
    spec = specforge.read(path, taps=[2, 4, 5]).spec
    assert spec.fusion.tap_norm == "per_tap" and spec.head.embedding == "own"


@pytest.mark.parametrize("value", [True, False])
def test_specforge_norm_output_is_ambiguous(specforge_dir, value):
    path, _ = specforge_dir
    edit_config(path, lambda c: c.update(norm_output=value))
    with pytest.raises(DrafterError, match="PR #879") as info:
        specforge.read(path, taps=[2, 4, 5])
    one_line(info)


def test_specforge_identity_buffers_for_a_full_vocabulary(tmp_path):
    spec = dataclasses.replace(tiny_spec("eagle3"), head=Head(lm_head="own", embedding="own"))
    drafter = random_drafter(spec)
    specforge.write(drafter, tmp_path / "s")
    tensors, _ = read_safetensors(tmp_path / "s" / "model.safetensors")
    assert not tensors["d2t"].any() and tensors["t2d"].all()  # SGLang's exporter needs both
    assert specforge.read(tmp_path / "s").vocab.draft_to_target is None


# ---------------------------------------------------------------------------------------------
# Block checkpoints (2 Qwen3 layers, 3 taps, 8 target layers)


def block_tensors(layers=2, head_dim=8):
    q, kv = HEADS * head_dim, KV * head_dim
    tensors = {
        "fc.weight": rand(H, 3 * H),
        "hidden_norm.weight": 1 + rand(H),
        "norm.weight": 1 + rand(H),
    }
    for i in range(layers):
        p = f"layers.{i}."
        tensors.update(
            {
                p + "input_layernorm.weight": 1 + rand(H),
                p + "post_attention_layernorm.weight": 1 + rand(H),
                p + "self_attn.q_proj.weight": rand(q, H),
                p + "self_attn.k_proj.weight": rand(kv, H),
                p + "self_attn.v_proj.weight": rand(kv, H),
                p + "self_attn.o_proj.weight": rand(H, q),
                p + "self_attn.q_norm.weight": 1 + rand(head_dim),
                p + "self_attn.k_norm.weight": 1 + rand(head_dim),
                p + "mlp.gate_proj.weight": rand(FFN, H),
                p + "mlp.up_proj.weight": rand(FFN, H),
                p + "mlp.down_proj.weight": rand(H, FFN),
            }
        )
    return tensors


def qwen3_config(layers=2):
    return {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "head_dim": 8,
        "hidden_act": "silu",
        "hidden_size": H,
        "initializer_range": 0.02,
        "intermediate_size": FFN,
        "layer_types": ["full_attention"] * layers,
        "max_position_embeddings": 40960,
        "max_window_layers": layers,
        "model_type": "qwen3",
        "num_attention_heads": HEADS,
        "num_hidden_layers": layers,
        "num_key_value_heads": KV,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": V,
    }


@pytest.fixture
def zlab_dir(tmp_path):
    """configs/qwen3-4b-dflash.json (z-lab's Qwen3-*-DFlash-b16 layout), shrunk."""
    path = tmp_path / "zlab"
    write_config(
        path,
        {
            "architectures": ["DFlashDraftModel"],
            "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
            "block_size": 16,
            "dflash_config": {"mask_token_id": 95, "target_layer_ids": [1, 3, 5]},
            "dtype": "bfloat16",
            "num_target_layers": 8,
            **qwen3_config(),
        },
    )
    write_safetensors(path / "model.safetensors", block_tensors())
    return path


def test_zlab_checkpoint_reads(zlab_dir):
    assert only_format(zlab_dir) == "zlab-dflash"
    drafter = zlab_dflash.read(zlab_dir)
    spec = drafter.spec
    assert spec.taps.layer_ids == (2, 4, 6)  # output of layer i = after i + 1 layers
    assert spec.target.num_hidden_layers == 8
    algorithm = spec.algorithm
    assert (algorithm.name, algorithm.block_size, algorithm.mask_token_id) == ("dflash", 16, 95)
    assert algorithm.sample_from_anchor is False and algorithm.num_drafts == 15
    assert spec.head == Head(lm_head="shared", embedding="shared")
    assert spec.fusion.hidden_norm and spec.fusion.tap_norm == "none"
    assert all(
        layer.attention == "block_bidirectional" and layer.style == "qwen3" for layer in spec.layers
    )
    assert spec.layers[0].rope_theta == 1e6 and drafter.vocab.draft_to_target is None


def test_zlab_block_size_inside_dflash_config(zlab_dir):
    def move(c):
        c["dflash_config"]["block_size"] = c.pop("block_size")

    edit_config(zlab_dir, move)
    assert zlab_dflash.read(zlab_dir).spec.algorithm.block_size == 16


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda c: c["dflash_config"].pop("target_layer_ids"),
            r"dflash_config.target_layer_ids is not recorded: .* --taps",
        ),
        (
            lambda c: c["dflash_config"].update(target_layer_ids=[1, 3, 7]),
            r"includes the last target layer \(7\)",
        ),
        (lambda c: c["dflash_config"].update(target_layer_ids=[3, 1, 5]), "strictly ascending"),
        (
            lambda c: c["dflash_config"].pop("mask_token_id"),
            "missing key dflash_config.mask_token_id",
        ),
        (
            lambda c: c["dflash_config"].update(causal=True),
            r"dflash_config: unknown key\(s\) causal",
        ),
        (
            lambda c: c.update(
                layer_types=["full_attention", "sliding_attention"], sliding_window=8
            ),
            "sliding-window layers in a block are not supported",
        ),
        (lambda c: c.pop("block_size"), "missing key block_size"),
        (
            lambda c: c.pop("intermediate_size"),
            r"mlp.gate_proj.weight'\]\.shape = \(64, 32\): expected \(22016, 32\) from the spec"
            r" \(config.json does not state intermediate_size; the Hugging Face class default"
            r" 22016 was taken\)",
        ),
    ],
)
def test_zlab_refusals(zlab_dir, edit, message):
    edit_config(zlab_dir, edit)
    with pytest.raises(DrafterError, match=message) as info:
        zlab_dflash.read(zlab_dir)
    one_line(info)


def test_specforge_exports_of_block_drafters_read_with_the_sizes_they_copy_in(
    zlab_dir, specforge_dspark_dir
):
    """SpecForge's export writes draft_vocab_size = vocab_size into its DFlash and DSpark
    configs, and one of its DSpark configs "target_hidden_size": null: keys its block drafters
    never read. Read where they say nothing new; another size is refused."""
    for path, read in ((zlab_dir, zlab_dflash.read), (specforge_dspark_dir, specforge_dspark.read)):
        before = read(path).spec
        edit_config(
            path, lambda c: c.update(draft_vocab_size=c["vocab_size"], target_hidden_size=None)
        )
        assert read(path).spec == before
        edit_config(path, lambda c: c.update(target_hidden_size=c["hidden_size"]))
        assert read(path).spec == before
        edit_config(path, lambda c: c.update(draft_vocab_size=c["vocab_size"] // 2))
        with pytest.raises(
            DrafterError, match=r"draft_vocab_size = \d+: expected null or vocab_size"
        ) as info:
            read(path)
        one_line(info)


def test_specforge_eagle3_configs_copied_from_targets_read(specforge_dir):
    path, _ = specforge_dir
    before = specforge.read(path, taps=[2, 18, 33]).spec
    edit_config(path, lambda c: c.update(target_model_type="gemma3_text", decoder_sparse_step=1))
    assert specforge.read(path, taps=[2, 18, 33]).spec == before


def test_zlab_taps_from_the_command_line(zlab_dir):
    edit_config(zlab_dir, lambda c: c["dflash_config"].pop("target_layer_ids"))
    assert zlab_dflash.read(zlab_dir, taps=[2, 4, 6]).spec.taps.layer_ids == (2, 4, 6)


def test_zlab_preview_with_its_own_head_is_refused(zlab_dir):
    edit_tensors(zlab_dir, lambda t: t.update({"embed_tokens.weight": rand(V, H)}))
    with pytest.raises(DrafterError, match="also stores embed_tokens.weight"):
        zlab_dflash.read(zlab_dir)


def deepspec_config(**changes):
    """deepspec/modeling/dspark/qwen3/config.py build_draft_config on a copied Qwen3 config."""
    config = {
        "architectures": ["Qwen3DSparkModel"],
        **qwen3_config(),
        "torch_dtype": "bfloat16",
        "transformers_version": "4.57.0",
        "num_target_layers": 8,
        "block_size": 7,
        "mask_token_id": 95,
        "target_layer_ids": [-1, 3, 5],
        "num_anchors": 512,
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
        "markov_rank": 8,
        "markov_head_type": "vanilla",
    }
    config.update(changes)
    return config


@pytest.fixture
def deepspec_dir(tmp_path):
    path = tmp_path / "deepspec"
    write_config(path, deepspec_config())
    tensors = block_tensors()
    tensors.update(
        {
            "embed_tokens.weight": rand(V, H),
            "lm_head.weight": rand(V, H),
            "markov_head.markov_w1.weight": rand(V, 8),
            "markov_head.markov_w2.weight": rand(V, 8),
            "confidence_head.proj.weight": rand(1, H + 8),
            "confidence_head.proj.bias": rand(1),
        }
    )
    write_safetensors(path / "model.safetensors", tensors)
    return path


def test_deepspec_checkpoint_reads(deepspec_dir, tmp_path):
    assert only_format(deepspec_dir) == "deepspec-dspark"
    drafter = deepspec.read(deepspec_dir)
    spec = drafter.spec
    assert spec.taps.layer_ids == (0, 4, 6)  # -1 is the embedding output
    algorithm = spec.algorithm
    assert (algorithm.name, algorithm.block_size, algorithm.sample_from_anchor) == (
        "dspark",
        7,
        True,
    )
    assert (algorithm.markov_rank, algorithm.markov_head_type) == (8, "vanilla")
    assert algorithm.confidence_head and algorithm.confidence_head_with_markov
    assert spec.head == Head(lm_head="own", embedding="own") and spec.draft_vocab_size == V
    deepspec.write(drafter, tmp_path / "again")
    config = json.loads((tmp_path / "again" / "config.json").read_text())
    assert config["target_layer_ids"] == [-1, 3, 5]
    assert_same_drafter(deepspec.read(tmp_path / "again"), drafter)


def test_deepspec_dflash_is_a_dspark_without_heads(tmp_path):
    path = tmp_path / "dflash"
    config = deepspec_config(markov_rank=0, enable_confidence_head=False)
    del config["markov_head_type"], config["confidence_head_with_markov"]
    write_config(path, config)
    tensors = block_tensors()
    tensors.update({"embed_tokens.weight": rand(V, H), "lm_head.weight": rand(V, H)})
    write_safetensors(path / "model.safetensors", tensors)
    algorithm = deepspec.read(path).spec.algorithm
    assert (algorithm.markov_rank, algorithm.confidence_head) == (0, False)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c.pop("enable_confidence_head"), "missing key enable_confidence_head"),
        (lambda c: c.update(tie_word_embeddings=True), "tie_word_embeddings = true"),
        (lambda c: c.update(target_layer_ids=[1, 3, 7]), r"includes the last target layer \(7\)"),
        (
            lambda c: c.update(target_layer_ids=[1, 3, 10]),
            r"target_layer_ids = \[1, 3, 10\]: 10 is no layer of the 8-layer target",
        ),
        (
            lambda c: c.update(layer_types=["full_attention", "weird"]),
            r"layer_types\[1\] = 'weird': expected 'full_attention'",
        ),
        (
            lambda c: c.update(num_target_layers=0),
            r"config.json: num_target_layers = 0: expected the target's layer count",
        ),
        (
            lambda c: c.update(block_size=10**12),
            r"algorithm.block_size = 1000000000000: expected at most the layers' context",
        ),
        (
            lambda c: (
                c.pop("layer_types"),
                c.update(use_sliding_window=True, max_window_layers=1),
            ),
            "use_sliding_window = true makes some layers sliding-window layers",
        ),
    ],
)
def test_deepspec_refusals(deepspec_dir, edit, message):
    edit_config(deepspec_dir, edit)
    with pytest.raises(DrafterError, match=message) as info:
        deepspec.read(deepspec_dir)
    one_line(info)


def specforge_dspark_config(**dflash):
    """configs/qwen3-4b-dspark.json, shrunk."""
    return {
        "architectures": ["DSparkDraftModel"],
        "auto_map": {"AutoModel": "dspark.DSparkDraftModel"},
        "block_size": 7,
        "dflash_config": {
            "attention_mode": "gqa",
            "mask_token_id": 95,
            "target_layer_ids": [1, 3, 5],
            "projector_type": "dspark",
            "markov_rank": 8,
            "markov_head_type": "vanilla",
            "confidence_head_alpha": 1.0,
            "enable_confidence_head": True,
            "confidence_head_with_markov": True,
            **dflash,
        },
        "dtype": "bfloat16",
        "num_target_layers": 8,
        **qwen3_config(),
    }


@pytest.fixture
def specforge_dspark_dir(tmp_path):
    path = tmp_path / "sf-dspark"
    write_config(path, specforge_dspark_config())
    tensors = block_tensors()
    tensors.update(
        {
            "markov_head.markov_w1.weight": rand(V, 8),
            "markov_head.markov_w2.weight": rand(V, 8),
            "confidence_head.proj.weight": rand(1, H + 8),
            "confidence_head.proj.bias": rand(1),
        }
    )
    write_safetensors(path / "model.safetensors", tensors)
    return path


def test_specforge_dspark_checkpoint_reads(specforge_dspark_dir):
    assert only_format(specforge_dspark_dir) == "specforge-dspark"
    spec = specforge_dspark.read(specforge_dspark_dir).spec
    assert spec.taps.layer_ids == (2, 4, 6)
    algorithm = spec.algorithm
    assert (algorithm.name, algorithm.block_size, algorithm.sample_from_anchor) == (
        "dspark",
        7,
        True,
    )
    assert algorithm.confidence_head_with_markov and algorithm.markov_rank == 8
    assert spec.head == Head(lm_head="shared", embedding="shared")


def test_specforge_dspark_legacy_head_names(specforge_dspark_dir):
    def legacy(tensors):
        for name in list(tensors):
            if name.startswith(("markov_head.", "confidence_head.")):
                tensors["logit_head." + name] = tensors.pop(name)

    before = specforge_dspark.read(specforge_dspark_dir)
    before = type(before)(
        before.spec, before.vocab, {k: np.array(v) for k, v in before.weights.items()}
    )
    edit_tensors(specforge_dspark_dir, legacy)  # rewrites the file the first read mapped
    assert_same_drafter(specforge_dspark.read(specforge_dspark_dir), before)


def test_specforge_dspark_defaults(specforge_dspark_dir):
    """SpecForge's defaults: no Markov head, confidence head iff confidence_head_alpha > 0."""

    def strip(c):
        for key in (
            "markov_rank",
            "markov_head_type",
            "enable_confidence_head",
            "confidence_head_with_markov",
        ):
            c["dflash_config"].pop(key)

    edit_config(specforge_dspark_dir, strip)
    edit_tensors(
        specforge_dspark_dir,
        lambda t: (
            [t.pop(k) for k in [k for k in t if k.startswith("markov_head.")]],
            t.update({"confidence_head.proj.weight": rand(1, H)}),
        ),
    )
    algorithm = specforge_dspark.read(specforge_dspark_dir).spec.algorithm
    assert (algorithm.markov_rank, algorithm.confidence_head) == (0, True)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d.update(attention_mode="mha"), "attention_mode = 'mha' with 4 heads and 2 kv"),
        (lambda d: d.update(shift_label=True), r"unknown key\(s\) shift_label"),
        (lambda d: d.update(markov_rank=0), "confidence_head_with_markov = true requires"),
    ],
)
def test_specforge_dspark_refusals(specforge_dspark_dir, edit, message):
    edit_config(specforge_dspark_dir, lambda c: edit(c["dflash_config"]))
    with pytest.raises(DrafterError, match=message) as info:
        specforge_dspark.read(specforge_dspark_dir)
    one_line(info)


# ---------------------------------------------------------------------------------------------
# Round trips through our own writers


def tiny(algorithm, **fields):
    return tiny_spec(algorithm, target_layers=8, **fields)


ROUND_TRIPS = [
    (safeailab, dataclasses.replace(tiny("eagle3", draft_vocab_size=40), taps=Taps((2, 4, 5)))),
    (specforge, dataclasses.replace(tiny("eagle3", tap_norm="per_tap"), taps=Taps((2, 4, 5)))),
    (zlab_dflash, tiny("dflash", style="qwen3", num_layers=2)),
    (specforge_dspark, tiny("dspark", style="qwen3", markov_head_type="gated")),
    (
        deepspec,
        dataclasses.replace(
            tiny("dspark", style="qwen3", markov_head_type="rnn"),
            head=Head(lm_head="own", embedding="own"),
        ),
    ),
]


@pytest.mark.parametrize("dtype", ["F32", "BF16"])
@pytest.mark.parametrize("fmt, spec", ROUND_TRIPS, ids=[f.NAME for f, _ in ROUND_TRIPS])
def test_round_trip_is_bit_exact(tmp_path, fmt, spec, dtype):
    drafter = random_drafter(spec, dtype, seed=4)
    fmt.write(drafter, tmp_path / "a")
    assert detect(tmp_path / "a") is fmt
    taps = spec.taps.layer_ids if fmt is safeailab else None
    loaded = fmt.read(tmp_path / "a", taps=taps)
    target = dataclasses.replace(spec.target, name_or_path=None)
    if fmt in (safeailab, specforge):
        target = dataclasses.replace(target, num_hidden_layers=None)
    expected = dataclasses.replace(spec, target=target)
    assert loaded.spec == expected
    assert_same_drafter(loaded, type(drafter)(expected, drafter.vocab, drafter.weights))
    fmt.write(loaded, tmp_path / "b")
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_reading_keeps_tensors_memory_mapped(tmp_path):
    spec = dataclasses.replace(tiny("eagle3", draft_vocab_size=40), taps=Taps((2, 4, 5)))
    safeailab.write(random_drafter(spec), tmp_path / "s")
    drafter = safeailab.read(tmp_path / "s", taps=[2, 4, 5])
    assert all(base_is_mmap(a) for a in drafter.weights.values())


@pytest.mark.parametrize(
    "fmt, spec, message",
    [
        (
            zlab_dflash,
            dataclasses.replace(tiny("dflash", style="qwen3"), taps=Taps((1, 4, 8))),
            r"taps \[1, 4, 8\] include id 8 .* after the final norm",
        ),
        (zlab_dflash, tiny("dflash", style="qwen3", sample_from_anchor=True), "sample_from_anchor"),
        (zlab_dflash, tiny("dflash", style="llama"), "style 'llama' \\(its layers are Qwen3"),
        (
            zlab_dflash,
            dataclasses.replace(tiny("dflash", style="qwen3"), taps=Taps((0, 4, 6))),
            "cannot name canonical id 0",
        ),
        (specforge_dspark, tiny("dspark", style="qwen3", sample_from_anchor=False), "anchor-first"),
        (specforge, tiny("eagle3", norm_output=True), "norm_output"),
        (specforge, dataclasses.replace(tiny("eagle3"), taps=Taps((1, 2, 3, 4))), "4 taps"),
        (safeailab, tiny("eagle3", style="qwen3"), "layer style 'qwen3'"),
        (safeailab, tiny("eagle3"), r"SafeAILab's target code always captures ids"),
        (deepspec, tiny("dspark", style="qwen3", draft_vocab_size=40), "reduced draft vocabulary"),
    ],
)
def test_writers_refuse_in_one_line_and_write_nothing(tmp_path, fmt, spec, message):
    with pytest.raises(DrafterError, match=message) as info:
        fmt.write(random_drafter(spec), tmp_path / "out")
    one_line(info)
    assert not (tmp_path / "out").exists() and not list(tmp_path.iterdir())


def test_inspect_shows_stored_and_canonical_ids(zlab_dir, capsys):
    try:
        main(["inspect", str(zlab_dir)])
    except SystemExit as e:
        assert not e.code
    out = capsys.readouterr().out
    assert "format      zlab-dflash" in out
    assert "[2, 4, 6] (after_layers) canonical; stored as [1, 3, 5] (layer_output)" in out


def test_inspect_names_deepspecs_embedding_tap_and_safeailabs_missing_ids(
    deepspec_dir, safeailab_dir, capsys
):
    for argv, expected in (
        (
            ["inspect", str(deepspec_dir)],
            "[0, 4, 6] (after_layers) canonical; stored as [-1, 3, 5] (layer_output)",
        ),
        (
            ["inspect", str(safeailab_dir[0]), "--taps", "2,4,5"],
            "[2, 4, 5] (after_layers) canonical; the format does not store them",
        ),
    ):
        try:
            main(argv)
        except SystemExit as e:
            assert not e.code, capsys.readouterr().err
        assert expected in capsys.readouterr().out


def test_dry_run_lists_every_tensor_and_writes_nothing(safeailab_dir, tmp_path, capsys):
    path, tensors = safeailab_dir
    dest = tmp_path / "out"
    argv = ["convert", str(path), str(dest), "--to", "speculators", "--taps", "2,4,5", "--dry-run"]
    try:
        main(argv)
    except SystemExit as e:
        assert not e.code
    out = capsys.readouterr().out
    assert not dest.exists()
    assert "(safeailab) -> " in out and "(speculators)" in out
    assert "canonical [2, 4, 5] (after_layers); source stores not stored;" in out
    assert "output stores [2, 4, 5] (after_layers)" in out
    lines = [line.split() for line in out.splitlines() if " <- " in line]
    assert len(lines) == len(tensors)
    rows = {line[0]: line[2:] for line in lines}
    assert rows["layers.0.self_attn.q_proj.weight"] == [
        "midlayer.self_attn.q_proj.weight",
        "[32,",
        "64]",
        "F32",
    ]
    assert rows["d2t"][:2] == ["(vocabulary", "map)"]


def test_a_conversion_says_what_the_output_format_leaves_to_its_loader(tmp_path, capsys):
    source = tmp_path / "native"
    drafter = random_drafter(tiny_spec("eagle3", target_layers=8, taps=(2, 4, 5)))
    format_named("woodcock").write(drafter, source)
    for extra in ([], ["--dry-run"]):
        dest = tmp_path / f"out{len(extra)}"
        try:
            main(["convert", str(source), str(dest), "--to", "safeailab", *extra])
        except SystemExit as e:
            assert not e.code
        out = capsys.readouterr().out
        assert "taps are not stored: SafeAILab's target code captures layers 2, N//2 and N-3" in out
        assert dest.exists() != bool(extra)


def test_specforge_says_sglang_may_skip_the_per_tap_norms():
    plain = tiny_spec("eagle3", target_layers=8, taps=(2, 4, 5), draft_vocab_size=40)
    per_tap = dataclasses.replace(
        plain, fusion=dataclasses.replace(plain.fusion, tap_norm="per_tap")
    )
    assert specforge.prepare(random_drafter(plain)).notes == []
    (note,) = specforge.prepare(random_drafter(per_tap)).notes
    assert "skips fc_norm.* without an error" in note
