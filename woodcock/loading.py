"""Load and save drafters by path or Hugging Face id, in any supported format."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from woodcock.errors import DrafterError
from woodcock.formats.detect import detect, format_named
from woodcock.ir import Drafter

# huggingface_hub (which loads httpx) is imported only when a Hugging Face id is fetched.

HF_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def resolve_source(source: str | Path) -> Path:
    """A local directory as is; a string `org/name` not present locally is a Hugging Face
    repository, fetched (or found in the local cache when offline) with huggingface_hub. One
    that cannot be had is a DrafterError saying why and what to do instead. A Path is always
    local: `Path("./org/name")` prints as `org/name`, and a source resolved once must not be
    looked up on the Hub the second time."""
    path = Path(source).expanduser()
    if isinstance(source, Path) or path.exists() or not HF_REPO_ID.fullmatch(source):
        return path
    import huggingface_hub

    try:
        return Path(huggingface_hub.snapshot_download(repo_id=str(source)))
    except Exception as e:  # the hub raises HTTP, offline-cache, validation and OS errors
        raise DrafterError(
            f"{source}: not a local directory, and fetching it as a Hugging Face repository"
            f" failed: {_why_not_fetched(source, e)}; download it"
            f" (huggingface-cli download {source} --local-dir DIR) and pass that directory"
        ) from None


def _why_not_fetched(source: str | Path, error: Exception) -> str:
    from huggingface_hub import errors

    kind = type(error).__name__
    detail = str(error).splitlines()[0] if str(error) else ""
    if isinstance(error, errors.GatedRepoError):
        return (
            "it is a gated Hugging Face repository (accept its terms on the Hub and log in"
            " with `huggingface-cli login`)"
        )
    if isinstance(error, errors.RepositoryNotFoundError):
        return "no Hugging Face repository of that name could be found (unknown or private)"
    if isinstance(error, errors.LocalEntryNotFoundError):
        offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
        where = "offline mode is on (HF_HUB_OFFLINE)" if offline else "the Hub could not be reached"
        return f"it is not in the local Hugging Face cache and {where}"
    if isinstance(error, errors.HFValidationError):
        return f"it is not a valid Hugging Face repository id ({detail})"
    return f"{kind}: {detail}"


def load_drafter_with_format(
    source: str | Path, format: str | None = None, *, taps: Sequence[int] | None = None
) -> tuple[Drafter, ModuleType]:
    """`taps` (canonical layer ids) supplies tap ids a format did not record."""
    path = resolve_source(source)
    with _malformed_input_is_a_drafter_error(path):
        fmt = format_named(format) if format else detect(path)
    with _malformed_input_is_a_drafter_error(path, fmt.NAME):
        return fmt.read(path, taps=taps), fmt


# What a reader's own checks missed on a damaged or hand-edited file (a list where a string
# belongs, a header that is not an object): still the user's input, not a Woodcock bug.
_MALFORMED = (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError)


@contextlib.contextmanager
def _malformed_input_is_a_drafter_error(path: Path, format_name: str | None = None):
    try:
        yield
    except DrafterError:
        raise
    except _MALFORMED as e:
        what = f"{format_name} checkpoint" if format_name else "drafter directory"
        detail = str(e).splitlines()[0] if str(e) else ""
        raise DrafterError(
            f"{path}: malformed {what} ({type(e).__name__}: {detail}); a damaged or hand-edited"
            " file?"
        ) from None


def load_drafter(
    source: str | Path, format: str | None = None, *, taps: Sequence[int] | None = None
) -> Drafter:
    return load_drafter_with_format(source, format, taps=taps)[0]


def save_drafter(
    drafter: Drafter, dest: str | Path, format: str = "woodcock", *, force: bool = False
) -> None:
    if not isinstance(drafter, Drafter):
        raise DrafterError(
            f"drafter = {drafter!r:.80}: expected a Drafter (load_drafter reads one from a path)"
        )
    format_named(format).write(drafter, Path(dest), force=force)
