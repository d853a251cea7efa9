"""Training block drafters (DFlash, DSpark): anchors, per-slot targets and loss, hold-out
metrics, and the run `woodcock.train.train.train` drives for --algorithm dflash|dspark.

The recipe follows speculators 0.9.0 (speculators/models/dflash/core.py, dflash/utils.py,
dspark/core.py, dspark/metrics.py, losses/utils.py):

* Anchors: per sequence up to --anchors positions p drawn without replacement among the answer
  positions whose block fits before the last position (P <= p <= L-1-B, P the prompt length),
  a function of the seed and the step. The hold-out uses up to --anchors evenly spaced ones per
  sample, the same at every evaluation.
* Targets: slot k predicts position p+k+1 (sample_from_anchor) or p+k (else, slot 0 only runs),
  against the target's distribution at the position before, restricted to the draft
  vocabulary: softmax(final hidden state @ the target's head rows). DSpark's Markov head is
  teacher-forced on the ground-truth token before each predicted one.
* Loss: per slot KL(target || draft) by default, or the weighted terms of --token-loss: KL,
  cross-entropy on the target's argmax (the distilled answer's token) and the L1 distance
  between the two distributions (DeepSpec's DSpark recipe: 0.1 CE + 0.9 L1, its loss.py); each
  slot weighted exp(-j/gamma) for draft slot j (slot k = j, or k = j+1 without
  sample_from_anchor), summed over the batch's slots and divided by their number; rows whose
  target argmax lies outside a truncated head carry no loss (as in EAGLE-3 training here). A
  truncated head trains unless --freeze-head keeps it at the target's rows (as DeepSpec and
  speculators keep theirs). DSpark adds --confidence-weight x the same weighting of
  BCE(confidence, alpha), alpha = sum_v min(p_v, q_v) = 1 - TV(p, q), the acceptance rate of
  the Markov-corrected draft q under rejection sampling (no gradient through alpha).
* Hold-out metrics: per draft slot the greedy accuracy (the draft's argmax, as a target id,
  equals the target's full-vocabulary argmax there), the acceptance length (mean over blocks of
  1 + the leading run of correct slots: the greedy acceptance length, since for greedy distilled
  answers the teacher-forced previous tokens are the drafts while they are correct), the
  expected acceptance length 1 + sum_k prod_{j<=k} alpha_j, and mean confidence vs mean alpha.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from woodcock.train.block_model import (
    block_states,
    build_block_model,
    build_block_spec,
    mask_token_id,
    slot_outputs,
)
from woodcock.train.data import Batch, BatchLengths, eval_batches, make_batch
from woodcock.train.distributed import Group, zero_gradients
from woodcock.train.optimization import draft_head, make_optimizer
from woodcock.train.options import (
    DEFAULT_TOKEN_LOSS,
    TrainOptions,
    TrainReport,
    parse_loss_terms,
)
from woodcock.train.run import RunInputs
from woodcock.train.warm_start import started_model


def anchor_candidates(length: int, prompt_length: int, block_size: int) -> np.ndarray:
    """Anchor positions of one sequence: answer tokens (p >= P) whose whole block predicts
    tokens of the sequence (p + B <= L - 1)."""
    return np.arange(prompt_length, length - block_size, dtype=np.int64)


def train_anchors(batch: Batch | BatchLengths, count: int, block_size: int, seed: int, step: int):
    """Per sequence up to `count` anchors, sorted, drawn from (seed, step) alone."""
    rng = np.random.default_rng([seed, step])
    out = []
    for length, prompt in zip(batch.lengths, batch.prompt_lengths, strict=True):
        candidates = anchor_candidates(int(length), int(prompt), block_size)
        k = min(count, candidates.size)
        out.append(np.sort(rng.choice(candidates, size=k, replace=False)))
    return out


def spread_anchors(batch: Batch, count: int, block_size: int):
    """Per sequence up to `count` evenly spaced anchors, the first at the first answer token."""
    out = []
    for length, prompt in zip(batch.lengths, batch.prompt_lengths, strict=True):
        candidates = anchor_candidates(int(length), int(prompt), block_size)
        k = min(count, candidates.size)
        out.append(candidates[(np.arange(k) * candidates.size) // max(k, 1)])
    return out


@dataclass
class BlockInputs:
    taps: Any  # mx [S, Lc, A*Ht]: context rows 0..Lc-1, Lc = the last anchor's position
    anchors: Any  # mx int32 [S, N]; padding blocks sit at position 1 and have no rows
    block_ids: Any  # mx int32 [S, N, B]: [x_p, MASK, ...]
    prev_ids: Any  # mx int32 [S, N, B]: the token before each slot's prediction
    rows: Any  # mx int32 [n]: flat S*N*B indices of the draft slots of real blocks
    target: Any  # mx [n, Vd]: the target's draft-vocabulary distribution per row
    neg_entropy: Any  # mx [n]: sum p log p of each row's target (KL = CE + this)
    weight: Any  # mx [n]: decay weight, 0 where the target's argmax is outside the head
    loss_rows: int  # rows with a loss (weight > 0)
    slot: np.ndarray  # [n] draft slot j
    block: np.ndarray  # [n] flat block index s*N + a
    target_argmax: np.ndarray  # [n] the target's full-vocabulary argmax
    label: Any  # mx int32 [n]: its draft-vocabulary row (0 where outside the head: no loss)
    blocks: int  # S*N
    tokens_in: int


class BlockTrainer:
    def __init__(
        self,
        model,
        spec,
        head_target_ids,
        head_matrix: np.ndarray,
        opts: TrainOptions,
        group: Group,
    ):
        self.model, self.spec, self.opts, self.group = model, spec, opts, group
        algorithm = spec.algorithm
        self.block_size = algorithm.block_size
        self.shift = 0 if algorithm.sample_from_anchor else 1
        self.slots = algorithm.num_drafts
        self.mask_id = algorithm.mask_token_id
        self.head_ids, self.in_head, self.head_t = draft_head(head_matrix, head_target_ids)
        self.draft_row = np.zeros(self.in_head.size, np.int32)
        self.draft_row[self.head_ids] = np.arange(self.head_ids.size)
        self.loss_terms = parse_loss_terms(opts.token_loss)
        if opts.freeze_head:
            model.lm_head.freeze()
        self.decay = np.exp(-np.arange(self.slots) / opts.decay_gamma).astype(np.float32)
        self.has_confidence = getattr(algorithm, "confidence_head", False)
        self.optimizer = make_optimizer(opts)
        self._loss_and_grad = nn.value_and_grad(model, self._loss)

    def inputs(self, batch: Batch, anchors: Sequence[np.ndarray]) -> BlockInputs | None:
        """None when no sequence of the batch has room for a block."""
        size, shift = self.block_size, self.shift
        count = max(len(a) for a in anchors)
        if count == 0:
            return None
        s = len(anchors)
        p = np.ones((s, count), np.int64)
        real = np.zeros((s, count), bool)
        for j, a in enumerate(anchors):
            p[j, : len(a)], real[j, : len(a)] = a, True
        k = np.arange(size)
        # slot k's label is the target's distribution at position t = p + k - shift, and its
        # previous token (DSpark) is the token at t, the anchor itself for slot 0
        t = p[..., None] + k - shift  # [S, N, B]
        prev = np.take_along_axis(batch.tokens, np.maximum(t, p[..., None]).reshape(s, -1), 1)
        block_ids = np.full((s, count, size), self.mask_id, np.int32)
        block_ids[:, :, 0] = np.take_along_axis(batch.tokens, p, 1)
        is_row = real[..., None] & (k >= shift)[None, None, :]
        flat = np.flatnonzero(is_row.ravel())
        b_idx, rest = np.divmod(flat, count * size)
        a_idx, k_idx = np.divmod(rest, size)
        t_rows = t.reshape(-1)[flat]
        argmax = batch.argmax[b_idx, t_rows]
        weight = self.decay[k_idx - shift] * self.in_head[np.maximum(argmax, 0)]
        final = batch.final.reshape(-1, batch.final.shape[-1])
        # the target's logits [n, Vd]
        z = final[mx.array(b_idx * batch.tokens.shape[1] + t_rows)] @ self.head_t
        z_lse = mx.logsumexp(z, axis=-1)
        target = mx.exp(z - z_lse[:, None])
        # sum p log p = sum p z - logsumexp(z): no log over the vocabulary
        neg_entropy = (target * z).sum(-1) - z_lse
        context = int(p[real].max())
        return BlockInputs(
            taps=batch.taps[:, :context],
            anchors=mx.array(p.astype(np.int32)),
            block_ids=mx.array(block_ids),
            prev_ids=mx.array(prev.reshape(s, count, size).astype(np.int32)),
            rows=mx.array(flat.astype(np.int32)),
            target=target,
            neg_entropy=neg_entropy,
            weight=mx.array(weight.astype(np.float32)),
            loss_rows=int((weight > 0).sum()),
            slot=k_idx - shift,
            block=b_idx * count + a_idx,
            target_argmax=argmax,
            label=mx.array(self.draft_row[np.maximum(argmax, 0)]),
            blocks=s * count,
            tokens_in=batch.tokens_in,
        )

    def _loss(self, model, inputs: BlockInputs, count):
        """count: the losses are means over this many rows (mx scalar, at least 1)."""
        hidden = block_states(model, self.spec, inputs.taps, inputs.anchors, inputs.block_ids)
        logits, confidence = slot_outputs(model, self.spec, hidden, inputs.prev_ids, inputs.rows)
        lse = mx.logsumexp(logits, axis=-1)
        kl = lse - (inputs.target * logits).sum(-1) + inputs.neg_entropy  # [n]
        q = mx.exp(logits - lse[:, None])
        terms = self.loss_terms
        per_row = terms.get("kl", 0.0) * kl
        if terms.get("ce"):
            label_logit = mx.take_along_axis(logits, inputs.label[:, None], axis=-1)[:, 0]
            per_row = per_row + terms["ce"] * (lse - label_logit)
        if terms.get("l1"):
            per_row = per_row + terms["l1"] * mx.abs(q - inputs.target).sum(-1)
        token_loss = (inputs.weight * per_row).sum() / count
        alpha = mx.stop_gradient(mx.minimum(q, inputs.target).sum(-1))
        total, confidence_loss, probability = token_loss, mx.array(0.0), None
        if confidence is not None:
            # BCE with logits: softplus(z) - alpha z
            bce = mx.logaddexp(mx.zeros_like(confidence), confidence) - alpha * confidence
            confidence_loss = (inputs.weight * bce).sum() / count
            total = total + self.opts.confidence_weight * confidence_loss
            probability = mx.sigmoid(confidence)
        outputs = (token_loss, confidence_loss, kl, alpha, probability, mx.argmax(logits, -1))
        return total, outputs

    def _counts(self, inputs: BlockInputs, outputs) -> BlockMetrics:
        _, _, kl, alpha, probability, drafts = outputs
        metrics = BlockMetrics(self.slots)
        metrics.add(
            inputs,
            self.head_ids[np.array(drafts)],
            np.array(alpha),
            None if probability is None else np.array(probability),
            np.array(kl),
        )
        return metrics

    def _losses(self, token_loss, confidence_loss) -> dict[str, float]:
        losses = {"token_loss": float(token_loss.item())}
        if self.has_confidence:
            losses["confidence_loss"] = float(confidence_loss.item())
        return losses

    def train_step(self, inputs: BlockInputs | None) -> dict[str, Any]:
        """One optimizer step on the batch whose blocks on this rank are `inputs` (None: none).

        The loss over the whole batch is sum_r S_r / N, with S_r rank r's weighted sum of row
        losses and N = sum_r N_r the rows with a loss on all ranks. Each rank divides its own sum
        by N (an all_sum of the counts, before the forward pass), so the loss, and its gradient,
        are the all_sum of the ranks' terms: the single-process step, not a mean of per-rank
        means."""
        mine = [0, 0] if inputs is None else [inputs.rows.shape[0], inputs.loss_rows]
        rows, loss_rows = (int(x) for x in self.group.sum(np.array(mine)))
        if rows == 0:
            # nothing to learn from (every answer shorter than a block): no update
            return {"loss": 0.0, "blocks": 0, "rows": 0, "skipped": True}
        if inputs is None:
            outputs, grads, losses = None, zero_gradients(self.model), (mx.array(0.0),) * 3
        else:
            count = mx.array(float(max(1, loss_rows)))
            (loss, outputs), grads = self._loss_and_grad(self.model, inputs, count)
            losses = (loss, *outputs[:2])
        grads, (loss, token_loss, confidence_loss) = self.group.sum_arrays((grads, losses))
        grads, norm = optim.clip_grad_norm(grads, self.opts.clip)
        self.optimizer.update(self.model, grads)
        ready = [] if outputs is None else [x for x in outputs if x is not None]
        mx.eval(self.model.parameters(), self.optimizer.state, loss, norm, ready)
        mx.eval(token_loss, confidence_loss)  # summed over the ranks: not among `ready` then
        metrics = BlockMetrics(self.slots) if outputs is None else self._counts(inputs, outputs)
        self.group.sum_fields(metrics, (*BlockMetrics.SUMS, "has_confidence"))
        summary = metrics.summary()
        return {
            "loss": float(loss.item()),
            **self._losses(token_loss, confidence_loss),
            "accuracy": summary["accuracy"],
            "acceptance_length": summary["acceptance_length"],
            "blocks": summary["blocks"],
            "rows": rows,
            "grad_norm": float(norm.item()),
            "lr": float(self.optimizer.learning_rate.item()),  # the rate this step used
        }

    def evaluate(self, batches: Iterable[tuple[Batch, Sequence[np.ndarray]]]) -> dict[str, Any]:
        metrics = BlockMetrics(self.slots)
        loss_sum, confidence_sum, count = 0.0, 0.0, 0.0
        for batch, anchors in batches:
            inputs = self.inputs(batch, anchors)
            if inputs is None:
                continue
            n = float(max(1, inputs.loss_rows))
            _, outputs = self._loss(self.model, inputs, mx.array(n))
            mx.eval([x for x in outputs if x is not None])
            metrics.merge(self._counts(inputs, outputs))
            losses = self._losses(*outputs[:2])
            loss_sum += losses["token_loss"] * n
            confidence_sum += losses.get("confidence_loss", 0.0) * n
            count += n
        summary = metrics.summary()
        out = {f"holdout_{k}": v for k, v in summary.items()}
        out["holdout_loss"] = loss_sum / count if count else 0.0
        if metrics.has_confidence:
            out["holdout_confidence_loss"] = confidence_sum / count if count else 0.0
        return out


class BlockMetrics:
    """Counts behind the per-slot and per-block figures."""

    SUMS = ("hits", "tried", "reached", "passed", "alpha", "confidence", "kl", "blocks", "expected")

    def __init__(self, slots: int):
        self.slots = slots
        self.hits = np.zeros(slots, np.int64)
        self.tried = np.zeros(slots, np.int64)
        self.reached = np.zeros(slots, np.int64)  # blocks whose earlier slots were all correct
        self.passed = np.zeros(slots, np.int64)  # ... and this one too
        self.alpha = np.zeros(slots)
        self.confidence = np.zeros(slots)
        self.kl = np.zeros(slots)
        self.has_confidence = False
        self.blocks = 0
        self.expected = 0.0  # sum over blocks of 1 + sum_k prod_{j<=k} alpha_j

    def add(self, inputs: BlockInputs, drafts, alpha, confidence, kl) -> None:
        slot = inputs.slot
        correct = drafts == inputs.target_argmax
        np.add.at(self.hits, slot, correct)
        np.add.at(self.tried, slot, 1)
        np.add.at(self.alpha, slot, alpha)
        np.add.at(self.kl, slot, kl)
        if confidence is not None:
            self.has_confidence = True
            np.add.at(self.confidence, slot, confidence)
        present = np.zeros((inputs.blocks, self.slots), bool)
        grid_correct = np.zeros((inputs.blocks, self.slots), bool)
        grid_alpha = np.zeros((inputs.blocks, self.slots))
        present[inputs.block, slot] = True
        grid_correct[inputs.block, slot] = correct
        grid_alpha[inputs.block, slot] = alpha
        real = present.any(axis=1)
        self.blocks += int(real.sum())
        run = np.cumprod(grid_correct[real], axis=1)  # [blocks, slots]: the leading run
        earlier = np.concatenate([np.ones((run.shape[0], 1), run.dtype), run[:, :-1]], axis=1)
        self.reached += (earlier * present[real]).sum(0)
        self.passed += (run * present[real]).sum(0)
        self.expected += float((np.cumprod(grid_alpha[real], axis=1).sum(1) + 1).sum())

    def merge(self, other: BlockMetrics) -> None:
        for name in self.SUMS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.has_confidence |= other.has_confidence

    def summary(self) -> dict[str, Any]:
        tried = np.maximum(self.tried, 1)
        rows = max(int(self.tried.sum()), 1)
        out: dict[str, Any] = {
            "accuracy": [round(float(x), 6) for x in self.hits / tried],
            "acceptance_by_slot": [
                round(float(x), 6) for x in self.passed / np.maximum(self.reached, 1)
            ],
            # each block emits 1 + its leading run of correct slots
            "acceptance_length": round(1 + self.passed.sum() / self.blocks, 6)
            if self.blocks
            else 0.0,
            "expected_acceptance_length": round(self.expected / self.blocks, 6)
            if self.blocks
            else 0.0,
            "alpha": [round(float(x), 6) for x in self.alpha / tried],
            "alpha_mean": round(float(self.alpha.sum() / rows), 6),
            "kl_by_slot": [round(float(x), 6) for x in self.kl / tried],
            "blocks": self.blocks,
            "rows_by_slot": [int(x) for x in self.tried],
        }
        if self.has_confidence:
            out["confidence"] = [round(float(x), 6) for x in self.confidence / tried]
            out["confidence_mean"] = round(float(self.confidence.sum() / rows), 6)
        return out


HOLDOUT_DEFINITIONS = {
    "accuracy": (
        "by draft slot: share of hold-out blocks whose slot's argmax (a target id) equals the"
        " target's full-vocabulary argmax at the position it predicts, Markov head fed the"
        " ground-truth previous token"
    ),
    "acceptance_by_slot": (
        "by draft slot: among hold-out blocks whose earlier slots were all correct, the share"
        " whose slot is correct too: the greedy acceptance rate at that position given the"
        " earlier drafts were accepted (the manifest's holdout_agreement, auto's prior)"
    ),
    "acceptance_length": (
        "mean over hold-out blocks of 1 + the leading run of correct slots: the tokens one"
        " greedy round emits (the greedy distilled answer is the drafts while they are correct)"
    ),
    "expected_acceptance_length": (
        "mean over hold-out blocks of 1 + sum_k prod_{j<=k} alpha_j: the same under rejection"
        " sampling at temperature 1"
    ),
    "alpha": "by draft slot: mean sum_v min(p_v, q_v) = 1 - TV(target, draft)",
    "confidence": "by draft slot: the confidence head's mean estimate (trained towards alpha)",
    "anchors": "up to --anchors evenly spaced anchors per hold-out sample, from the first answer"
    " token on",
}


class BlockRun:
    """One training run's block drafter: spec, module, trainer and its hold-out batches."""

    def __init__(self, inputs: RunInputs):
        opts, runner, init = inputs.opts, inputs.runner, inputs.init
        self.opts, self.arrays, self.holdout = opts, inputs.arrays, inputs.holdout_entries
        mask = init.spec.algorithm.mask_token_id if init is not None else None
        if mask is None:
            mask = mask_token_id(runner.tokenizer, runner.vocab_size)
        self.spec = build_block_spec(
            runner, opts.target, inputs.taps, inputs.draft_vocab, opts, mask
        )
        self.model = started_model(inputs, self.spec, build_block_model)
        self.trainer = BlockTrainer(
            self.model, self.spec, inputs.head_ids, runner.head, opts, inputs.group
        )
        self.optimizer = self.trainer.optimizer
        self.group = inputs.group
        algorithm = self.spec.algorithm
        token_loss = (
            "KL to the target's soft labels"
            if opts.token_loss == DEFAULT_TOKEN_LOSS
            else f"token loss {opts.token_loss}"
        )
        self.name = (
            f"woodcock train (block recipe: {algorithm.name}, speculators 0.9.0 anchored blocks,"
            f" {token_loss}, exp(-k/gamma) slot weights"
            + (", confidence BCE" if getattr(algorithm, "confidence_head", False) else "")
            + (", frozen head" if opts.freeze_head else "")
            + ")"
        )

    def train_step(self, entries, step: int) -> tuple[int, dict[str, Any]]:
        # the anchors of the whole batch, drawn in its order, then this rank's share
        drawn = train_anchors(
            BatchLengths.of(entries),
            self.opts.anchors,
            self.spec.algorithm.block_size,
            self.opts.seed,
            step,
        )
        mine = self.group.shard(range(len(entries)))
        inputs = None
        if mine:
            batch = make_batch(self.arrays, [entries[i] for i in mine], 0)
            inputs = self.trainer.inputs(batch, [drawn[i] for i in mine])
        return sum(e["length"] for e in entries), self.trainer.train_step(inputs)

    def evaluate(self) -> dict[str, Any]:
        size = self.spec.algorithm.block_size

        def batches():
            for batch in eval_batches(self.arrays, self.holdout, 0, tokens=2048):
                yield batch, spread_anchors(batch, self.opts.anchors, size)

        return self.trainer.evaluate(batches())

    def record(self, report: TrainReport, initial: dict, last: dict) -> dict[str, Any]:
        report.holdout, report.holdout_initial = last, initial
        strip = {k.removeprefix("holdout_"): v for k, v in last.items()}
        return {
            # the same figure an EAGLE-3 drafter records: the auto policy's prior
            "holdout_agreement": strip["acceptance_by_slot"],
            "holdout": strip,
            "holdout_initial": {k.removeprefix("holdout_"): v for k, v in initial.items()},
            "holdout_definition": HOLDOUT_DEFINITIONS,
        }
