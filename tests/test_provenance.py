"""Paths in written records: relative beside the output, else a name and a sha256."""

import hashlib
import os

from woodcock.provenance import content_sha256, identity, portable_path, portable_paths
from woodcock.tensorfile import file_sha256


def test_paths_beside_the_output_are_relative_to_it(tmp_path):
    out = tmp_path / "runs" / "drafter"
    (tmp_path / "runs" / "data").mkdir(parents=True)
    assert portable_path(tmp_path / "runs" / "data", out) == "../data"
    assert portable_path(out / "log.jsonl", out) == "log.jsonl"
    assert portable_path(tmp_path / "runs" / "drafter.ckpt" / "log.jsonl", out) == (
        "../drafter.ckpt/log.jsonl"
    )


def test_other_paths_are_a_name_and_a_sha256_of_what_they_name(tmp_path):
    model = tmp_path / "cache" / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (model / "weights.bin").write_bytes(b"\x00\x01")
    (model / "features").mkdir()  # a subfolder does not count
    (model / "features" / "big.bin").write_bytes(b"x" * 100)
    out = tmp_path / "elsewhere" / "drafter"
    lines = "".join(
        f"{name} {file_sha256(model / name)}\n" for name in ("config.json", "weights.bin")
    )
    digest = hashlib.sha256(lines.encode()).hexdigest()
    assert content_sha256(model) == digest
    assert portable_path(model, out) == f"model@sha256:{digest}"
    assert portable_path(model / "config.json", out) == (
        f"config.json@sha256:{file_sha256(model / 'config.json')}"
    )
    (model / "weights.bin").write_bytes(b"\x00\x02")  # another model: another record
    assert portable_path(model, out) != f"model@sha256:{digest}"


def test_ids_and_words_stay_and_missing_absolute_paths_keep_their_name(tmp_path):
    out = tmp_path / "a" / "out"
    assert portable_path("HuggingFaceTB/SmolLM2-135M-Instruct", out) == (
        "HuggingFaceTB/SmolLM2-135M-Instruct"
    )
    assert portable_path("/nowhere/at/all/model", out) == "model"
    record = {"cmd": ["woodcock", "--steps", "3", str(tmp_path / "a" / "data")], "n": 3}
    assert portable_paths(record, out) == {"cmd": ["woodcock", "--steps", "3", "../data"], "n": 3}


def test_relative_paths_that_name_something_are_made_portable(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "data").mkdir(parents=True)
    out = tmp_path / "runs" / "drafter"
    assert portable_paths({"data": os.path.join("runs", "data")}, out) == {"data": "../data"}


def test_identity_does_not_depend_on_where_the_record_lies(tmp_path, monkeypatch):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert identity(model) == f"model@sha256:{content_sha256(model)}"
    monkeypatch.chdir(tmp_path)
    assert identity("model") == identity(model)
    assert identity("org/name") == "org/name"
    assert identity("/gone/model") == "model"
