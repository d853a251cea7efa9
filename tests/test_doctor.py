"""`woodcock doctor` on a tiny pair built so that each classic conversion mistake matters.

The target is `woodcock.demo`'s tiny Qwen3 with its weights replaced by ones laid out in
subspaces of the 64-wide residual stream: the embedding and the head live in dims A = 0..31, so
the next token is (nearly) a function of the current one; layer 0's MLP also writes into
G = 32..39, and layer l's MLP writes into its own B_l (six dims each from 40 on). The residual
stream after L layers therefore holds B_0..B_{L-1} and not B_L: which layer a tap reads is
visible.

The drafter is the demo's hand-written bigram drafter (attention copies the row's own embedding,
the head turns it into the target's next token), with an own embedding and an own head over a
reduced vocabulary, and a fusion that is exactly zero for the right taps and the right norm:
tap j (id j+1) is read from B_{j+1}, which the right layer has not written yet, and from G,
which its fc_norm weight zeroes. Shift the taps and B_{j+1} is there; drop the norm and G comes
through: either way attention carries it into the head's dims and floods the copied embedding. A random embedding breaks the copy, and
shuffled head rows break the head.
"""

import dataclasses
import json

import numpy as np
import pytest
from helpers import run_cli

from woodcock import doctor
from woodcock.demo import bigram_drafter, write_tiny_target
from woodcock.formats import native
from woodcock.ir import Drafter, Fusion, Head, Taps, VocabMap, Weights
from woodcock.tensorfile import read_safetensors

HIDDEN, EMBED_DIMS = 64, 32
G = slice(32, 40)


def _b(layer: int) -> slice:
    return slice(40 + 6 * layer, 46 + 6 * layer)


def _write_layered_target(path):
    """The demo's target directory (tokenizer, config) with the subspace weights above."""
    import mlx.core as mx

    write_tiny_target(path)
    config = json.loads((path / "config.json").read_text())
    weights, _ = read_safetensors(path / "model.safetensors")
    rng = np.random.default_rng(1)
    vocab, width = config["vocab_size"], config["intermediate_size"]
    out = {name: np.array(array, np.float32) for name, array in weights.items()}
    embedding = np.zeros((vocab, HIDDEN), np.float32)
    embedding[:, :EMBED_DIMS] = rng.standard_normal((vocab, EMBED_DIMS))
    head = np.zeros((vocab, HIDDEN), np.float32)
    head[:, :EMBED_DIMS] = rng.standard_normal((vocab, EMBED_DIMS))
    out["model.embed_tokens.weight"], out["lm_head.weight"] = embedding, head
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        o_proj = np.zeros((HIDDEN, HIDDEN), np.float32)  # context mixes into A only, weakly
        o_proj[:EMBED_DIMS] = 0.05 * rng.standard_normal((EMBED_DIMS, HIDDEN)) / 8
        out[prefix + "self_attn.o_proj.weight"] = o_proj
        down = np.zeros((HIDDEN, width), np.float32)
        down[_b(layer)] = 4 * rng.standard_normal((6, width)) / np.sqrt(width)
        if layer == 0:
            down[G] = 4 * rng.standard_normal((8, width)) / np.sqrt(width)
        out[prefix + "mlp.down_proj.weight"] = down
    mx.save_safetensors(str(path / "model.safetensors"), {k: mx.array(v) for k, v in out.items()})
    return out


def _correct_drafter(target_dir, target_weights) -> Drafter:
    base = bigram_drafter(target_dir)
    spec = base.spec
    embedding = target_weights["model.embed_tokens.weight"]
    head = target_weights["lm_head.weight"]
    # the draft vocabulary: every token the (near-)bigram target can emit next
    ids = np.unique((embedding @ head.T).argmax(axis=1)).astype(np.int64)
    taps = (1, 2, 3)
    rng = np.random.default_rng(2)
    tap_norm = np.ones(HIDDEN, np.float32)
    tap_norm[G] = 0.0
    free = slice(EMBED_DIMS, HIDDEN)  # the drafter's dims the copied embedding leaves empty
    fc = np.zeros((HIDDEN, len(taps) * HIDDEN), np.float32)
    for j, layer_id in enumerate(taps):
        for source in (_b(layer_id), G):  # not yet written by the right layer; muted by the norm
            columns = slice(j * HIDDEN + source.start, j * HIDDEN + source.stop)
            fc[free, columns] = rng.standard_normal(
                (HIDDEN - EMBED_DIMS, source.stop - source.start)
            )
    # attention also carries the fed-back half's free dims, and o_proj sends them into the
    # head's dims: the fused state must be exactly zero there, whatever the norm flags
    v_proj = np.zeros((HIDDEN, 2 * HIDDEN), np.float32)
    v_proj[:EMBED_DIMS, :EMBED_DIMS] = np.eye(EMBED_DIMS)
    v_proj[free, HIDDEN + EMBED_DIMS :] = np.eye(HIDDEN - EMBED_DIMS)
    o_proj = np.zeros((HIDDEN, HIDDEN), np.float32)
    o_proj[:EMBED_DIMS, :EMBED_DIMS] = 16 * np.eye(EMBED_DIMS)
    o_proj[:EMBED_DIMS, free] = 64 * rng.standard_normal((EMBED_DIMS, HIDDEN - EMBED_DIMS))
    spec = dataclasses.replace(
        spec,
        taps=Taps(taps),
        fusion=Fusion(tap_norm="per_tap", fc_bias=False, hidden_norm=False),
        head=Head(lm_head="own", embedding="own"),
        draft_vocab_size=len(ids),
    )
    weights = dict(base.weights) | {
        "fc.weight": fc,
        "layers.0.self_attn.v_proj.weight": v_proj,
        "layers.0.self_attn.o_proj.weight": o_proj,
        "embed_tokens.weight": embedding,
        "lm_head.weight": head[ids],
    }
    weights |= {f"fc_norm.{j}.weight": tap_norm for j in range(len(taps))}
    return Drafter(spec, VocabMap(ids), Weights(weights))


def _shifted_taps(drafter: Drafter) -> Drafter:
    taps = Taps(tuple(i + 1 for i in drafter.spec.taps.layer_ids))
    return Drafter(dataclasses.replace(drafter.spec, taps=taps), drafter.vocab, drafter.weights)


def _dropped_norm(drafter: Drafter) -> Drafter:
    fusion = dataclasses.replace(drafter.spec.fusion, tap_norm="none")
    weights = {k: v for k, v in drafter.weights.items() if not k.startswith("fc_norm.")}
    return Drafter(dataclasses.replace(drafter.spec, fusion=fusion), drafter.vocab, weights)


def _permuted_d2t(drafter: Drafter) -> Drafter:
    """The map's ids in a different order than the head's rows (the map stays a valid sorted
    injection, as a converter that sorted d2t without moving the rows would leave it)."""
    order = np.random.default_rng(3).permutation(drafter.spec.draft_vocab_size)
    weights = dict(drafter.weights) | {"lm_head.weight": drafter.weights["lm_head.weight"][order]}
    return Drafter(drafter.spec, drafter.vocab, weights)


def _random_embedding(drafter: Drafter) -> Drafter:
    shape = drafter.weights["embed_tokens.weight"].shape
    random = np.random.default_rng(4).standard_normal(shape).astype(np.float32)
    return Drafter(
        drafter.spec, drafter.vocab, dict(drafter.weights) | {"embed_tokens.weight": random}
    )


BREAKAGES = {
    "shifted_taps": _shifted_taps,
    "dropped_norm": _dropped_norm,
    "permuted_d2t": _permuted_d2t,
    "random_embedding": _random_embedding,
}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("doctor")
    target = root / "target"
    target.mkdir()
    weights = _write_layered_target(target)
    correct = _correct_drafter(target, weights)
    native.write(correct, root / "correct")
    for name, breakage in BREAKAGES.items():
        native.write(breakage(correct), root / name)
    return root


def _diagnose(pair, name, **options):
    return doctor.diagnose(str(pair / "target"), str(pair / name), answer_tokens=24, **options)


def test_a_correct_drafter_is_healthy(pair):
    report = _diagnose(pair, "correct")
    assert report["findings"] == [], report["findings"]
    assert report["healthy"] and report["exit_code"] == 0
    assert report["agreement"]["by_step"][0] > 0.5
    assert report["checks"]["embedding"]["mean_cosine"] > 0.999
    assert report["checks"]["vocab_map"]["coverage"] >= doctor.VOCAB_COVERAGE
    assert "healthy" in doctor.render_text(report)


def _causes(report):
    return [cause.get("variant") for cause in report["likely_causes"]]


def test_shifted_taps_are_found_and_ranked_first(pair):
    report = _diagnose(pair, "shifted_taps")
    assert report["exit_code"] == 1
    assert report["agreement"]["by_step"][0] < doctor.MISCONVERTED_BELOW
    first = report["likely_causes"][0]
    assert first["variant"] == "taps-1"
    assert first["variant_step1_agreement"] > 0.5
    assert "--retap 1,2,3" in first["test"]


def test_a_dropped_tap_norm_is_found(pair):
    report = _diagnose(pair, "dropped_norm")
    assert report["exit_code"] == 1
    assert report["agreement"]["by_step"][0] < doctor.MISCONVERTED_BELOW
    causes = [cause["cause"] for cause in report["likely_causes"]]
    assert any("tap norm dropped" in cause for cause in causes[:3]), causes
    # the dropped weights cannot be guessed back (a unit-weight norm does not mute G), and no
    # other variant is claimed to fix it
    for cause in report["likely_causes"]:
        if "variant" in cause:
            assert cause["evidence"].startswith("undoing it does not help"), cause


def test_a_permuted_vocab_map_is_found_and_its_order_recovered(pair):
    report = _diagnose(pair, "permuted_d2t")
    assert report["exit_code"] == 1
    assert any(
        f["check"] == "vocab_map" and "out of order" in f["message"] for f in report["findings"]
    )
    first = report["likely_causes"][0]
    assert first["variant"] == "reordered_head" and first["variant_step1_agreement"] > 0.5


def test_a_random_embedding_is_found(pair):
    report = _diagnose(pair, "random_embedding")
    assert report["exit_code"] == 1
    messages = [f["message"] for f in report["findings"] if f["check"] == "embedding"]
    assert messages and "embed_tokens.weight" in messages[0]
    assert report["likely_causes"][0]["variant"] == "target_embedding"
    text = doctor.render_text(report)
    assert "likely causes" in text and "embed_tokens.weight" in text


def test_a_drafter_for_a_deeper_target_is_a_finding_not_a_crash(pair, tmp_path):
    from woodcock.ir import Target

    correct = native.read(pair / "correct")
    deeper = Target(**{**dataclasses.asdict(correct.spec.target), "num_hidden_layers": 8})
    spec = dataclasses.replace(correct.spec, target=deeper, taps=Taps((1, 2, 7)))
    native.write(Drafter(spec, correct.vocab, correct.weights), tmp_path / "deeper")
    report = doctor.diagnose(str(pair / "target"), str(tmp_path / "deeper"))
    assert report["exit_code"] == 1
    checks = {f["check"] for f in report["findings"]}
    assert checks == {"shape", "taps"}
    assert "agreement" not in report  # nothing runs on taps the target does not have
    assert "another target" in report["likely_causes"][0]["cause"]


def test_taps_the_target_cannot_have_are_refused(pair):
    from woodcock.errors import DrafterError

    with pytest.raises(DrafterError, match="taps.layer_ids"):
        _diagnose(pair, "correct", retap=(1, 2, 9))
    with pytest.raises(DrafterError, match=r"records taps \[1, 2, 3\]; --taps \[1, 2, 4\]"):
        _diagnose(pair, "correct", taps=(1, 2, 4))  # --taps supplies, never replaces


def test_the_retap_option_tests_a_suspected_shift(pair):
    report = _diagnose(pair, "shifted_taps", retap=(1, 2, 3))
    assert report["healthy"], report["findings"]


@pytest.mark.parametrize("fmt", ["woodcock", "speculators"])
def test_the_fix_doctor_prints_for_shifted_taps_works(pair, tmp_path, capsys, fmt):
    """The commands doctor prints, run as printed, on the shifted drafter in formats that record
    its taps (each refuses a --taps that disagrees)."""
    from woodcock.formats.detect import format_named
    from woodcock.loading import load_drafter

    source = tmp_path / fmt
    format_named(fmt).write(load_drafter(pair / "shifted_taps"), source)
    report = _diagnose(pair, source)
    test, fix = report["likely_causes"][0]["test"].split(" (")[0].split("; to fix: ")
    fixed = tmp_path / "fixed"
    assert run_cli(test.split()[1:], capsys)[0] == 0
    code, _, err = run_cli(fix.replace("OUT", str(fixed)).split()[1:], capsys)
    assert code == 0, err
    assert load_drafter(fixed).spec.taps.layer_ids == (1, 2, 3)
    assert _diagnose(pair, fixed)["healthy"]


def test_a_drafter_that_cannot_be_read_is_a_drafter_error(pair, tmp_path):
    from woodcock.errors import DrafterError

    (tmp_path / "empty").mkdir()
    with pytest.raises(DrafterError, match="no known drafter format"):
        doctor.diagnose(str(pair / "target"), str(tmp_path / "empty"))


def test_the_report_is_json(pair):
    report = _diagnose(pair, "random_embedding")
    assert json.loads(json.dumps(report)) == report
