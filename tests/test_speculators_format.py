"""The speculators reader and writer against our own expectations (the real package is checked
in tests/interop)."""

import dataclasses
import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
from helpers import assert_same_drafter, run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import specs, speculators_representable

from woodcock.errors import DrafterError
from woodcock.formats import hf_config, speculators
from woodcock.formats.detect import format_named
from woodcock.ir import Drafter, Head
from woodcock.loading import load_drafter
from woodcock.synthetic import random_drafter, tiny_spec
from woodcock.tensorfile import read_safetensors, write_safetensors


def without_layer_count(spec):
    return dataclasses.replace(
        spec, target=dataclasses.replace(spec.target, num_hidden_layers=None)
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=specs(), dtype=st.sampled_from(["F32", "BF16"]), seed=st.integers(0, 2**16))
def test_write_read_round_trip_is_bit_exact(spec, dtype, seed):
    spec = speculators_representable(spec)
    drafter = random_drafter(spec, dtype, seed)
    with tempfile.TemporaryDirectory() as tmp:
        speculators.write(drafter, Path(tmp, "s"))
        loaded = speculators.read(Path(tmp, "s"))
        expected = Drafter(without_layer_count(spec), drafter.vocab, drafter.weights)
        assert_same_drafter(expected, loaded)
        speculators.write(loaded, Path(tmp, "again"))
        for name in ("model.safetensors", "config.json"):
            assert Path(tmp, "s", name).read_bytes() == Path(tmp, "again", name).read_bytes()


def test_vocab_map_is_written_as_offsets_and_mask(tmp_path):
    drafter = random_drafter(tiny_spec("eagle3", draft_vocab_size=10), seed=3)
    speculators.write(drafter, tmp_path / "s")
    tensors, _ = read_safetensors(tmp_path / "s" / "model.safetensors")
    ids = drafter.vocab.draft_to_target
    assert tensors["d2t"].dtype == np.int64 and np.array_equal(tensors["d2t"] + np.arange(10), ids)
    assert tensors["t2d"].dtype == np.bool_ and np.array_equal(np.flatnonzero(tensors["t2d"]), ids)
    config = json.loads((tmp_path / "s" / "config.json").read_text())
    for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        assert flag in config  # vLLM defaults some of them differently when missing
    layer = config["transformer_layer_config"]
    for key in (
        "model_type",
        "head_dim",
        "rms_norm_eps",
        "rope_parameters",
        "hidden_act",
        "attention_bias",
    ):
        assert key in layer


def test_hf_layer_defaults_match_transformers():
    import transformers

    for style, cls in (("llama", transformers.LlamaConfig), ("qwen3", transformers.Qwen3Config)):
        reference = cls()
        for key, value in hf_config.HF_LAYER_DEFAULTS[style].items():
            if value is None:
                continue
            if key == "sliding_window":  # Qwen3Config keeps it only when the window is used
                assert cls(use_sliding_window=True).sliding_window == value
            else:
                assert getattr(reference, key) == value, (style, key)
        assert reference.rope_parameters["rope_theta"] == hf_config.DEFAULT_ROPE_THETA
    llama = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4)
    assert llama.head_dim == 16 and llama.num_key_value_heads == 4  # the derived defaults


@pytest.fixture
def saved(tmp_path):
    def save(spec, name="s"):
        path = tmp_path / name
        speculators.write(random_drafter(spec, seed=1), path)
        return path

    return save


def edit_config(path, edit):
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))


def edit_tensors(path, edit):
    tensors, metadata = read_safetensors(path / "model.safetensors")
    tensors = {k: np.array(v) for k, v in tensors.items()}
    edit(tensors)
    write_safetensors(path / "model.safetensors", tensors, metadata)


DFLASH = tiny_spec("dflash", style="qwen3")
EAGLE = tiny_spec("eagle3", draft_vocab_size=40)


@pytest.mark.parametrize(
    "spec, damage, message",
    [
        (
            DFLASH,
            lambda p: edit_config(p, lambda c: c.pop("aux_hidden_state_layer_ids")),
            "aux_hidden_state_layer_ids = None: the tapped target layers are not recorded; pass them with --taps",
        ),
        (
            DFLASH,
            lambda p: edit_config(p, lambda c: c.update(mask_token_id=None)),
            r"missing key\(s\) mask_token_id for dflash",
        ),
        (
            DFLASH,
            lambda p: edit_config(p, lambda c: c.pop("sample_from_anchor")),
            r"missing key\(s\) sample_from_anchor",
        ),
        (
            DFLASH,
            lambda p: edit_config(p, lambda c: c.update(aux_hidden_state_layer_ids=[1, 2, 2])),
            r"aux_hidden_state_layer_ids = \[1, 2, 2\]: repeated layer ids",
        ),
        (
            EAGLE,
            lambda p: edit_tensors(p, lambda t: t["d2t"].__setitem__(1, t["d2t"][0] - 1)),
            "d2t and t2d disagree",
        ),
        (
            EAGLE,
            lambda p: edit_tensors(
                p, lambda t: (t.pop("t2d"), t["d2t"].__setitem__(1, t["d2t"][0] - 1))
            ),
            r"draft_to_target\[1\] = \d+: .*repeats",
        ),
        (
            EAGLE,
            lambda p: edit_tensors(p, lambda t: (t.pop("t2d"), t.pop("d2t"))),
            "there is no d2t or t2d: the draft-to-target map is missing",
        ),
        (
            EAGLE,
            lambda p: edit_config(p, lambda c: c.pop("norm_before_residual")),
            r"missing key\(s\) norm_before_residual: speculators and vLLM default them differently",
        ),
        (
            EAGLE,
            lambda p: edit_config(p, lambda c: c.update(fc_norm=True, norm_before_fc=True)),
            "exclusive",
        ),
        (
            EAGLE,
            lambda p: edit_config(p, lambda c: c.update(medusa_heads=3, extra=1)),
            r"unknown key\(s\) extra, medusa_heads for eagle3",
        ),
        (
            EAGLE,
            lambda p: edit_config(
                p, lambda c: c["transformer_layer_config"].update(partial_rotary_factor=0.5)
            ),
            r"transformer_layer_config.unknown key\(s\) partial_rotary_factor",
        ),
        (
            EAGLE,
            lambda p: edit_config(
                p, lambda c: c["transformer_layer_config"].update(model_type="gemma")
            ),
            "model_type = 'gemma': expected 'llama' or 'qwen3'",
        ),
        (
            EAGLE,
            lambda p: edit_config(
                p, lambda c: c["transformer_layer_config"].update(hidden_act="gelu")
            ),
            r"layers\[0\].hidden_act = 'gelu'",
        ),
        (
            EAGLE,
            lambda p: edit_config(p, lambda c: c.update(speculators_model_type="mtp")),
            "speculators_model_type = 'mtp'",
        ),
        (
            EAGLE,
            lambda p: edit_tensors(p, lambda t: t.update(extra=np.zeros(2, np.float32))),
            r"unexpected tensor\(s\) extra",
        ),
        (
            EAGLE,
            lambda p: edit_config(
                p, lambda c: c["speculators_config"]["verifier"].update(architectures="Llama")
            ),
            "speculators_config.verifier.architectures = 'Llama': expected a list of strings",
        ),
        (
            EAGLE,
            lambda p: edit_config(
                p, lambda c: c["transformer_layer_config"].update(num_hidden_layers=0)
            ),
            "transformer_layer_config.num_hidden_layers = 0: expected at least one layer",
        ),
        (
            EAGLE,
            lambda p: edit_config(
                p,
                lambda c: c["transformer_layer_config"].update(
                    rope_parameters={"rope_type": "linear", "rope_theta": 10000.0}
                ),
            ),
            r"rope_scaling.factor = None: expected a number \(rope_type 'linear' needs it\)",
        ),
        (
            DFLASH,
            lambda p: edit_config(p, lambda c: c.update(sliding_window_non_causal="false")),
            "sliding_window_non_causal = 'false': expected true or false",
        ),
        (
            EAGLE,
            lambda p: edit_tensors(p, lambda t: t.pop("fc.weight")),
            r"missing tensor\(s\) fc.weight",
        ),
        (
            EAGLE,
            lambda p: edit_config(p, lambda c: c["transformer_layer_config"].pop("hidden_size")),
            r"\.shape = .*\(config.json does not state transformer_layer_config.hidden_size; the"
            r" Hugging Face class default 4096 was taken\)",
        ),
    ],
)
def test_bad_checkpoints_are_refused_with_one_line(saved, spec, damage, message):
    path = saved(spec)
    damage(path)
    with pytest.raises(DrafterError, match=message) as info:
        speculators.read(path)
    assert "\n" not in str(info.value)


def test_taps_can_be_supplied_when_missing(saved):
    path = saved(DFLASH)
    edit_config(path, lambda c: c.pop("aux_hidden_state_layer_ids"))
    assert speculators.read(path, taps=[1, 2, 3]).spec.taps.layer_ids == (1, 2, 3)


def test_missing_layer_keys_take_the_hugging_face_defaults(saved):
    path = saved(EAGLE)

    def strip(config):
        layer = config["transformer_layer_config"]
        for key in (
            "rms_norm_eps",
            "attention_bias",
            "mlp_bias",
            "hidden_act",
            "layer_types",
            "sliding_window",
        ):
            layer.pop(key, None)
        layer["rope_theta"] = layer.pop("rope_parameters")["rope_theta"]

    edit_config(path, strip)
    layer = speculators.read(path).spec.layers[0]
    assert (layer.rms_norm_eps, layer.attention_bias, layer.mlp_bias, layer.sliding_window) == (
        1e-6,
        False,
        False,
        None,
    )
    edit_config(path, lambda c: c["transformer_layer_config"].pop("head_dim"))
    assert speculators.read(path).spec.layers[0].head_dim == 32 // 4  # llama: hidden / heads


def test_sharded_checkpoints_are_read(saved):
    path = saved(EAGLE)
    tensors, metadata = read_safetensors(path / "model.safetensors")
    names = sorted(tensors)
    halves = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    for file, part in halves.items():
        write_safetensors(path / file, {n: np.array(tensors[n]) for n in part}, metadata)
    (path / "model.safetensors").unlink()
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {n: f for f, part in halves.items() for n in part}})
    )
    assert_same_drafter(speculators.read(path), load_drafter(path))


@pytest.mark.parametrize(
    "spec, message",
    [
        (
            dataclasses.replace(EAGLE, fusion=dataclasses.replace(EAGLE.fusion, fc_bias=True)),
            "cannot hold fusion.fc_bias",
        ),
        (tiny_spec("dflash", style="llama"), "runs dflash layers as qwen3 layers"),
        (
            tiny_spec("dflash", style="qwen3", tap_norm="per_tap"),
            "cannot hold fusion.tap_norm = 'per_tap'",
        ),
    ],
)
def test_writer_refuses_what_the_format_cannot_hold(tmp_path, spec, message):
    with pytest.raises(DrafterError, match=message):
        speculators.write(random_drafter(spec), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_writer_refuses_mixed_in_block_causality(tmp_path):
    spec = tiny_spec("dflash", style="qwen3", num_layers=2)
    layers = (
        dataclasses.replace(spec.layers[0], attention="block_causal", sliding_window=8),
        dataclasses.replace(spec.layers[1], attention="block_bidirectional", sliding_window=8),
    )
    with pytest.raises(DrafterError, match="one sliding_window_non_causal switch"):
        speculators.write(random_drafter(dataclasses.replace(spec, layers=layers)), tmp_path / "o")


def test_full_attention_block_layers_are_written_non_causal(tmp_path):
    """vLLM 0.33.0 turns sliding_window_non_causal into every layer's causality; speculators
    applies it to sliding layers only. Without sliding layers, true means bidirectional to both."""
    spec = tiny_spec("dflash", style="qwen3", num_layers=2)
    speculators.write(random_drafter(spec), tmp_path / "full")
    config = json.loads((tmp_path / "full" / "config.json").read_text())
    assert config["sliding_window_non_causal"] is True
    assert {layer.attention for layer in speculators.read(tmp_path / "full").spec.layers} == {
        "block_bidirectional"
    }
    sliding = dataclasses.replace(spec.layers[0], attention="block_causal", sliding_window=8)
    mixed = dataclasses.replace(spec, layers=(sliding, spec.layers[1]))
    speculators.write(random_drafter(mixed), tmp_path / "mixed")
    config = json.loads((tmp_path / "mixed" / "config.json").read_text())
    assert config["sliding_window_non_causal"] is False
    assert speculators.read(tmp_path / "mixed").spec.layers == mixed.layers
    assert speculators.vllm_notes(config) and not speculators.vllm_notes(
        json.loads((tmp_path / "full" / "config.json").read_text())
    )


def test_an_eagle3_of_other_than_three_taps_says_its_count_where_vllm_reads_it(tmp_path):
    """vLLM's llama EAGLE-3 sizes fc from transformer_layer_config.num_aux_hidden_states, else
    for three taps; the count must agree with the ids when read back."""
    four = tiny_spec("eagle3", target_layers=6, taps=(1, 2, 4, 5))
    speculators.write(random_drafter(four), tmp_path / "four")
    config = json.loads((tmp_path / "four" / "config.json").read_text())
    assert config["transformer_layer_config"]["num_aux_hidden_states"] == 4
    assert speculators.read(tmp_path / "four").spec == without_layer_count(four)
    speculators.write(random_drafter(EAGLE), tmp_path / "three")
    config = json.loads((tmp_path / "three" / "config.json").read_text())
    assert "num_aux_hidden_states" not in config["transformer_layer_config"]
    edit_config(
        tmp_path / "four", lambda c: c["transformer_layer_config"].update(num_aux_hidden_states=3)
    )
    with pytest.raises(DrafterError, match=r"num_aux_hidden_states = 3: expected 4"):
        speculators.read(tmp_path / "four")


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        (tiny_spec("dflash", style="qwen3", sample_from_anchor=True), "refuses DFlash drafters"),
        (
            tiny_spec("dspark", style="qwen3", markov_head_type="gated"),
            "markov_head_type = 'gated' fails to load",
        ),
        (
            tiny_spec("dspark", style="qwen3", sample_from_anchor=False),
            "pass num_speculative_tokens 3",
        ),
        (
            tiny_spec("dspark", style="qwen3", num_layers=2),
            "sliding layers, bidirectional in speculators, would run causal",
        ),
    ],
)
def test_what_vllm_refuses_or_runs_otherwise_is_said(tmp_path, spec, says):
    if "sliding layers" in says:
        sliding = dataclasses.replace(spec.layers[0], sliding_window=8)
        spec = dataclasses.replace(spec, layers=(sliding, spec.layers[1]))
    speculators.write(random_drafter(spec), tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    notes = speculators.vllm_notes(config)
    assert len(notes) == 1 and says in notes[0]


def test_the_shipped_shapes_have_nothing_to_note(tmp_path):
    for spec in (EAGLE, tiny_spec("dspark", style="qwen3"), tiny_spec("dflash", style="qwen3")):
        speculators.write(random_drafter(spec), tmp_path / spec.algorithm.name)
        config = json.loads((tmp_path / spec.algorithm.name / "config.json").read_text())
        assert speculators.vllm_notes(config) == []


def test_the_conversion_says_what_vllm_would_run_differently(tmp_path, capsys):
    spec = tiny_spec("dflash", style="qwen3", num_layers=2)
    sliding = dataclasses.replace(spec.layers[0], attention="block_causal", sliding_window=8)
    source = tmp_path / "native"
    format_named("woodcock").write(
        random_drafter(dataclasses.replace(spec, layers=(sliding, spec.layers[1]))), source
    )
    argv = ["convert", str(source), str(tmp_path / "out"), "--to", "speculators", "--dry-run"]
    code, out, _ = run_cli(argv, capsys)
    says = "full-attention layers, bidirectional in speculators, would run causal"
    assert code == 0 and says in out
    assert not (tmp_path / "out").exists()
    code, out, _ = run_cli(argv[:-1], capsys)
    assert code == 0 and "note: vLLM reads sliding_window_non_causal = false as every" in out
    assert says in out and (tmp_path / "out" / "config.json").exists()


def make_target(path: Path, spec, tie: bool) -> dict:
    """A Hugging Face-style target directory: config.json and model.safetensors."""
    path.mkdir()
    rng = np.random.default_rng(5)
    vocab, hidden = spec.target.vocab_size, spec.target.hidden_size
    tensors = {"model.embed_tokens.weight": rng.standard_normal((vocab, hidden)).astype(np.float32)}
    if not tie:
        tensors["lm_head.weight"] = rng.standard_normal((vocab, hidden)).astype(np.float32)
    write_safetensors(path / "model.safetensors", tensors)
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "num_hidden_layers": spec.target.num_hidden_layers or 6,
        "hidden_size": hidden,
        "vocab_size": vocab,
        "tie_word_embeddings": tie,
    }
    (path / "config.json").write_text(json.dumps(config))
    return tensors


def test_convert_round_trip_is_bit_identical(saved, tmp_path, capsys):
    for spec in (
        EAGLE,
        tiny_spec("dspark", style="qwen3", draft_vocab_size=70, markov_head_type="gated"),
    ):
        source = saved(spec, f"src-{spec.algorithm.name}")
        native, back = tmp_path / f"n-{spec.algorithm.name}", tmp_path / f"b-{spec.algorithm.name}"
        assert run_cli(["convert", str(source), str(native), "--to", "woodcock"], capsys)[0] == 0
        assert run_cli(["convert", str(native), str(back), "--to", "speculators"], capsys)[0] == 0
        original, _ = read_safetensors(source / "model.safetensors")
        returned, _ = read_safetensors(back / "model.safetensors")
        assert sorted(original) == sorted(returned)
        for name, array in original.items():
            assert returned[name].dtype == array.dtype
            assert returned[name].tobytes() == array.tobytes(), name
        assert json.loads((source / "config.json").read_text()) == json.loads(
            (back / "config.json").read_text()
        )
        code, _, err = run_cli(["convert", str(native), str(back), "--to", "speculators"], capsys)
        assert code == 2 and "already exists; pass --force" in err


def test_convert_never_replaces_its_source(saved, tmp_path, capsys):
    """--force replaces an earlier output, which goes whole: never the drafter being read or a
    folder holding it."""
    source = saved(EAGLE, "folder/src")
    (tmp_path / "folder" / "notes.txt").write_text("kept")
    before = {p: p.read_bytes() for p in (tmp_path / "folder").rglob("*") if p.is_file()}
    for dest, message in [
        (source, "the output is the source drafter"),
        (tmp_path / "folder", f"the output holds the source drafter {source.resolve()}"),
    ]:
        argv = ["convert", str(source), str(dest), "--to", "woodcock", "--force"]
        code, _, err = run_cli(argv, capsys)
        assert code == 2 and message in err and len(err.splitlines()) == 1, err
    assert {p: p.read_bytes() for p in (tmp_path / "folder").rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("tie", [False, True])
def test_convert_with_target_fills_shared_tensors(tmp_path, capsys, tie):
    """A reduced vocabulary that uses the target's head: vLLM cannot load it from the
    speculators format, so the conversion asks for --target, which copies the head rows in."""
    spec = tiny_spec("dflash", style="qwen3", draft_vocab_size=50)
    spec = dataclasses.replace(spec, head=Head(lm_head="shared", embedding="shared"))
    source = tmp_path / "src"
    format_named("woodcock").write(random_drafter(spec, seed=1), source)
    target = make_target(tmp_path / "target", spec, tie)
    out = tmp_path / "out"
    code, _, err = run_cli(["convert", str(source), str(out), "--to", "speculators"], capsys)
    assert code == 2 and "(50 of 96 ids) with the target's lm_head" in err and "--target" in err
    assert not out.exists()
    options = ["--target", str(tmp_path / "target"), "--dtype", "bfloat16"]
    code, _, err = run_cli(
        ["convert", str(source), str(out), "--to", "speculators", *options], capsys
    )
    assert code == 0, err
    drafter = load_drafter(out)
    assert drafter.spec.head.embedding == drafter.spec.head.lm_head == "own"
    assert drafter.spec.target.num_hidden_layers is None  # speculators does not record it
    head = target["model.embed_tokens.weight" if tie else "lm_head.weight"]
    expected = head[drafter.vocab.draft_to_target].astype(drafter.weights["lm_head.weight"].dtype)
    assert drafter.weights["lm_head.weight"].tobytes() == expected.tobytes()
    assert set(drafter.weights.dtypes) == {"BF16"}


def test_convert_with_target_checks_the_taps(saved, tmp_path, capsys):
    spec = without_layer_count(DFLASH)
    spec = dataclasses.replace(spec, taps=dataclasses.replace(spec.taps, layer_ids=(1, 7)))
    source = saved(spec)
    make_target(tmp_path / "target", spec, True)
    code, _, err = run_cli(
        [
            "convert",
            str(source),
            str(tmp_path / "o"),
            "--to",
            "woodcock",
            "--target",
            str(tmp_path / "target"),
        ],
        capsys,
    )
    assert code == 2
    assert "taps.layer_ids[1] = 7: expected an id in [0, 6]" in err
