"""On-disk drafter formats, one module each, every one following `DrafterFormat`.

Installed as `woodcock.formats`; importing it under any other name is refused, so this folder
never shadows PyPI's unrelated `formats` package from a source checkout either. A new format is
a new module here that `woodcock.formats.detect.FORMATS` lists (most specific signature first).
"""

if __name__ != "woodcock.formats":
    raise ImportError(f"import woodcock.formats, not {__name__} (this folder belongs to woodcock)")

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from woodcock.ir import Drafter


@runtime_checkable
class DrafterFormat(Protocol):
    """What every format module provides. Optional members, where a format has them:
    `prepare(drafter)` (the `hf_config.Output` that `write` would write, for dry runs),
    `stored_name(canonical)` and `stored_taps(spec)` (how it names tensors and tap ids),
    `SHARES_HEAD = True` (it always takes embedding and head from the target), and
    `read_provenance(path)` (the native format)."""

    NAME: str  # the --to / --from name
    LAYER_CONVENTION: str  # how it counts tap ids (woodcock.converters.layer_ids)
    SIGNATURE: str  # what `matches` looks for, in words

    def matches(self, path: Path) -> bool: ...

    def read(self, path: Path, *, taps: Sequence[int] | None = None) -> "Drafter": ...

    def write(self, drafter: "Drafter", path: Path, *, force: bool = False) -> None: ...
