"""The optimisation: per-step losses and agreement, the optimiser and its schedule, and
checkpoints that a resumed run continues exactly."""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from woodcock.errors import DrafterError
from woodcock.jsonfile import read_json_object, write_json
from woodcock.train.data import Batch
from woodcock.train.model import ttt_states
from woodcock.train.options import TrainOptions

CHECKPOINT_VERSION = 1


def step_masks(batch: Batch, steps: int, in_head: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(valid [K, B, R]: step k's target position t = i+1+k holds a prediction of an answer
    token; loss [K, B, R]: valid and the target's argmax there is in the draft head)."""
    rows = batch.rows
    i = np.arange(rows)[None, None, :]
    k = np.arange(steps)[:, None, None]
    t = i + 1 + k
    lengths = batch.lengths[None, :, None]
    prompts = batch.prompt_lengths[None, :, None]
    valid = (t <= lengths - 1) & (t >= prompts - 1)
    target = np.take_along_axis(
        np.broadcast_to(batch.argmax[None], (steps, *batch.argmax.shape)),
        np.broadcast_to(t, (steps, batch.argmax.shape[0], rows)),
        axis=2,
    )
    loss = valid & in_head[np.maximum(target, 0)] & (target >= 0)
    return valid, loss


@dataclass
class Agreement:
    """Counts behind the agreement by draft step."""

    steps: int
    hits: np.ndarray = None  # conditional: matched, among rows still on the target's chain
    tried: np.ndarray = None
    full_hits: np.ndarray = None  # unconditional
    full_tried: np.ndarray = None

    def __post_init__(self):
        for name in ("hits", "tried", "full_hits", "full_tried"):
            if getattr(self, name) is None:
                setattr(self, name, np.zeros(self.steps, np.int64))

    def add(self, batch: Batch, drafts: list[np.ndarray], valid: np.ndarray) -> None:
        """drafts: per step the drafter's argmax as target ids [B, R]."""
        rows = batch.rows
        i = np.arange(rows)[None, :]
        starts = valid[0] & (i + 1 >= batch.prompt_lengths[:, None])  # first draft: x_{>=P+1}
        alive = starts
        for k in range(self.steps):
            t = i + 1 + k
            target = np.take_along_axis(batch.argmax, np.broadcast_to(t, drafts[k].shape), 1)
            fed = np.take_along_axis(batch.tokens, np.broadcast_to(t + 1, drafts[k].shape), 1)
            match = drafts[k] == target
            self.full_hits[k] += int((valid[k] & match).sum())
            self.full_tried[k] += int(valid[k].sum())
            here = alive & valid[k]
            self.hits[k] += int((here & match).sum())
            self.tried[k] += int(here.sum())
            alive = here & match & (drafts[k] == fed)

    def conditional(self) -> list[float]:
        return [float(h / t) if t else 0.0 for h, t in zip(self.hits, self.tried, strict=True)]

    def unconditional(self) -> list[float]:
        pairs = zip(self.full_hits, self.full_tried, strict=True)
        return [float(h / t) if t else 0.0 for h, t in pairs]


def draft_head(head_matrix: np.ndarray, head_target_ids: np.ndarray | None):
    """(target id of each draft row [Vd], whether each target id has a row [V], the target's
    head rows of the draft vocabulary transposed [Ht, Vd]) for the soft labels."""
    import mlx.core as mx

    vocab = int(head_matrix.shape[0])
    head_ids = np.arange(vocab, dtype=np.int64) if head_target_ids is None else head_target_ids
    in_head = np.zeros(vocab, bool)
    in_head[head_ids] = True
    rows = head_matrix if head_target_ids is None else head_matrix[head_target_ids]
    return head_ids, in_head, mx.array(np.ascontiguousarray(rows.T, np.float32))


def make_optimizer(opts: TrainOptions):
    """AdamW (betas 0.9, 0.95), linear warm-up then cosine decay to min_lr_ratio of the peak."""
    import mlx.core as mx
    import mlx.optimizers as optim

    warmup, total, peak, floor = opts.warmup_steps(), opts.steps, opts.lr, opts.min_lr_ratio

    def schedule(step):
        step = step.astype(mx.float32)
        warm = mx.minimum((step + 1) / warmup, 1.0)
        progress = mx.clip((step + 1 - warmup) / max(1, total - warmup), 0.0, 1.0)
        decay = floor + (1 - floor) * 0.5 * (1 + mx.cos(math.pi * progress))
        return peak * warm * decay

    return optim.AdamW(learning_rate=schedule, betas=(0.9, 0.95), weight_decay=opts.weight_decay)


class Trainer:
    def __init__(
        self, model, head_target_ids: np.ndarray, head_matrix: np.ndarray, opts: TrainOptions
    ):
        import mlx.nn as nn

        self.model, self.opts = model, opts
        self.steps = opts.ttt_steps
        self.head_ids, self.in_head, self.head_t = draft_head(head_matrix, head_target_ids)
        self.weights = [opts.step_weight**k for k in range(self.steps)]
        self.optimizer = make_optimizer(opts)
        self._loss_and_grad = nn.value_and_grad(model, self._loss)

    def _inputs(self, batch: Batch) -> StepInputs:
        """Only rows whose step-k target is an answer position get logits and a loss (prompt
        and padding rows still run the layers: later rows attend to them)."""
        import mlx.core as mx

        valid, loss_mask = step_masks(batch, self.steps, self.in_head)
        batch_size, rows = batch.tokens.shape[0], batch.rows
        # the target distribution at every answer position, once
        t = np.arange(batch.tokens.shape[1])[None, :]
        answer = (t >= batch.prompt_lengths[:, None] - 1) & (t <= batch.lengths[:, None] - 1)
        where = np.full(answer.shape, -1, np.int64)
        where[answer] = np.arange(int(answer.sum()))
        final = mx.array(batch.final[answer])  # [n, Ht]
        target = mx.softmax(final @ self.head_t, axis=-1, precise=True)  # [n, Vd]
        selections = []
        for k in range(self.steps):
            flat = np.flatnonzero(valid[k].ravel())  # b * R + i
            if flat.size == 0:
                selections.append(None)
                continue
            b, i = np.divmod(flat, rows)
            weight = loss_mask[k].ravel()[flat].astype(np.float32)
            selections.append(
                (
                    mx.array(flat.astype(np.int32)),
                    mx.array(where[b, i + 1 + k].astype(np.int32)),
                    mx.array(weight),
                )
            )
        return StepInputs(
            tokens=mx.array(batch.tokens[:, 1 : rows + self.steps]),
            taps=mx.array(batch.taps),
            target=target,
            selections=selections,
            valid=valid,
            shape=(batch_size, rows),
        )

    def _loss(self, model, tokens, taps, target, selections):
        import mlx.core as mx

        states = ttt_states(model, tokens, taps, self.steps)
        total = mx.array(0.0)
        per_step, drafts = [], []
        for k, state in enumerate(states):
            if selections[k] is None:
                per_step.append(mx.array(0.0))
                drafts.append(None)
                continue
            flat, where, weight = selections[k]
            chosen = mx.take(state.reshape(-1, state.shape[-1]), flat, axis=0)
            logits = model.lm_head(chosen)  # [n, Vd]
            ce = mx.logsumexp(logits, axis=-1) - (mx.take(target, where, axis=0) * logits).sum(-1)
            loss = (ce * weight).sum() / mx.maximum(weight.sum(), 1.0)
            total = total + self.weights[k] * loss
            per_step.append(loss)
            drafts.append(mx.argmax(logits, axis=-1))
        return total, (per_step, drafts)

    def _drafts(self, inputs: StepInputs, drafts: list) -> list[np.ndarray]:
        """Per step the drafter's argmax as target ids [B, R] (-1 where no logits were made)."""
        out = []
        for k, d in enumerate(drafts):
            full = np.full(inputs.shape[0] * inputs.shape[1], -1, np.int64)
            if d is not None:
                full[np.flatnonzero(inputs.valid[k].ravel())] = self.head_ids[np.array(d)]
            out.append(full.reshape(inputs.shape))
        return out

    def train_step(self, batch: Batch) -> dict[str, Any]:
        import mlx.core as mx
        import mlx.optimizers as optim

        inputs = self._inputs(batch)
        (loss, (per_step, drafts)), grads = self._loss_and_grad(
            self.model, inputs.tokens, inputs.taps, inputs.target, inputs.selections
        )
        grads, norm = optim.clip_grad_norm(grads, self.opts.clip)
        self.optimizer.update(self.model, grads)
        ready = [d for d in drafts if d is not None]
        mx.eval(self.model.parameters(), self.optimizer.state, loss, norm, per_step, ready)
        agreement = Agreement(self.steps)
        agreement.add(batch, self._drafts(inputs, drafts), inputs.valid)
        return {
            "loss": float(loss.item()),
            "loss_by_step": [float(x.item()) for x in per_step],
            "agreement": agreement.unconditional(),
            "grad_norm": float(norm.item()),
            "lr": float(self.optimizer.learning_rate.item()),  # the rate this step used
        }

    def evaluate(self, batches: Iterable[Batch]) -> dict[str, Any]:
        import mlx.core as mx

        agreement = Agreement(self.steps)
        loss_sum, weight = np.zeros(self.steps), np.zeros(self.steps)
        for batch in batches:
            inputs = self._inputs(batch)
            _, (per_step, drafts) = self._loss(
                self.model, inputs.tokens, inputs.taps, inputs.target, inputs.selections
            )
            mx.eval(per_step, [d for d in drafts if d is not None])
            n = np.array(
                [0.0 if s is None else float(s[2].sum().item()) for s in inputs.selections]
            )
            loss_sum += np.array([float(x.item()) for x in per_step]) * n
            weight += n
            agreement.add(batch, self._drafts(inputs, drafts), inputs.valid)
        losses = [float(s / w) if w else 0.0 for s, w in zip(loss_sum, weight, strict=True)]
        return {
            "holdout_agreement": agreement.conditional(),
            "holdout_agreement_unconditional": agreement.unconditional(),
            "holdout_loss_by_step": losses,
            "holdout_rows": [int(t) for t in agreement.tried],
        }


@dataclass
class StepInputs:
    tokens: Any  # mx int32 [B, R + K - 1]: tokens[:, j] = x_{j+1}
    taps: Any  # mx [B, R, A*Ht]
    target: Any  # mx [n answer positions, Vd]: the target's draft-vocabulary distribution
    selections: list  # per step: (flat row ids, index into target, loss weight) or None
    valid: np.ndarray  # [K, B, R]
    shape: tuple[int, int]


def save_checkpoint(directory: Path, step: int, model, optimizer, state: dict) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten

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
    import mlx.core as mx
    from mlx.utils import tree_unflatten

    folder = Path(state["folder"])
    params = mx.load(str(folder / "model.safetensors"))
    model.update(tree_unflatten(list(params.items())))
    optimizer.state = tree_unflatten(list(mx.load(str(folder / "optimizer.safetensors")).items()))
    mx.eval(model.parameters(), optimizer.state)


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
