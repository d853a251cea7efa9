"""What a run writes as it goes: checkpoints (weights, optimizer state, the run's state) that a
resumed run continues exactly, the training log beside them, and the trained weights."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from woodcock.errors import DrafterError
from woodcock.jsonfile import read_json_object, write_json

CHECKPOINT_VERSION = 1


def save_checkpoint(directory: Path, step: int, model, optimizer, state: dict) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    folder = directory / f"step-{step:07d}"
    if folder.exists():
        shutil.rmtree(folder)
    partial = directory / f".step-{step:07d}.partial"
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir()
    mx.save_safetensors(
        str(partial / "model.safetensors"), dict(tree_flatten(model.trainable_parameters()))
    )
    mx.save_safetensors(str(partial / "optimizer.safetensors"), dict(tree_flatten(optimizer.state)))
    write_json(partial / "state.json", {**state, "step": step, "version": CHECKPOINT_VERSION})
    os.replace(partial, folder)
    latest = directory / "latest.json"
    tmp = directory / ".latest.json.tmp"
    write_json(tmp, {"step": step, "folder": folder.name})
    os.replace(tmp, latest)
    for old in directory.glob("step-*"):
        if old != folder:
            shutil.rmtree(old, ignore_errors=True)


# what a resume reads from state.json: (key, JSON types, required)
STATE_FIELDS = (
    ("step", (int,), True),
    ("recipe", (dict,), True),
    ("data_sha256", (str,), True),
    ("initial", (dict,), True),
    ("train_seconds", (int, float), False),
    ("train_tokens", (int,), False),
    ("last_eval", (dict, type(None)), False),
    ("last_loss", (int, float, type(None)), False),
)


def checkpoint_state(directory: Path) -> dict:
    latest_path = directory / "latest.json"
    name = read_json_object(latest_path).get("folder")
    if not isinstance(name, str) or not name.startswith("step-") or "/" in name:
        raise DrafterError(f"{latest_path}: folder = {name!r}: expected a step-N folder's name")
    folder = directory / name
    state_path = folder / "state.json"
    state = read_json_object(state_path)
    if state.get("version") != CHECKPOINT_VERSION:
        raise DrafterError(f"{folder}: checkpoint version {state.get('version')!r} unsupported")
    for key, kinds, required in STATE_FIELDS:
        if key not in state and not required:
            continue
        value = state.get(key)
        if not isinstance(value, kinds) or isinstance(value, bool):
            names = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
            raise DrafterError(f"{state_path}: {key} = {value!r}: expected {names}")
    return {**state, "folder": str(folder)}


def load_checkpoint(state: dict, model, optimizer) -> None:
    """Weights and optimizer state of the checkpoint `checkpoint_state` described."""
    folder = Path(state["folder"])
    model.update(tree_unflatten(list(_arrays(folder / "model.safetensors").items())))
    optimizer.state = tree_unflatten(list(_arrays(folder / "optimizer.safetensors").items()))
    mx.eval(model.parameters(), optimizer.state)


def _arrays(path: Path) -> dict:
    try:
        return mx.load(str(path))
    except (RuntimeError, ValueError, OSError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DrafterError(
            f"{path}: not a readable checkpoint file ({first}); start over with --force"
        ) from None


def remove_partial_checkpoints(directory: Path) -> None:
    """The half-written checkpoints of a killed run (the run that resumes is their only writer)."""
    for partial in directory.glob(".step-*.partial"):
        shutil.rmtree(partial, ignore_errors=True)


def append_log(path: Path, entry: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(entry) + "\n")


def trim_log(path: Path, step: int) -> None:
    """Drop log lines written after the checkpoint a run resumes from, and a last line a killed
    run left cut short. Any other line that is not a log entry is refused, not dropped."""
    if not path.exists():
        return
    *lines, last = path.read_bytes().split(b"\n")  # last: b"" unless a write was cut short
    kept = []
    for number, line in enumerate([*lines, last], 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            entry = None
        logged = entry.get("step") if isinstance(entry, dict) else None
        if not isinstance(logged, int) or isinstance(logged, bool):
            if number > len(lines):
                break
            raise DrafterError(
                f"{path}:{number}: not a training log entry; expected a JSON object with an"
                " integer 'step' (repair or remove that line to resume)"
            )
        if logged <= step:
            kept.append(line)
    # Through a temporary file: a run killed while rewriting must not lose the log.
    partial = path.with_name(f".{path.name}.partial")
    partial.write_bytes(b"".join(line + b"\n" for line in kept))
    os.replace(partial, path)


def trained_weights(model) -> dict[str, np.ndarray]:
    return {
        name: np.array(value.astype(mx.float32))
        for name, value in tree_flatten(model.trainable_parameters())
    }


def drafter_weights(model, spec) -> dict[str, np.ndarray]:
    """The drafter's tensors: what trained, and its own head where it was kept frozen."""
    weights = trained_weights(model)
    if spec.head.lm_head == "own":
        weights.setdefault("lm_head.weight", np.array(model.lm_head.weight.astype(mx.float32)))
    return weights
