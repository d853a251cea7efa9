"""Our speculators reader and writer and our torch reference against the real speculators 0.9.0.

For every variant built with speculators' own classes:
- reader + torch reference give speculators' own logits (and confidence) to 1e-5 in fp32;
- what our writer writes reloads in speculators and gives the same logits;
- read -> write keeps every tensor bit for bit and the config's meaning (speculators' own parse
  of both configs is equal).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from speculators_variants import SEQ, VARIANT_NAMES, VARIANTS

from woodcock.errors import DrafterError
from woodcock.formats import speculators as speculators_format
from woodcock.target_checkpoint import load_target_tensors
from woodcock.tensorfile import read_safetensors, write_safetensors

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]
TOLERANCE = 1e-5
# Hugging Face's eager attention is the plain softmax(q k^T) v the reference computes; sdpa
# sums in another order (up to ~1.2e-5 apart on logits of magnitude 30: fp32 rounding).
ATTENTION = "eager"
ANCHORS = (0, 3, 7, SEQ - 8)


def reference_for(path, verifier_dir):
    from woodcock.reference import TorchDrafter

    drafter = speculators_format.read(path)
    return TorchDrafter(drafter, load_target_tensors(verifier_dir))


def eagle3_teacher_forced(reference, torch, inputs, steps):
    """Our logits for speculators' training rows: row i at step k is inference step k+1 of the
    prefix x_0..x_{i+1}, with chain tokens teacher-forced. [steps, T, Vd], NaN where a row runs
    past the sequence (speculators pads those rows; they are not inference)."""
    ids, hidden = inputs["input_ids"][0], inputs["hidden_states"][0]
    rows = ids.shape[0]
    fused = reference.fuse(hidden)
    out = torch.full((steps, rows, reference.spec.draft_vocab_size), float("nan"))
    for i in range(rows):
        cache = reference.new_cache()
        step = reference.eagle3_forward(ids[: i + 1], fused[: i + 1], torch.arange(1, i + 2), cache)
        out[0, i] = step.logits[-1]
        for k in range(1, min(steps, rows - i)):
            step = reference.eagle3_forward(
                ids[i + k : i + k + 1],
                step.hidden[-1:],
                torch.tensor([i + 1 + k]),
                cache,
                chain=True,
            )
            out[k, i] = step.logits[-1]
    return out


def speculators_outputs(H, variant, path, verifier_dir, inputs):  # noqa: N803
    if variant.algorithm == "eagle3":
        logits = H.eagle3_logits(
            path,
            inputs["hidden_states"],
            inputs["input_ids"],
            ttt_steps=variant.ttt_steps,
            attn_implementation=ATTENTION,
        )
        return {"logits": logits}
    return H.block_logits(
        path,
        inputs["hidden_states"],
        inputs["input_ids"],
        inputs["anchor_positions"],
        attn_implementation=ATTENTION,
    )


def variant_inputs(H, torch, inputs, variant):  # noqa: N803
    if variant.algorithm == "eagle3":
        raw = inputs(variant.verifier, variant.aux_layer_ids, SEQ + 1)
        return H.shift_for_eagle3(raw["input_ids"], raw["features"])
    raw = inputs(variant.verifier, variant.aux_layer_ids, SEQ)
    anchors = torch.tensor([a for a in ANCHORS if a <= SEQ - variant.block_size])
    return {
        "input_ids": raw["input_ids"],
        "hidden_states": raw["features"],
        "anchor_positions": anchors,
    }


def max_diff(torch, ours, theirs) -> float:
    valid = ~torch.isnan(ours)
    return float((ours[valid] - theirs[valid]).abs().max())


@pytest.mark.parametrize("name", VARIANT_NAMES)
def test_reader_and_reference_match_speculators(name, H, torch, built, inputs, verifiers):  # noqa: N803
    variant = VARIANTS[name]
    path, verifier_dir = built(name), verifiers[variant.verifier]
    reference = reference_for(path, verifier_dir)
    data = variant_inputs(H, torch, inputs, variant)
    theirs = speculators_outputs(H, variant, path, verifier_dir, data)
    if variant.algorithm == "eagle3":
        steps = len(theirs["logits"])
        ours = eagle3_teacher_forced(reference, torch, data, steps)
        expected = torch.stack([t.reshape(ours.shape[1:]) for t in theirs["logits"]])
        assert max_diff(torch, ours, expected) <= TOLERANCE
        return
    features = data["hidden_states"][0]
    context = reference.fuse(features)
    positions = torch.arange(features.shape[0])
    for n, anchor in enumerate(data["anchor_positions"].tolist()):
        block_ids = theirs["block_token_ids"][n]
        out = reference.block_forward(
            context, positions, block_ids, torch.arange(anchor, anchor + block_ids.shape[0])
        )
        assert max_diff(torch, out.logits, theirs["base_logits"][n]) <= TOLERANCE
        if variant.algorithm == "dflash":
            assert max_diff(torch, out.logits, theirs["logits"][n]) <= TOLERANCE
            continue
        prev = theirs["prev_token_ids"]  # None without a Markov head: then unused
        prev = torch.zeros_like(block_ids) if prev is None else prev[n]
        logits, confidence = reference.markov_heads(out.hidden, out.logits, prev)
        assert max_diff(torch, logits, theirs["logits"][n]) <= TOLERANCE
        if variant.enable_confidence_head:
            assert max_diff(torch, confidence, theirs["confidence"][n]) <= TOLERANCE
        else:
            assert confidence is None


@pytest.mark.parametrize("name", VARIANT_NAMES)
def test_our_writer_round_trips_and_reloads_in_speculators(
    name, H, torch, built, inputs, verifiers, tmp_path
):  # noqa: N803
    from speculators import SpeculatorModelConfig

    variant = VARIANTS[name]
    source, verifier_dir = built(name), verifiers[variant.verifier]
    drafter = speculators_format.read(source)
    written = tmp_path / "ours"
    speculators_format.write(drafter, written)

    # bit-identical tensors, the same set of them
    theirs_tensors, _ = read_safetensors(source / "model.safetensors")
    ours_tensors, _ = read_safetensors(written / "model.safetensors")
    assert sorted(ours_tensors) == sorted(theirs_tensors)
    for key, array in theirs_tensors.items():
        assert (
            ours_tensors[key].dtype == array.dtype
            and ours_tensors[key].tobytes() == array.tobytes()
        ), key

    # the same meaning, as speculators itself parses the two configs
    def parsed(path):
        """speculators' own parse, less artefacts and keys that do not change the layer math."""
        config = SpeculatorModelConfig.from_pretrained(path).to_dict()
        for artefact in ("transformers_version", "auto_map", "_name_or_path"):
            config.pop(artefact, None)
        layer = config["transformer_layer_config"]
        for key in speculators_format.INERT_LAYER_KEYS:
            layer.pop(key, None)
        return json.loads(json.dumps(config, sort_keys=True, default=str))

    ours, theirs = parsed(written), parsed(source)
    if variant.algorithm == "eagle3" and len(variant.aux_layer_ids) != 3:
        # for vLLM, whose llama EAGLE-3 sizes fc for three taps unless told the count
        count = ours["transformer_layer_config"].pop("num_aux_hidden_states")
        assert count == len(variant.aux_layer_ids)
    if variant.algorithm != "eagle3" and "sliding_attention" not in (variant.layer_types or ()):
        # no layer slides: the switch means nothing to speculators, and true keeps vLLM's
        # layers bidirectional (it reads the switch as every layer's causality)
        assert ours.pop("sliding_window_non_causal") is True
        theirs.pop("sliding_window_non_causal")
    if variant.algorithm != "eagle3" and variant.layer_model_type == "llama":
        # speculators runs DFlash/DSpark layers as qwen3 layers whatever model_type says; we
        # write what runs, so only the class-specific keys differ
        assert ours["transformer_layer_config"]["model_type"] == "qwen3"
    else:
        assert ours == theirs
    assert speculators_format.read(written).spec == drafter.spec

    # speculators loads our output and computes the same logits
    data = variant_inputs(H, torch, inputs, variant)
    original = speculators_outputs(H, variant, source, verifier_dir, data)
    reloaded = speculators_outputs(H, variant, written, verifier_dir, data)
    for a, b in zip(original["logits"], reloaded["logits"], strict=True):
        assert torch.equal(a, b)


def test_refused_speculators_checkpoints_name_the_problem(built, tmp_path):
    """Real speculators files, damaged the ways users meet: one clear DrafterError each."""
    for name, edit, message in (
        (
            "dflash_full_attention",
            lambda c: c.pop("aux_hidden_state_layer_ids"),
            "aux_hidden_state_layer_ids = None",
        ),
        ("dspark_vanilla", lambda c: c.update(mask_token_id=None), "mask_token_id"),
    ):
        path = tmp_path / name
        shutil.copytree(built(name), path)
        config = json.loads((path / "config.json").read_text())
        edit(config)
        (path / "config.json").write_text(json.dumps(config))
        with pytest.raises(DrafterError, match=message):
            speculators_format.read(path)
    path = tmp_path / "repeated"
    shutil.copytree(built("eagle3_llama"), path)
    tensors, metadata = read_safetensors(path / "model.safetensors")
    tensors = {k: np.array(v) for k, v in tensors.items()}
    tensors["d2t"][5] = tensors["d2t"][4] - 1  # draft 5 -> the same target id as draft 4
    tensors.pop("t2d")
    write_safetensors(path / "model.safetensors", tensors, metadata)
    with pytest.raises(DrafterError, match=r"draft_to_target\[5\] = \d+: .*repeats"):
        speculators_format.read(path)
