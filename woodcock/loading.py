"""Load and save drafters by path or Hugging Face id, in any supported format."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from woodcock.errors import DrafterError
from woodcock.formats.detect import detect, format_named
from woodcock.ir import Drafter

HF_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def resolve_source(source: str | Path) -> Path:
    """A local directory as is; `org/name` not present locally is a Hugging Face repository,
    fetched (or found in the local cache when offline) with huggingface_hub."""
    path = Path(source).expanduser()
    if path.exists() or not HF_REPO_ID.fullmatch(str(source)):
        return path
    import huggingface_hub
    from huggingface_hub.errors import HFValidationError

    try:
        return Path(huggingface_hub.snapshot_download(repo_id=str(source)))
    except (OSError, ValueError, HFValidationError) as e:
        # OSError covers the hub's HTTP and offline-cache errors.
        raise DrafterError(
            f"{source}: not a local directory, and fetching it as a Hugging Face repository"
            f" failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from None


def load_drafter_with_format(
    source: str | Path, format: str | None = None, *, taps: Sequence[int] | None = None
) -> tuple[Drafter, ModuleType]:
    """`taps` (canonical layer ids) supplies tap ids a format did not record."""
    path = resolve_source(source)
    fmt = format_named(format) if format else detect(path)
    return fmt.read(path, taps=taps), fmt


def load_drafter(
    source: str | Path, format: str | None = None, *, taps: Sequence[int] | None = None
) -> Drafter:
    return load_drafter_with_format(source, format, taps=taps)[0]


def save_drafter(
    drafter: Drafter, dest: str | Path, format: str = "woodcock", *, force: bool = False
) -> None:
    format_named(format).write(drafter, Path(dest), force=force)
