"""Outputs appear whole or not at all: written to a hidden sibling directory, renamed at the end."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from woodcock.errors import DrafterError


@contextlib.contextmanager
def staged_directory(dest: Path, *, force: bool = False) -> Iterator[Path]:
    """Yield an empty directory next to `dest`; when the block succeeds it becomes `dest`.

    An existing `dest` is kept unless `force`; even then it is replaced only after the new
    output is complete. On any failure the partial output is removed and `dest` is untouched.
    """
    dest = Path(dest)
    if dest.exists() or dest.is_symlink():
        if not force:
            raise DrafterError(f"{dest}: already exists; pass --force to replace it")
        if not dest.is_dir():
            raise DrafterError(f"{dest}: exists and is not a directory; refusing to replace it")
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.partial-", dir=dest.parent))
    try:
        yield staging
        staging.chmod(0o777 & ~_umask())
        if dest.exists():
            retired = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
            os.replace(dest, retired / dest.name)
            os.replace(staging, dest)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.replace(staging, dest)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
