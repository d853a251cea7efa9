"""The drafters that ship with Woodcock, one folder each, installed as `woodcock.drafters`."""

if __name__ != "woodcock.drafters":
    raise ImportError(f"import woodcock.drafters, not {__name__} (this folder belongs to woodcock)")

from importlib.resources import files
from pathlib import Path

from woodcock.errors import DrafterError

# The drafter `generate`, `bench` and `serve` use with the default target.
DEFAULT = "smollm2-135m-eagle3"


def shipped_drafter(name: str = DEFAULT) -> Path:
    """The folder of the shipped drafter `name`, in a checkout or an installed wheel."""
    path = Path(str(files(__name__) / name))
    if not (path / "woodcock.json").is_file():
        raise DrafterError(f"{path}: the shipped drafter {name!r} is missing; pass --drafter")
    return path


def shipped_names() -> list[str]:
    """The folder names of every shipped drafter."""
    root = Path(str(files(__name__)))
    return sorted(p.name for p in root.iterdir() if (p / "woodcock.json").is_file())
