"""Outputs appear whole or not at all: written to a hidden sibling directory, renamed at the end,
and only once every check begun on the inputs (a source's sha256s) has passed.

A staging directory `.NAME.partial-PID-XXXX` is flock-ed by the process writing it for as long
as that process lives: the kernel drops the lock when the process dies, however it dies (even
SIGKILL), so a staging directory nobody holds a lock on is the leftover of a killed run. The
next run staging the same output removes such leftovers (never a locked one) and reports them
through the callback installed with `reporting_removed_leftovers`. Creating, checking and
renaming staging directories happens under a lock on the parent directory, so two processes
staging one output never both win: the second is told the output is being written by the
first, or appeared meanwhile.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import ctypes.util
import errno
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from woodcock.errors import DrafterError

try:
    import fcntl
except ImportError:  # Windows: no locks, so leftovers are never removed
    fcntl = None

_BACKGROUND_CHECKS: contextvars.ContextVar[list[_Check] | None] = contextvars.ContextVar(
    "woodcock_background_checks", default=None
)
_LEFTOVER_REPORT: contextvars.ContextVar[Callable[[list[Path]], None] | None] = (
    contextvars.ContextVar("woodcock_leftover_report", default=None)
)

PARTIAL = "partial"
RETIRED = "retired"  # holds the replaced output while the new one moves in (no atomic swap)
_LEGACY_RETIRED = "old"  # what versions without locks named it


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
def reporting_removed_leftovers(report: Callable[[list[Path]], None]) -> Iterator[None]:
    """Within this block, `report(paths)` is called whenever staging an output removed the
    leftovers of killed runs (the library itself prints nothing)."""
    token = _LEFTOVER_REPORT.set(report)
    try:
        yield
    finally:
        _LEFTOVER_REPORT.reset(token)


def leftovers_message(paths: list[Path]) -> str:
    """The one line a command shows for `paths` removed by `reporting_removed_leftovers`."""
    shown = ", ".join(str(p) for p in paths)
    return f"removed {len(paths)} leftover partial output(s) of killed runs: {shown}"


@contextlib.contextmanager
def staged_directory(dest: Path, *, force: bool = False) -> Iterator[Path]:
    """Yield an empty directory next to `dest`; when the block succeeds it becomes `dest`.

    An existing `dest` is kept unless `force`; even then it is replaced only after the new
    output is complete, in one rename where the system has an atomic swap. On any failure the
    partial output is removed and `dest` is untouched. Another live process staging `dest`, or
    a `dest` that appears while this one is written (without `force`), is a DrafterError.
    """
    dest = Path(dest)
    _refuse_existing(dest, force)
    _make_parent(dest)
    with _parent_locked(dest.parent):
        removed = _remove_leftovers(dest)
        try:
            writer = live_writer(dest)
            if writer is not None:
                raise DrafterError(f"{dest}: is being written by {writer}; wait for it to finish")
            _refuse_existing(dest, force)  # a killed run's output may have been put back
            staging, staging_lock = _locked_directory(dest, PARTIAL)
        finally:
            if removed and (report := _LEFTOVER_REPORT.get()) is not None:
                report(removed)
    replaced_lock = None
    try:
        yield staging
        _wait_for_checks()
        staging.chmod(0o777 & ~_umask())
        with _parent_locked(dest.parent):
            replaced_lock = _move_into_place(staging, dest, force)
    finally:
        # Removed while still locked: another run must not take it for a killed run's leftover.
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
        for fd in (staging_lock, replaced_lock):
            _release(fd)


@contextlib.contextmanager
def staged_file(dest: Path) -> Iterator[Path]:
    """Yield a path to write; when the block succeeds that file replaces `dest` in one rename.

    The file is written inside a locked `.NAME.partial-PID-XXXX` directory next to `dest`, so a
    killed run's half-written file is a leftover the next run staging `dest` removes (and
    reports through `reporting_removed_leftovers`), like those of `staged_directory`.
    """
    dest = Path(dest)
    _make_parent(dest)
    with _parent_locked(dest.parent):
        removed = _remove_leftovers(dest)
        try:
            staging, staging_lock = _locked_directory(dest, PARTIAL)
        finally:
            if removed and (report := _LEFTOVER_REPORT.get()) is not None:
                report(removed)
    try:
        yield staging / dest.name
        os.replace(staging / dest.name, dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        _release(staging_lock)


def check_output_file(dest: Path, *, force: bool) -> None:
    """Refuse, before any work, a file output that could not be written or would replace one
    without `force` (written later through `staged_file`, which makes missing folders)."""
    dest = Path(dest)
    if dest.is_dir():
        raise DrafterError(f"{dest}: is a directory; expected the path of a file to write")
    if (dest.exists() or dest.is_symlink()) and not force:
        raise DrafterError(f"{dest}: already exists; pass --force to replace it")
    for parent in dest.parents:
        if parent.exists():
            if not parent.is_dir():
                raise DrafterError(f"{dest}: {parent} is not a directory")
            break


def refuse_replacing_inputs(
    dest: Path, inputs: Mapping[str, str | Path | None], *, role: str = "output"
) -> None:
    """An output directory is replaced whole under --force, so it must not be, or hold, one of
    the command's own inputs ({"source drafter": path}; names that are not local paths, Hugging
    Face ids, are skipped). role: what `dest` is, for the message."""
    dest = Path(dest).expanduser().resolve()
    for name, given in inputs.items():
        path = None if given is None else Path(given).expanduser()
        if path is None or not path.exists():
            continue
        path = path.resolve()
        if dest == path or dest in path.parents:
            where = f"is the {name}" if dest == path else f"holds the {name} {path}"
            raise DrafterError(f"{dest}: the {role} {where}; write the {role} elsewhere")


def _make_parent(dest: Path) -> None:
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file where a folder must be, no permission, a full disk
        raise DrafterError(
            f"{dest}: its folder {dest.parent} cannot be made ({e.strerror or e})"
        ) from None


def _refuse_existing(dest: Path, force: bool) -> None:
    if dest.exists() or dest.is_symlink():
        if not force:
            raise DrafterError(f"{dest}: already exists; pass --force to replace it")
        if not dest.is_dir():
            raise DrafterError(f"{dest}: exists and is not a directory; refusing to replace it")


def _move_into_place(staging: Path, dest: Path, force: bool) -> int | None:
    """Rename `staging` to `dest` (under the parent lock). A dest that appeared meanwhile is
    replaced only with `force`: swapped in one step where the system can, the old output then
    at `staging`, locked through the descriptor returned until the caller has removed it."""
    if not (dest.exists() or dest.is_symlink()):
        try:
            _rename_without_replacing(staging, dest)
            return None
        except FileExistsError:
            pass  # created by a process that does not take the parent lock
    if not force:
        raise DrafterError(
            f"{dest}: appeared while this output was being written; pass --force to replace it"
        )
    _refuse_existing(dest, force)
    if _exchange(staging, dest):
        return _lock(staging)
    # Two renames: a run killed between them leaves the old output in the retired directory,
    # and the next run staging `dest` puts it back.
    retired, retired_lock = _locked_directory(dest, RETIRED)
    try:
        os.rename(dest, retired / dest.name)
        os.rename(staging, dest)
    except BaseException:
        if not dest.exists() and (retired / dest.name).exists():
            os.rename(retired / dest.name, dest)
        raise
    finally:
        shutil.rmtree(retired, ignore_errors=True)
        _release(retired_lock)
    return None


# The directories this process holds a flock on, by (device, inode): renames do not change
# them. An output staged inside another's staging directory (the demo's drafter) must not wait
# for the lock its own process holds: flock does not nest across descriptors.
_HELD: set[tuple[int, int]] = set()


def _lock(path: Path) -> int | None:
    """A descriptor holding an exclusive lock on the directory `path` (not waiting for it)."""
    if fcntl is None:
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        _HELD.add(_identity(fd))
    except OSError:
        pass  # a file system without flock: the directory is then never taken for a leftover
    return fd


def _release(fd: int | None) -> None:
    if fd is not None:
        _HELD.discard(_identity(fd))
        os.close(fd)


def _identity(fd: int) -> tuple[int, int]:
    info = os.fstat(fd)
    return info.st_dev, info.st_ino


def _locked_directory(dest: Path, kind: str) -> tuple[Path, int | None]:
    """A new `.NAME.KIND-PID-XXXX` directory and the descriptor holding its lock (the caller
    holds the parent lock, so no other process sees it before it is locked)."""
    path = Path(tempfile.mkdtemp(prefix=f".{dest.name}.{kind}-{os.getpid()}-", dir=dest.parent))
    return path, _lock(path)


def _siblings(dest: Path, kind: str) -> list[Path]:
    prefix = f".{dest.name}.{kind}-"
    try:
        names = os.listdir(dest.parent)
    except OSError:
        return []
    return sorted(dest.parent / name for name in names if name.startswith(prefix))


def _remove_leftovers(dest: Path) -> list[Path]:
    """Remove the staging directories of dead writers of `dest`; put back an output a killed
    run had moved aside and not yet replaced. Returns the directories removed."""
    removed = []
    for kind in (RETIRED, _LEGACY_RETIRED, PARTIAL):
        for path in _siblings(dest, kind):
            with _claimed(path) as claimed:
                if not claimed:
                    continue
                previous = path / dest.name
                if kind != PARTIAL and not dest.exists() and previous.is_dir():
                    os.rename(previous, dest)
                shutil.rmtree(path, ignore_errors=True)
                if not path.exists():
                    removed.append(path)
    return removed


def live_writer(dest: Path) -> str | None:
    """Who is writing `dest` now ('pid N'), or None."""
    for path in _siblings(dest, PARTIAL):
        with _claimed(path) as claimed:
            if claimed:
                continue
        pid = path.name[len(f".{dest.name}.{PARTIAL}-") :].split("-", 1)[0]
        return f"pid {pid}" if pid.isdigit() else "another process"
    return None


@contextlib.contextmanager
def _claimed(path: Path) -> Iterator[bool]:
    """Whether this process got the lock on `path` (True: its writer is dead), held in the block."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        yield False  # gone meanwhile, or not ours to read
        return
    try:
        claimed = False  # without flock nothing is known to be dead: leave it alone
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                claimed = True
            except OSError:  # held by a live writer, or locks unsupported
                pass
        yield claimed
    finally:
        os.close(fd)


@contextlib.contextmanager
def _parent_locked(parent: Path) -> Iterator[None]:
    try:
        fd = os.open(parent, os.O_RDONLY)
    except OSError:
        yield
        return
    key, mine = _identity(fd), False
    try:
        if fcntl is not None and key not in _HELD:
            with contextlib.suppress(OSError):  # no flock here: staging works without locks
                fcntl.flock(fd, fcntl.LOCK_EX)
                _HELD.add(key)
                mine = True
        yield
    finally:
        if mine:
            _HELD.discard(key)
        os.close(fd)


_LIBC = None
_RENAME_NOREPLACE = 1 if sys.platform.startswith("linux") else 0x4  # macOS: RENAME_EXCL
_RENAME_EXCHANGE = 2  # Linux RENAME_EXCHANGE and macOS RENAME_SWAP have the same value


def _rename_call(source: Path, target: Path, flags: int) -> bool:
    """renameat2 (Linux) or renamex_np (macOS) with `flags`. False where the system, the C
    library or the file system lacks it; other failures raise OSError."""
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    old, new = os.fsencode(source), os.fsencode(target)
    if sys.platform.startswith("linux"):
        function = getattr(_LIBC, "renameat2", None)
        arguments = (-100, old, -100, new, flags)  # AT_FDCWD: relative to the working directory
    elif sys.platform == "darwin":
        function = getattr(_LIBC, "renamex_np", None)
        arguments = (old, new, flags)
    else:
        function = None
    if function is None:
        return False
    if function(*arguments) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(target))


def _rename_without_replacing(source: Path, target: Path) -> None:
    """Rename, failing with FileExistsError when `target` exists (even as an empty directory,
    which a plain rename would silently replace)."""
    try:
        if _rename_call(source, target, _RENAME_NOREPLACE):
            return
    except OSError as e:
        if e.errno in (errno.EEXIST, errno.ENOTEMPTY):
            raise FileExistsError(e.errno, e.strerror, str(target)) from None
        raise
    try:
        os.rename(source, target)
    except OSError as e:
        if e.errno in (errno.EEXIST, errno.ENOTEMPTY):
            raise FileExistsError(e.errno, e.strerror, str(target)) from None
        raise


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directories in one step; False where the system cannot."""
    return _rename_call(a, b, _RENAME_EXCHANGE)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
