"""Which on-disk format a directory holds."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from woodcock.errors import DrafterError
from woodcock.formats import (
    deepspec,
    native,
    safeailab,
    specforge,
    specforge_dspark,
    speculators,
    zlab_dflash,
)

# Most specific first; each signature excludes the ones before it (tests check that every
# format's checkpoints are detected as that format and no other).
FORMATS: tuple[ModuleType, ...] = (
    native,
    speculators,
    specforge_dspark,
    zlab_dflash,
    deepspec,
    specforge,
    safeailab,
)


def format_named(name: str) -> ModuleType:
    for fmt in FORMATS:
        if fmt.NAME == name:
            return fmt
    known = ", ".join(fmt.NAME for fmt in FORMATS)
    raise DrafterError(f"unknown format {name!r}; expected one of {known}")


def detect(path: Path) -> ModuleType:
    path = Path(path)
    if not path.exists():
        raise DrafterError(f"{path}: no such file or directory")
    if not path.is_dir():
        raise DrafterError(f"{path}: expected a drafter directory, found a file")
    for fmt in FORMATS:
        if fmt.matches(path):
            return fmt
    looked_for = "; ".join(f"{fmt.SIGNATURE} ({fmt.NAME})" for fmt in FORMATS)
    raise DrafterError(f"{path}: no known drafter format; looked for {looked_for}")
