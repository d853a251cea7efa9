"""The Woodcock native format: the IR on disk, nothing lost, every file checksummed.

config.json         the DrafterSpec (every field, tap ids in the canonical convention)
model.safetensors   the weights by canonical name, plus `draft_to_target` (int64 [Vd],
                    absolute target ids) when the draft vocabulary is reduced
vocab_counts.npz    optional: `counts` (int64 [target vocab])
vocab_counts.json   optional: what the counts were measured on (hold-out coverage, ...)
woodcock.json       the manifest: target, taps, the tensor table (name, shape, dtype) and
                    the sha256 and size of every other file; written last
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from woodcock import __version__
from woodcock.converters.vocab import COUNTS_FILE, COUNTS_INFO, load_counts
from woodcock.errors import DrafterError
from woodcock.ir import (
    CANONICAL_LAYER_CONVENTION,
    Drafter,
    VocabCounts,
    VocabMap,
    Weights,
    error_prefix,
    spec_from_dict,
    spec_to_dict,
    to_dict,
)
from woodcock.jsonfile import read_json_object, write_json
from woodcock.staging import check, staged_directory
from woodcock.tensorfile import (
    dtype_name,
    file_sha256,
    read_header,
    read_safetensors,
    write_safetensors,
)

NAME = "woodcock"
LAYER_CONVENTION = CANONICAL_LAYER_CONVENTION
SIGNATURE = "woodcock.json"

FORMAT_VERSION = 1
MANIFEST = "woodcock.json"
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
VOCAB_TENSOR = "draft_to_target"
MANIFEST_KEYS = (
    "format",
    "format_version",
    "woodcock_version",
    "algorithm",
    "target",
    "taps",
    "draft_vocab_size",
    "tensors",
    "files",
)


def matches(path: Path) -> bool:
    """The manifest, or a native config without it (read then says the manifest is missing,
    rather than another format's reader refusing the config's keys)."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return True
    try:
        config = read_json_object(path / CONFIG)
    except DrafterError:
        return False
    return {"format_version", "taps", "fusion"} <= set(config)


def write(
    drafter: Drafter, path: Path, *, force: bool = False, provenance: dict | None = None
) -> None:
    """provenance: free-form facts recorded in the manifest (how the drafter was trained, its
    hold-out agreement by draft step, ...); see `read_provenance`."""
    spec = drafter.spec
    tensors = dict(drafter.weights)
    if drafter.vocab.draft_to_target is not None:
        tensors[VOCAB_TENSOR] = drafter.vocab.draft_to_target
    with staged_directory(path, force=force) as out:
        files = {WEIGHTS: write_safetensors(out / WEIGHTS, tensors, {"format": "pt"})}
        write_json(out / CONFIG, {"format_version": FORMAT_VERSION, **spec_to_dict(spec)})
        files[CONFIG] = file_sha256(out / CONFIG)
        counts = drafter.vocab.counts
        if counts is not None:
            np.savez(out / COUNTS_FILE, counts=counts.counts)
            write_json(out / COUNTS_INFO, counts.info)
            files[COUNTS_FILE] = file_sha256(out / COUNTS_FILE)
            files[COUNTS_INFO] = file_sha256(out / COUNTS_INFO)
        manifest = {
            "format": NAME,
            "format_version": FORMAT_VERSION,
            "woodcock_version": __version__,
            "algorithm": spec.algorithm.name,
            "target": to_dict(spec.target),
            "taps": to_dict(spec.taps),
            "draft_vocab_size": spec.draft_vocab_size,
            "tensors": [
                {
                    "name": name,
                    "shape": list(tensors[name].shape),
                    "dtype": dtype_name(tensors[name]),
                }
                for name in sorted(tensors)
            ],
            "files": {
                name: {"sha256": digest, "bytes": (out / name).stat().st_size}
                for name, digest in sorted(files.items())
            },
        }
        if provenance:
            manifest["provenance"] = provenance
        write_json(out / MANIFEST, manifest)


def read(path: Path, *, verify: bool = True, taps: Sequence[int] | None = None) -> Drafter:
    """Load a native drafter; weights stay memory-mapped. `verify` checks every sha256 (the
    weights' through `staging.check`: in a thread when a conversion overlaps it with writing).
    The format records its taps: `taps`, if given, must agree with them."""
    path = Path(path)
    manifest = _read_manifest(path)
    if verify:
        _verify_files(path, manifest["files"])
    config = read_json_object(path / CONFIG)
    with error_prefix(f"{path / CONFIG}: "):
        version = config.pop("format_version", None)
        if version != FORMAT_VERSION:
            raise DrafterError(f"format_version = {version!r}: expected {FORMAT_VERSION}")
        spec = spec_from_dict(config)
    for key, value in (
        ("algorithm", spec.algorithm.name),
        ("target", to_dict(spec.target)),
        ("taps", to_dict(spec.taps)),
        ("draft_vocab_size", spec.draft_vocab_size),
    ):
        if manifest[key] != value:
            raise DrafterError(
                f"{path / MANIFEST}: {key} = {manifest[key]!r} disagrees with {CONFIG} ({value!r})"
            )
    if taps is not None and tuple(taps) != spec.taps.layer_ids:
        raise DrafterError(
            f"{path / CONFIG}: records taps {list(spec.taps.layer_ids)}; --taps {list(taps)}"
            " disagrees (the native format is never re-tapped on read)"
        )
    _check_tensor_table(path, manifest["tensors"])
    tensors, _ = read_safetensors(path / WEIGHTS)
    draft_to_target = tensors.pop(VOCAB_TENSOR, None)
    counts = _read_counts(path) if COUNTS_FILE in manifest["files"] else None
    with error_prefix(f"{path}: "):
        return Drafter(spec, VocabMap(draft_to_target, counts), Weights(tensors))


def read_provenance(path: Path) -> dict[str, Any]:
    """The manifest's provenance record ({} when there is none)."""
    provenance = _read_manifest(Path(path)).get("provenance", {})
    if not isinstance(provenance, dict):
        raise DrafterError(f"{Path(path) / MANIFEST}: provenance must be an object")
    return provenance


def _read_manifest(path: Path) -> dict[str, Any]:
    manifest_path = path / MANIFEST
    manifest = read_json_object(manifest_path)
    unknown = sorted(set(manifest) - set(MANIFEST_KEYS) - {"provenance"})
    missing = [k for k in MANIFEST_KEYS if k not in manifest]
    if unknown or missing:
        raise DrafterError(
            f"{manifest_path}: "
            + "; ".join(
                part
                for part in (
                    f"missing key(s) {', '.join(missing)}" if missing else "",
                    f"unknown key(s) {', '.join(unknown)}" if unknown else "",
                )
                if part
            )
        )
    if manifest["format"] != NAME or manifest["format_version"] != FORMAT_VERSION:
        raise DrafterError(
            f"{manifest_path}: format {manifest['format']!r} version"
            f" {manifest['format_version']!r}; expected {NAME!r} version {FORMAT_VERSION}"
        )
    files = manifest["files"]
    if not isinstance(files, dict) or not all(
        isinstance(v, dict) and isinstance(v.get("sha256"), str) and isinstance(v.get("bytes"), int)
        for v in files.values()
    ):
        raise DrafterError(f"{manifest_path}: files must map file names to {{sha256, bytes}}")
    for required in (CONFIG, WEIGHTS):
        if required not in files:
            raise DrafterError(f"{manifest_path}: files has no entry for {required}")
    if (COUNTS_FILE in files) != (COUNTS_INFO in files):
        raise DrafterError(
            f"{manifest_path}: files must list both {COUNTS_FILE} and {COUNTS_INFO}, or neither"
        )
    unlisted = sorted(set(files) - {CONFIG, WEIGHTS, COUNTS_FILE, COUNTS_INFO})
    if unlisted:
        raise DrafterError(f"{manifest_path}: files lists unknown file(s) {', '.join(unlisted)}")
    if not isinstance(manifest["tensors"], list):
        raise DrafterError(f"{manifest_path}: tensors must be a list")
    return manifest


def _verify_files(path: Path, files: dict[str, dict]) -> None:
    """Sizes first, then the small files' sha256s, then the weights' (in the background when
    the caller allows it)."""
    for name, entry in files.items():
        file = path / name
        if not file.is_file():
            raise DrafterError(f"{file}: missing file (listed in {MANIFEST})")
        size = file.stat().st_size
        if size != entry["bytes"]:
            raise DrafterError(
                f"{file}: {size} bytes, the manifest says {entry['bytes']} (damaged or replaced)"
            )
    for name, entry in files.items():
        if name != WEIGHTS:
            _verify_sha256(path / name, entry["sha256"])
    check(lambda: _verify_sha256(path / WEIGHTS, files[WEIGHTS]["sha256"]))


def _verify_sha256(file: Path, expected: str) -> None:
    digest = file_sha256(file)
    if digest != expected:
        raise DrafterError(
            f"{file}: sha256 {digest[:16]}... does not match the manifest's"
            f" {expected[:16]}... (damaged or replaced)"
        )


def _check_tensor_table(path: Path, table: list) -> None:
    _, header = read_header(path / WEIGHTS)
    header.pop("__metadata__", None)
    stored = {name: (entry["shape"], entry["dtype"]) for name, entry in header.items()}
    try:
        listed = {row["name"]: (row["shape"], row["dtype"]) for row in table}
    except (TypeError, KeyError):
        listed = None
    if listed is None or not all(isinstance(name, str) for name in listed):
        raise DrafterError(f"{path / MANIFEST}: tensors rows need name, shape and dtype") from None
    if listed != stored:
        differing = sorted(n for n in set(listed) | set(stored) if listed.get(n) != stored.get(n))
        name = differing[0]
        raise DrafterError(
            f"{path / WEIGHTS}: tensor {name!r} is {_describe(stored.get(name))} but {MANIFEST}"
            f" lists {_describe(listed.get(name))}"
        )


def _describe(entry: tuple | None) -> str:
    return "absent" if entry is None else f"{entry[1]} {entry[0]}"


def _read_counts(path: Path) -> VocabCounts:
    return load_counts(path / COUNTS_FILE).counts
