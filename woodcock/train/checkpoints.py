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


def checkpoint_state(directory: Path) -> dict:
    latest = read_json_object(directory / "latest.json")
    folder = directory / latest["folder"]
    state = read_json_object(folder / "state.json")
    if state.get("version") != CHECKPOINT_VERSION:
        raise DrafterError(f"{folder}: checkpoint version {state.get('version')!r} unsupported")
    return {**state, "folder": str(folder)}


def load_checkpoint(state: dict, model, optimizer) -> None:
    """Weights and optimizer state of the checkpoint `checkpoint_state` described."""
    folder = Path(state["folder"])
    params = mx.load(str(folder / "model.safetensors"))
    model.update(tree_unflatten(list(params.items())))
    optimizer.state = tree_unflatten(list(mx.load(str(folder / "optimizer.safetensors")).items()))
    mx.eval(model.parameters(), optimizer.state)


def append_log(path: Path, entry: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(entry) + "\n")


def trim_log(path: Path, step: int) -> None:
    """Drop log lines written after the checkpoint a run resumes from."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").split("\n"):
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if entry.get("step", 0) <= step:
            kept.append(line)
    # Through a temporary file: a run killed while rewriting must not lose the log.
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
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
