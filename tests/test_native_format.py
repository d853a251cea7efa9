import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
from helpers import assert_same_drafter, base_is_mmap
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from strategies import specs

from woodcock.errors import DrafterError
from woodcock.formats import native
from woodcock.ir import Drafter, VocabCounts, VocabMap
from woodcock.loading import load_drafter, save_drafter
from woodcock.synthetic import random_drafter, tiny_spec
from woodcock.tensorfile import dtype_name, file_sha256, read_safetensors, write_safetensors


def with_counts(drafter: Drafter, seed: int) -> Drafter:
    rng = np.random.default_rng(seed)
    counts = VocabCounts(
        rng.integers(0, 1000, drafter.spec.target.vocab_size),
        {"source": "test", "holdout_coverage": {"8": 0.5}},
    )
    return Drafter(drafter.spec, VocabMap(drafter.vocab.draft_to_target, counts), drafter.weights)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    spec=specs(),
    dtype=st.sampled_from(["F32", "F16", "BF16"]),
    seed=st.integers(0, 2**16),
    counts=st.booleans(),
)
def test_ir_native_ir_round_trip_is_bit_exact(spec, dtype, seed, counts):
    drafter = random_drafter(spec, dtype, seed)
    if counts:
        drafter = with_counts(drafter, seed)
    with tempfile.TemporaryDirectory() as tmp:
        first, second = Path(tmp, "a"), Path(tmp, "b")
        save_drafter(drafter, first)
        loaded = load_drafter(first)
        assert_same_drafter(drafter, loaded)
        # writing what was read gives the same bytes: nothing is re-encoded or reordered
        save_drafter(loaded, second)
        for name in ("model.safetensors", "config.json", "woodcock.json"):
            assert (first / name).read_bytes() == (second / name).read_bytes(), name


@pytest.fixture
def saved(tmp_path):
    drafter = with_counts(
        random_drafter(tiny_spec("dspark", draft_vocab_size=50, num_layers=2), "BF16", 1), 1
    )
    path = tmp_path / "drafter"
    save_drafter(drafter, path)
    return drafter, path


def test_loaded_weights_are_memory_mapped(saved):
    _, path = saved
    drafter = load_drafter(path)
    assert all(base_is_mmap(array) for array in drafter.weights.values())


def test_existing_output_is_never_overwritten_without_force(saved):
    drafter, path = saved
    before = file_sha256(path / "model.safetensors")
    other = random_drafter(tiny_spec("eagle3"), seed=7)
    with pytest.raises(DrafterError, match="already exists; pass --force"):
        save_drafter(other, path)
    assert file_sha256(path / "model.safetensors") == before
    save_drafter(other, path, force=True)
    assert_same_drafter(load_drafter(path), other)
    assert sorted(p.name for p in path.parent.iterdir()) == ["drafter"]


def test_a_failed_write_leaves_nothing_behind(saved, monkeypatch):
    drafter, path = saved
    before = {p.name: p.read_bytes() for p in path.iterdir()}

    def explode(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(native, "write_json", explode)
    with pytest.raises(OSError):
        save_drafter(drafter, path, force=True)
    with pytest.raises(OSError):
        save_drafter(drafter, path.parent / "fresh")
    assert sorted(p.name for p in path.parent.iterdir()) == ["drafter"]
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before


def rehash(path: Path) -> None:
    """Make the manifest agree with the files again, as a careless tool editing them would."""
    manifest = json.loads((path / "woodcock.json").read_text())
    for name, entry in manifest["files"].items():
        entry["sha256"] = file_sha256(path / name)
        entry["bytes"] = (path / name).stat().st_size
    (path / "woodcock.json").write_text(json.dumps(manifest))


def rewrite_weights(path: Path, edit) -> None:
    tensors, metadata = read_safetensors(path / "model.safetensors")
    tensors = {k: np.array(v) for k, v in tensors.items()}
    edit(tensors)
    write_safetensors(path / "model.safetensors", tensors, metadata)
    manifest = json.loads((path / "woodcock.json").read_text())
    manifest["tensors"] = [
        {"name": n, "shape": list(a.shape), "dtype": row}
        for n, a, row in ((n, tensors[n], _dtype(tensors[n])) for n in sorted(tensors))
    ]
    (path / "woodcock.json").write_text(json.dumps(manifest))
    rehash(path)


def _dtype(array):
    return dtype_name(array)


def edit_json(path: Path, name: str, edit) -> None:
    data = json.loads((path / name).read_text())
    edit(data)
    (path / name).write_text(json.dumps(data))


@pytest.mark.parametrize(
    "damage, message",
    [
        (
            lambda p: (p / "model.safetensors").write_bytes(
                (p / "model.safetensors").read_bytes()[:-10]
            ),
            r"model.safetensors: \d+ bytes, the manifest says",
        ),
        (
            lambda p: _flip_byte(p / "model.safetensors"),
            "model.safetensors: sha256 .* does not match the manifest",
        ),
        (lambda p: _flip_byte(p / "config.json"), "config.json: sha256 .* does not match"),
        (lambda p: _flip_byte(p / "vocab_counts.npz"), "vocab_counts.npz: sha256"),
        (lambda p: (p / "config.json").unlink(), "config.json: missing file"),
        (lambda p: (p / "woodcock.json").unlink(), "woodcock.json: missing file"),
        (lambda p: (p / "woodcock.json").write_text("{"), "woodcock.json: not valid JSON"),
        (
            lambda p: edit_json(p, "woodcock.json", lambda m: m.pop("tensors")),
            r"woodcock.json: missing key\(s\) tensors",
        ),
        (
            lambda p: edit_json(p, "woodcock.json", lambda m: m.update(extra=1)),
            r"woodcock.json: unknown key\(s\) extra",
        ),
        (
            lambda p: edit_json(p, "woodcock.json", lambda m: m["files"].pop("model.safetensors")),
            "files has no entry for model.safetensors",
        ),
        (
            lambda p: (
                edit_json(p, "config.json", lambda c: c["algorithm"].pop("block_size")),
                rehash(p),
            ),
            r"config.json: algorithm: missing key\(s\) block_size",
        ),
        (
            lambda p: (
                edit_json(p, "config.json", lambda c: c["layers"][1].update(head_dim=9)),
                rehash(p),
            ),
            r"config.json: layers\[1\].head_dim = 9: expected an even number",
        ),
        (
            lambda p: (
                edit_json(p, "config.json", lambda c: c.update(format_version=7)),
                rehash(p),
            ),
            "format_version = 7: expected 1",
        ),
        (
            lambda p: (
                edit_json(p, "config.json", lambda c: c["taps"].update(layer_ids=[1, 2, 4])),
                rehash(p),
            ),
            r"woodcock.json: taps = .* disagrees with config.json",
        ),
        (
            lambda p: rewrite_weights(p, lambda t: t.update({"fc.weight": t["fc.weight"][:, :-1]})),
            r"weights\['fc.weight'\].shape = \(32, 95\): expected \(32, 96\)",
        ),
        (
            lambda p: rewrite_weights(p, lambda t: t.pop("layers.1.mlp.up_proj.weight")),
            r"missing tensor\(s\) layers.1.mlp.up_proj.weight",
        ),
        (
            lambda p: rewrite_weights(p, lambda t: t.pop("draft_to_target")),
            "draft_to_target = None: expected a map of 50 target ids",
        ),
        (
            lambda p: rewrite_weights(
                p, lambda t: t["draft_to_target"].__setitem__(3, t["draft_to_target"][2])
            ),
            r"draft_to_target\[3\] = \d+: .*repeats",
        ),
        (
            lambda p: rewrite_weights(p, lambda t: t["draft_to_target"].__setitem__(49, 96)),
            r"draft_to_target\[49\] = 96: expected a target id in \[0, 96\)",
        ),
        (
            lambda p: (
                edit_json(p, "woodcock.json", lambda m: m["tensors"][0].update(shape=[2])),
                rehash(p),
            ),
            r"confidence_head.proj.bias. is BF16 \[1\] but woodcock.json lists BF16 \[2\]",
        ),
        (
            lambda p: ((p / "vocab_counts.npz").write_bytes(b"PK\x03\x04junk"), rehash(p)),
            "vocab_counts.npz: not a readable .npz",
        ),
    ],
)
def test_damaged_drafters_give_one_clear_drafter_error(saved, damage, message):
    _, path = saved
    damage(path)
    with pytest.raises(DrafterError, match=message) as info:
        load_drafter(path)
    assert "\n" not in str(info.value)


def _flip_byte(file: Path, position: int = -3) -> None:
    data = bytearray(file.read_bytes())
    data[position] ^= 0xFF
    file.write_bytes(bytes(data))


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_random_damage_never_crashes_the_reader(data):
    """Any truncation or byte flip of any file is a DrafterError or (when only tensor values
    changed and checksums are off) a valid drafter: never another exception."""
    drafter = random_drafter(tiny_spec("eagle3", draft_vocab_size=20, tap_norm="concat"), "F16", 3)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "d")
        save_drafter(drafter, path)
        name = data.draw(st.sampled_from(["model.safetensors", "config.json", "woodcock.json"]))
        original = (path / name).read_bytes()
        raw = bytearray(original)
        if data.draw(st.booleans()):
            raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
        else:
            for _ in range(data.draw(st.integers(1, 4))):
                raw[data.draw(st.integers(0, len(raw) - 1))] ^= data.draw(st.integers(1, 255))
        assume(bytes(raw) != original)  # two flips of one byte can cancel out
        (path / name).write_bytes(bytes(raw))
        for verify in (True, False):
            try:
                native.read(path, verify=verify)
            except DrafterError as e:
                assert "\n" not in str(e)
            else:
                # the manifest holds the checksums and is not checksummed itself
                assert not verify or name == "woodcock.json", "a damaged file passed the checksum"


def test_provenance_is_recorded_in_the_manifest(tmp_path):
    drafter = random_drafter(tiny_spec("eagle3"))
    record = {"holdout_agreement": [0.8, 0.6, 0.5], "command": "woodcock train ..."}
    native.write(drafter, tmp_path / "d", provenance=record)
    assert native.read_provenance(tmp_path / "d") == record
    assert_same_drafter(native.read(tmp_path / "d"), drafter)
    native.write(drafter, tmp_path / "plain")
    assert native.read_provenance(tmp_path / "plain") == {}
