"""Training EAGLE-3 drafters (`woodcock train`, the default --algorithm): the per-step losses
and agreement of training-time test, and the run `woodcock.train.train.train` drives.

The EAGLE-3 recipe ("seed recipe"):

* Shape: one Llama-style decoder layer with the target's hidden size, heads, head_dim and MLP
  width; it reads three taps (canonical ids 2, N//2, N-3 of an N-layer target; spread over
  1, N//2, N when the target is too shallow for those to be distinct) through a per-tap RMSNorm
  and fc; EAGLE-3.1 post-norm feedback (norm_output) and norm_before_residual. The embedding is
  the target's (shared, frozen). The head is truncated to the --head-size target tokens most
  frequent in the training answers (own lm_head rows, initialised from the target's head rows;
  the final norm from the target's final norm), with a VocabMap and the token counts.
* Loss: training-time test (EAGLE-3 TTT) with K unrolled steps. Row i is token x_{i+1} with the
  fused target state g_i at position i+1. Step k (0-based) feeds each row its own fed-back state
  from step k-1 and the teacher-forced token x_{i+1+k}, at position i+1+k; it attends to the
  step-0 keys causally and to its own keys of steps 1..k. Its logits are compared with the
  target's distribution at position t = i+1+k (the target's prediction of x_{t+1}), restricted to
  the draft vocabulary and renormalised: soft-label cross-entropy, on rows whose predicted token
  is an answer token (t >= prompt length - 1, t <= last position) and whose target argmax is in
  the draft vocabulary (EAGLE-3's rule), averaged per step, weighted 0.8^k and summed.
* Hold-out: the hold-out agreement at draft step k+1 is the share of hold-out rows where the
  drafter's argmax at TTT step k equals the target's argmax (over the full vocabulary, so a token
  outside the draft head counts as a miss), among rows that start a draft on an answer position
  (the first draft predicts an answer token after the first) and whose drafts at steps 0..k-1 all
  matched the target's argmax and the teacher-forced token. For greedy distilled answers the
  teacher-forced token is then the drafter's own draft, so this is the acceptance rate of greedy
  chain drafting at position k+1 given the k earlier drafts were accepted, the quantity
  `woodcock generate --policy auto` takes as its prior. The unconditional share (every row whose
  step-k target is an answer token) is recorded too.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from woodcock.train.data import Batch, eval_batches, make_batch
from woodcock.train.distributed import Group, zero_gradients
from woodcock.train.eagle3_model import build_model, build_spec, ttt_states
from woodcock.train.optimization import draft_head, make_optimizer
from woodcock.train.options import TrainOptions, TrainReport
from woodcock.train.run import RunInputs
from woodcock.train.warm_start import started_model


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


class Eagle3Trainer:
    def __init__(
        self,
        model,
        head_target_ids: np.ndarray,
        head_matrix: np.ndarray,
        opts: TrainOptions,
        group: Group,
    ):
        self.model, self.opts, self.group = model, opts, group
        self.steps = opts.ttt_steps
        self.head_ids, self.in_head, self.head_t = draft_head(head_matrix, head_target_ids)
        self.weights = [opts.step_weight**k for k in range(self.steps)]
        self.optimizer = make_optimizer(opts)
        self._loss_and_grad = nn.value_and_grad(model, self._loss)

    def _inputs(self, batch: Batch) -> StepInputs:
        """Only rows whose step-k target is an answer position get logits and a loss (prompt
        and padding rows still run the layers: later rows attend to them)."""
        valid, loss_mask = step_masks(batch, self.steps, self.in_head)
        batch_size, rows = batch.tokens.shape[0], batch.rows
        # the target distribution at every answer position, once
        t = np.arange(batch.tokens.shape[1])[None, :]
        answer = (t >= batch.prompt_lengths[:, None] - 1) & (t <= batch.lengths[:, None] - 1)
        where = np.full(answer.shape, -1, np.int64)
        where[answer] = np.arange(int(answer.sum()))
        final = batch.final.reshape(-1, batch.final.shape[-1])
        final = final[mx.array(np.flatnonzero(answer.ravel()))]  # [n, Ht]
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
            taps=batch.taps,
            target=target,
            selections=selections,
            valid=valid,
            shape=(batch_size, rows),
            counts=loss_mask.reshape(self.steps, -1).sum(axis=1),
        )

    def _loss(self, model, inputs: StepInputs, denominators):
        """denominators [K]: step k's loss is a mean over this many rows (at least 1)."""
        states = ttt_states(model, inputs.tokens, inputs.taps, self.steps)
        total = mx.array(0.0)
        per_step, drafts = [], []
        for k, state in enumerate(states):
            if inputs.selections[k] is None:
                per_step.append(mx.array(0.0))
                drafts.append(None)
                continue
            flat, where, weight = inputs.selections[k]
            chosen = mx.take(state.reshape(-1, state.shape[-1]), flat, axis=0)
            logits = model.lm_head(chosen)  # [n, Vd]
            chosen_target = mx.take(inputs.target, where, axis=0)
            ce = mx.logsumexp(logits, axis=-1) - (chosen_target * logits).sum(-1)
            loss = (ce * weight).sum() / denominators[k]
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

    def train_step(self, batch: Batch | None) -> dict[str, Any]:
        """One optimizer step on the batch, whose share on this rank is `batch` (None: empty).

        Step k's loss over the whole batch is L_k = sum_r S_kr / N_k, with S_kr rank r's sum of
        row losses and N_k = sum_r N_kr the rows with a loss on all ranks. Each rank divides its
        own sum by N_k (an all_sum of the counts, before the forward pass), so L_k, and its
        gradient, are the all_sum of the ranks' terms: the single-process step, not a mean of
        per-rank means."""
        inputs = None if batch is None else self._inputs(batch)
        counts = np.zeros(self.steps, np.int64) if inputs is None else inputs.counts
        denominators = mx.array(np.maximum(self.group.sum(counts), 1).astype(np.float32))
        if inputs is None:
            loss, per_step = mx.array(0.0), [mx.array(0.0)] * self.steps
            drafts, grads = [None] * self.steps, zero_gradients(self.model)
        else:
            (loss, (per_step, drafts)), grads = self._loss_and_grad(
                self.model, inputs, denominators
            )
        grads, loss, per_step = self.group.sum_arrays((grads, loss, per_step))
        grads, norm = optim.clip_grad_norm(grads, self.opts.clip)
        self.optimizer.update(self.model, grads)
        ready = [d for d in drafts if d is not None]
        mx.eval(self.model.parameters(), self.optimizer.state, loss, norm, per_step, ready)
        agreement = Agreement(self.steps)
        if inputs is not None:
            agreement.add(batch, self._drafts(inputs, drafts), inputs.valid)
        self.group.sum_fields(agreement, ("full_hits", "full_tried"))
        return {
            "loss": float(loss.item()),
            "loss_by_step": [float(x.item()) for x in per_step],
            "agreement": agreement.unconditional(),
            "grad_norm": float(norm.item()),
            "lr": float(self.optimizer.learning_rate.item()),  # the rate this step used
        }

    def evaluate(self, batches: Iterable[Batch]) -> dict[str, Any]:
        agreement = Agreement(self.steps)
        loss_sum, weight = np.zeros(self.steps), np.zeros(self.steps)
        for batch in batches:
            inputs = self._inputs(batch)
            denominators = mx.array(np.maximum(inputs.counts, 1).astype(np.float32))
            _, (per_step, drafts) = self._loss(self.model, inputs, denominators)
            mx.eval(per_step, [d for d in drafts if d is not None])
            n = inputs.counts.astype(np.float64)
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
    counts: np.ndarray  # [K]: the rows with a loss at each step


class Eagle3Run:
    """One training run's EAGLE-3 drafter: spec, module, trainer and its hold-out batches."""

    name = "woodcock train (seed recipe: EAGLE-3 TTT, soft labels, truncated head)"

    def __init__(self, inputs: RunInputs):
        opts, runner = inputs.opts, inputs.runner
        self.opts, self.arrays, self.holdout = opts, inputs.arrays, inputs.holdout_entries
        self.spec = build_spec(runner, opts.target, inputs.taps, inputs.draft_vocab, opts.ttt_steps)
        self.model = started_model(inputs, self.spec, build_model)
        self.trainer = Eagle3Trainer(self.model, inputs.head_ids, runner.head, opts, inputs.group)
        self.optimizer = self.trainer.optimizer
        self.group = inputs.group

    def train_step(self, entries, step: int) -> tuple[int, dict[str, Any]]:
        mine = self.group.shard(entries)
        batch = make_batch(self.arrays, mine, self.opts.ttt_steps) if mine else None
        return sum(e["length"] for e in entries), self.trainer.train_step(batch)

    def evaluate(self) -> dict[str, Any]:
        return self.trainer.evaluate(eval_batches(self.arrays, self.holdout, self.opts.ttt_steps))

    def record(self, report: TrainReport, initial: dict, last: dict) -> dict[str, Any]:
        report.holdout_agreement_initial = initial["holdout_agreement"]
        report.holdout_agreement = last["holdout_agreement"]
        report.holdout_agreement_unconditional = last["holdout_agreement_unconditional"]
        return {
            "holdout_agreement": report.holdout_agreement,
            "holdout_agreement_definition": (
                "by draft step k = 1..K: share of hold-out rows where the drafter's argmax at"
                " step k equals the target's full-vocabulary argmax, among rows starting a"
                " draft at an answer position whose k-1 earlier drafts all matched the target's"
                " argmax and the teacher-forced (greedy distilled) token: the greedy acceptance"
                " rate at position k given the earlier drafts were accepted"
            ),
            "holdout_agreement_unconditional": report.holdout_agreement_unconditional,
            "holdout_agreement_initial": report.holdout_agreement_initial,
            "holdout_loss_by_step": last["holdout_loss_by_step"],
            "holdout_rows_by_step": last["holdout_rows"],
        }
