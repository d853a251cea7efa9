"""Paths in the records a command writes next to its output (a drafter's provenance, a counts
file's source, a distillation's target), in a form that means something on another machine.

A path inside the folder that holds the output (the output itself, a sibling run, its
checkpoints) is recorded relative to the output, e.g. `../distill`. Any other path that exists
is recorded as its name and a sha256 of what it names, `NAME@sha256:HEX`, so that a cache or a
home directory never appears in a shipped file yet the record still identifies the model or
file used. A Hugging Face id (no such path here) is kept as it is.

What a record is compared against later (the target a distillation was made with) is recorded
by `identity` alone, so that the comparison does not depend on where the output lies.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path
from typing import Any

from woodcock.tensorfile import file_sha256


def portable_path(path: str | Path, out: str | Path) -> str:
    """`path` as a record next to the output `out` keeps it (see the module docstring)."""
    text = str(path)
    candidate = Path(text).expanduser()
    if not candidate.is_absolute() and not candidate.exists():
        return text  # a Hugging Face id, or a relative word that names nothing here
    resolved = candidate.resolve()
    home = Path(out).resolve().parent
    if resolved == home or home in resolved.parents:
        return os.path.relpath(resolved, Path(out).resolve())
    return identity(resolved)


def identity(path: str | Path) -> str:
    """What `path` names, wherever it lies: `NAME@sha256:HEX` for a file or folder here, the
    name alone for an absolute path that is gone, the text itself otherwise (a Hugging Face id).
    For records compared later (was this made by the same model?), not for locations."""
    text = str(path)
    candidate = Path(text).expanduser()
    if not candidate.exists():
        return candidate.name if candidate.is_absolute() else text
    resolved = candidate.resolve()
    return f"{resolved.name}@sha256:{content_sha256(resolved)}"


def same_content(recorded: object, current: object) -> bool:
    """Whether two records are of the same thing: `identity`s compare by their sha256 alone (one
    model under another folder name is the same model), anything else as is."""
    if isinstance(recorded, str) and isinstance(current, str):
        theirs, ours = recorded.partition("@sha256:"), current.partition("@sha256:")
        if theirs[1] and ours[1]:
            return theirs[2] == ours[2]
    return recorded == current


def content_sha256(path: Path) -> str:
    """A file's sha256; for a folder, the sha256 of the `NAME SHA256` lines of the files
    directly inside it, in name order (subfolders, such as feature caches, are left out)."""
    if path.is_file():
        return _file_sha256(path, path.stat().st_mtime_ns)
    lines = "".join(
        f"{entry.name} {_file_sha256(entry, entry.stat().st_mtime_ns)}\n"
        for entry in sorted(path.iterdir(), key=lambda p: p.name)
        if entry.is_file()
    )
    return hashlib.sha256(lines.encode()).hexdigest()


@functools.lru_cache(maxsize=64)
def _file_sha256(path: Path, mtime_ns: int) -> str:
    # a record names the same target several times (command, recipe, data): hash it once
    return file_sha256(path)


def portable_paths(record: Any, out: str | Path) -> Any:
    """`record` (JSON-like) with every string that is a path made portable: absolute paths, and
    relative ones with a separator that name something here. Other strings stay as they are."""
    if isinstance(record, dict):
        return {key: portable_paths(value, out) for key, value in record.items()}
    if isinstance(record, list | tuple):
        return [portable_paths(value, out) for value in record]
    if isinstance(record, str) and _is_path(record):
        return portable_path(record, out)
    return record


def _is_path(text: str) -> bool:
    if os.path.isabs(text):
        return True
    return os.sep in text and Path(text).exists()
