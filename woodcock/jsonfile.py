"""JSON files with errors that name the file."""

from __future__ import annotations

import json
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


def write_json(path: Path, data: Any) -> None:
    Path(path).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
