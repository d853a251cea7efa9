"""Fuzzing the formats: random valid drafters written and read back in every format that can
hold them, and random corruptions of valid checkpoints' bytes and JSON.

A corrupted checkpoint must load bit-identical to the original (the damage hit something the
reader does not use) or fail with a one-line DrafterError: never another exception, never a
hang. Tensor bytes are only fuzzed where the format records checksums (woodcock's sha256s);
other formats cannot tell a flipped weight from a trained one. Through the CLI, `inspect` and
`convert` exit 2 with one line and leave no output behind.
"""

import contextlib
import dataclasses
import json
import shutil
import signal
import struct
import tempfile
from pathlib import Path

import pytest
from helpers import assert_same_drafter, run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import json_mutations, specs

from woodcock.errors import DrafterError
from woodcock.formats.detect import FORMATS, format_named
from woodcock.formats.hf_config import HF_LAYER_DEFAULTS
from woodcock.ir import Drafter, Eagle3, Head, Taps
from woodcock.loading import load_drafter
from woodcock.synthetic import random_drafter, tiny_spec

TARGET_LAYERS = 8
DEFAULT = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None
)
LONG = settings(
    max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None
)


@contextlib.contextmanager
def time_limit(seconds: int):
    """A read that hangs is a failure, not a stuck test run."""

    def expire(*_):
        raise TimeoutError(f"no answer within {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _read(fmt, path: Path, spec):
    taps = spec.taps.layer_ids if fmt.NAME == "safeailab" else None
    return load_drafter(path, fmt.NAME, taps=taps)


# formats that do not store an EAGLE-3 drafter's chain length: read back as the IR's default
CHAIN_LENGTH_UNRECORDED = {"safeailab", "specforge"}


def _without_unrecorded_facts(spec, loaded_spec, fmt):
    """The facts about the target a format does not record come back as None / empty."""
    target = spec.target
    changes = {}
    for field in ("num_hidden_layers", "name_or_path"):
        if getattr(loaded_spec.target, field) is None:
            changes[field] = None
    if not loaded_spec.target.architectures:
        changes["architectures"] = ()
    algorithm = spec.algorithm
    if isinstance(algorithm, Eagle3) and fmt.NAME in CHAIN_LENGTH_UNRECORDED:
        default = Eagle3(norm_before_residual=False, norm_output=False).speculative_tokens
        algorithm = dataclasses.replace(algorithm, speculative_tokens=default)
    return dataclasses.replace(
        spec, algorithm=algorithm, target=dataclasses.replace(target, **changes)
    )


# ---------------------------------------------------------------------------------------------
# Round trips


def _round_trip(drafter: Drafter, fmt, folder: Path) -> None:
    out = folder / fmt.NAME
    try:
        with time_limit(30):
            fmt.write(drafter, out)
    except DrafterError as e:  # a format that cannot hold this drafter says so, and writes nothing
        assert "\n" not in str(e)
        assert not out.exists()
        assert not [p for p in folder.iterdir() if p.name.startswith(f".{fmt.NAME}.")]
        return
    with time_limit(30):
        loaded = _read(fmt, out, drafter.spec)
    expected = Drafter(
        _without_unrecorded_facts(drafter.spec, loaded.spec, fmt), drafter.vocab, drafter.weights
    )
    if fmt.NAME != "woodcock":  # only the native format keeps the token counts
        expected = Drafter(
            expected.spec, dataclasses.replace(expected.vocab, counts=None), expected.weights
        )
        loaded = Drafter(
            loaded.spec, dataclasses.replace(loaded.vocab, counts=None), loaded.weights
        )
    assert_same_drafter(expected, loaded)


def _check_every_format(spec, dtype, seed) -> None:
    drafter = random_drafter(spec, dtype, seed)
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in FORMATS:
            _round_trip(drafter, fmt, Path(tmp))


@DEFAULT
@given(spec=specs(), dtype=st.sampled_from(["F32", "BF16", "F16"]), seed=st.integers(0, 2**16))
def test_every_format_round_trips_what_it_accepts(spec, dtype, seed):
    _check_every_format(spec, dtype, seed)


@pytest.mark.slow
@LONG
@given(spec=specs(), dtype=st.sampled_from(["F32", "BF16", "F16"]), seed=st.integers(0, 2**16))
def test_every_format_round_trips_what_it_accepts_long(spec, dtype, seed):
    _check_every_format(spec, dtype, seed)


def test_every_format_accepts_some_drafter(tmp_path):
    """The round trips above are not all refusals: each format holds one of these."""
    written = set()
    for spec in _CHECKPOINT_SPECS.values():
        for fmt in FORMATS:
            try:
                fmt.write(random_drafter(spec), tmp_path / f"{fmt.NAME}-{len(written)}-{id(spec)}")
                written.add(fmt.NAME)
            except DrafterError:
                pass
    assert written == {fmt.NAME for fmt in FORMATS}


# ---------------------------------------------------------------------------------------------
# Corruptions


def _eagle3(**fields):
    spec = tiny_spec("eagle3", target_layers=TARGET_LAYERS, vocab_size=48, **fields)
    return dataclasses.replace(spec, taps=Taps((2, 4, 5)))


def _block(algorithm, **fields):
    return tiny_spec(algorithm, style="qwen3", target_layers=TARGET_LAYERS, vocab_size=48, **fields)


_CHECKPOINT_SPECS = {
    "woodcock": _eagle3(draft_vocab_size=20, tap_norm="per_tap"),
    "speculators": dataclasses.replace(
        _block("dspark", draft_vocab_size=20, markov_head_type="gated"),
        head=Head(lm_head="own", embedding="shared"),
    ),
    "safeailab": _eagle3(draft_vocab_size=20),
    "specforge": _eagle3(draft_vocab_size=20),
    "zlab-dflash": _block("dflash"),
    "specforge-dspark": _block("dspark", markov_head_type="vanilla"),
    "deepspec-dspark": dataclasses.replace(
        _block("dspark", markov_head_type="rnn", confidence_head_with_markov=False),
        head=Head(lm_head="own", embedding="own"),
    ),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """One valid checkpoint per format, and what it loads as."""
    root = tmp_path_factory.mktemp("fuzz-checkpoints")
    out = {}
    for name, spec in _CHECKPOINT_SPECS.items():
        fmt = format_named(name)
        fmt.write(random_drafter(spec, seed=5), root / name)
        out[name] = (root / name, _read(fmt, root / name, spec), spec)
    return out


def _files(folder: Path, suffix: str) -> list[str]:
    return sorted(p.name for p in folder.rglob(f"*{suffix}") if p.is_file())


def _header_length(data: bytes) -> int:
    return 8 + struct.unpack("<Q", data[:8])[0] if len(data) >= 8 else len(data)


@st.composite
def byte_corruptions(draw, data: bytes, body: bool):
    """New bytes for a safetensors file: a flipped / overwritten byte in the header (or, with
    body, anywhere), a truncation, or a forged header length."""
    header = _header_length(data)
    end = len(data) if body else min(header, len(data))
    kind = draw(st.sampled_from(["flip", "overwrite", "truncate", "length", "append"]))
    if kind == "truncate":
        return data[: draw(st.integers(0, max(0, len(data) - 1)))]
    if kind == "length":
        forged = draw(st.integers(0, 2**64 - 1) | st.integers(0, len(data) + 16))
        return struct.pack("<Q", forged) + data[8:]
    if kind == "append":
        return data + draw(st.binary(min_size=1, max_size=64))
    at = draw(st.integers(0, max(0, end - 1)))
    if kind == "flip":
        bit = 1 << draw(st.integers(0, 7))
        return data[:at] + bytes([data[at] ^ bit]) + data[at + 1 :]
    # an overwrite stays where it was drawn: a chunk from the header's last bytes must not reach
    # the weights of a format without checksums, where changed values cannot be seen
    chunk = draw(st.binary(min_size=1, max_size=max(1, min(16, end - at))))
    return data[:at] + chunk + data[at + len(chunk) :]


# Hugging Face config keys with a documented default: a config without one means the default
# (as transformers reads it), which need not be what the checkpoint was written with.
HF_DEFAULTED = {key for defaults in HF_LAYER_DEFAULTS.values() for key in defaults} | {
    "rope_theta",
    "rope_scaling",
}


def _expect_error_or_identical(
    path: Path, fmt_name: str, original: Drafter, spec, defaulted: bool = False
) -> None:
    try:
        with time_limit(30):
            loaded = load_drafter(
                path, taps=spec.taps.layer_ids if fmt_name == "safeailab" else None
            )
    except DrafterError as e:
        message = str(e)
        assert message and "\n" not in message
        return
    if not defaulted:
        # an optional fact about the target (its name, layer count) may be lost, nothing else;
        # its name and architectures are free text, so bytes overwritten inside them still read
        spec = _without_unrecorded_facts(original.spec, loaded.spec, format_named(fmt_name))
        named = {f: getattr(loaded.spec.target, f) for f in ("name_or_path", "architectures")}
        spec = dataclasses.replace(spec, target=dataclasses.replace(spec.target, **named))
        assert_same_drafter(Drafter(spec, original.vocab, original.weights), loaded)


def _corrupt_and_load(checkpoints, data, fmt_name: str, kind: str) -> None:
    source, original, spec = checkpoints[fmt_name]
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / fmt_name
        shutil.copytree(source, copy)
        if kind == "bytes":
            name = data.draw(st.sampled_from(_files(copy, ".safetensors")))
            target = copy / name
            body = fmt_name == "woodcock"  # sha256s make flipped weights detectable
            target.write_bytes(data.draw(byte_corruptions(target.read_bytes(), body)))
            defaulted = False
        else:
            name = data.draw(st.sampled_from(_files(copy, ".json")))
            target = copy / name
            text, deleted = data.draw(json_mutations(target.read_text()))
            target.write_text(text)
            defaulted = name == "config.json" and fmt_name != "woodcock" and deleted in HF_DEFAULTED
        _expect_error_or_identical(copy, fmt_name, original, spec, defaulted)


@DEFAULT
@given(data=st.data(), fmt_name=st.sampled_from(sorted(_CHECKPOINT_SPECS)))
def test_corrupted_tensor_files_fail_cleanly(checkpoints, data, fmt_name):
    _corrupt_and_load(checkpoints, data, fmt_name, "bytes")


@DEFAULT
@given(data=st.data(), fmt_name=st.sampled_from(sorted(_CHECKPOINT_SPECS)))
def test_corrupted_json_fails_cleanly(checkpoints, data, fmt_name):
    _corrupt_and_load(checkpoints, data, fmt_name, "json")


@pytest.mark.slow
@LONG
@given(
    data=st.data(),
    fmt_name=st.sampled_from(sorted(_CHECKPOINT_SPECS)),
    kind=st.sampled_from(["bytes", "json"]),
)
def test_corruptions_fail_cleanly_long(checkpoints, data, fmt_name, kind):
    _corrupt_and_load(checkpoints, data, fmt_name, kind)


# ---------------------------------------------------------------------------------------------
# Through the command line


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if not line.startswith("woodcock: warning")]
    assert len(lines) == 1, err
    assert lines[0].startswith("woodcock: error: "), err
    return lines[0]


@pytest.mark.parametrize(
    ("fmt_name", "file", "damage"),
    [
        ("woodcock", "model.safetensors", "truncate"),
        ("woodcock", "woodcock.json", "garbage"),
        ("speculators", "config.json", "garbage"),
        ("speculators", "model.safetensors", "header"),
        ("zlab-dflash", "config.json", "truncate"),
    ],
)
def test_the_cli_says_one_line_and_writes_nothing(
    checkpoints, tmp_path, capsys, fmt_name, file, damage
):
    source = tmp_path / "source"
    shutil.copytree(checkpoints[fmt_name][0], source)
    path = source / file
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        path.write_bytes(b'{"format": ' + data[12:40])
    else:
        path.write_bytes(data[:8] + b"[" + data[9:])
    code, out, err = run_cli(["inspect", str(source)], capsys)
    assert code == 2 and out == ""
    line = _one_error_line(err)
    assert str(source) in line
    dest = tmp_path / "converted"
    code, out, err = run_cli(["convert", str(source), str(dest), "--to", "woodcock"], capsys)
    assert code == 2
    _one_error_line(err)
    assert not dest.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["source"]


# ---------------------------------------------------------------------------------------------
# Reader bugs the fuzzing found, pinned


def test_a_manifest_tensor_row_without_a_string_name_is_refused(checkpoints, tmp_path):
    copy = tmp_path / "w"
    shutil.copytree(checkpoints["woodcock"][0], copy)
    manifest = json.loads((copy / "woodcock.json").read_text())
    manifest["tensors"][1]["name"] = None
    (copy / "woodcock.json").write_text(json.dumps(manifest))
    with pytest.raises(DrafterError, match="tensors rows need name, shape and dtype"):
        load_drafter(copy)


def test_a_speculators_model_type_that_is_not_a_string_is_refused(checkpoints, tmp_path):
    copy = tmp_path / "s"
    shutil.copytree(checkpoints["speculators"][0], copy)
    config = json.loads((copy / "config.json").read_text())
    config["speculators_model_type"] = ["dspark"]
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(DrafterError, match="speculators_model_type"):
        load_drafter(copy, "speculators")


def test_what_a_reader_misses_is_still_one_line_naming_the_directory(checkpoints, tmp_path):
    """The safety net in woodcock.loading: a reader's unexpected TypeError on a hand-edited
    file becomes a DrafterError that names the directory and the format."""
    copy = tmp_path / "z"
    shutil.copytree(checkpoints["zlab-dflash"][0], copy)
    config = json.loads((copy / "config.json").read_text())
    config["dflash_config"] = [config["dflash_config"]]
    (copy / "config.json").write_text(json.dumps(config))
    try:
        load_drafter(copy, "zlab-dflash")
    except DrafterError as e:
        assert str(copy) in str(e) and "\n" not in str(e)
    else:
        pytest.fail("a list in place of dflash_config was read")
