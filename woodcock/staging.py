"""Outputs appear whole or not at all: written to a hidden sibling directory, renamed at the end,
and only once every check begun on the inputs (a source's sha256s) has passed."""

from __future__ import annotations

import contextlib
import contextvars
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from woodcock.errors import DrafterError

_BACKGROUND_CHECKS: contextvars.ContextVar[list[_Check] | None] = contextvars.ContextVar(
    "woodcock_background_checks", default=None
)


class _Check(threading.Thread):
    def __init__(self, run: Callable[[], None]):
        super().__init__(name="woodcock-check", daemon=True)
        self._work = run
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._work()
        except BaseException as e:  # handed to the thread that waits for it
            self.error = e


def check(run: Callable[[], None]) -> None:
    """Run an input check (one that raises DrafterError): now, or inside `checks_in_background`
    in a thread of its own, so that hashing a source overlaps with writing the output."""
    pending = _BACKGROUND_CHECKS.get()
    if pending is None:
        run()
        return
    thread = _Check(run)
    thread.start()
    pending.append(thread)


@contextlib.contextmanager
def checks_in_background() -> Iterator[None]:
    """Within this block `check` starts its checks in threads. Every output staged in the block
    waits for them before it is renamed into place, and the block waits for them at its end:
    the first failure is raised (and an output it would have let through is never created)."""
    pending: list[_Check] = []
    token = _BACKGROUND_CHECKS.set(pending)
    try:
        yield
        _wait_for_checks()
    finally:
        _BACKGROUND_CHECKS.reset(token)


def _wait_for_checks() -> None:
    for thread in _BACKGROUND_CHECKS.get() or ():
        thread.join()
        if thread.error is not None:
            raise thread.error


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
        _wait_for_checks()
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
