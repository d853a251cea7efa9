"""JSON files with errors that name the file."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from woodcock.errors import DrafterError


def read_json_object(path: Path) -> dict[str, Any]:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DrafterError(f"{path}: missing file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DrafterError(f"{path}: cannot be read ({e})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise DrafterError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise DrafterError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def jsonl_records(path: Path) -> Iterator[tuple[str, Any]]:
    """(`FILE:LINE`, the decoded value) of every non-blank line of a JSONL file, read as it
    goes. Lines end at "\n" only: a record may hold U+2028 or a lone "\r"."""
    path = Path(path)
    try:
        handle = path.open("rb")
    except FileNotFoundError:
        raise DrafterError(f"{path}: missing file") from None
    except OSError as e:
        raise DrafterError(f"{path}: cannot be read ({e.strerror or e})") from None
    with handle:
        for number, raw in enumerate(handle, 1):
            where = f"{path}:{number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise DrafterError(f"{where}: not UTF-8 text") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DrafterError(f"{where}: not valid JSON ({e.msg})") from None
            yield where, record


def is_int_list(value: Any) -> bool:
    """A JSON list of integers (token ids), booleans not counted."""
    return isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    )


def outside_range(ids: Sequence[int], size: int) -> int | None:
    """The first of `ids` not a token of a `size`-token vocabulary (not in [0, size)), else
    None. Plain integers: JSON's are unbounded, and one past int64 must be named, not crash a
    conversion to an array."""
    return next((t for t in ids if not 0 <= t < size), None)


def write_json(path: Path, data: Any) -> None:
    Path(path).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
