"""The optimisation both recipes share: AdamW on a warm-up and cosine schedule, and the draft
head (its target ids and the target's rows) their soft labels are computed over."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np

from woodcock.train.options import TrainOptions


def make_optimizer(opts: TrainOptions):
    """AdamW (betas 0.9, 0.95), linear warm-up then cosine decay to min_lr_ratio of the peak."""
    warmup, total, peak, floor = opts.warmup_steps(), opts.steps, opts.lr, opts.min_lr_ratio

    def schedule(step):
        step = step.astype(mx.float32)
        warm = mx.minimum((step + 1) / warmup, 1.0)
        progress = mx.clip((step + 1 - warmup) / max(1, total - warmup), 0.0, 1.0)
        decay = floor + (1 - floor) * 0.5 * (1 + mx.cos(math.pi * progress))
        return peak * warm * decay

    return optim.AdamW(learning_rate=schedule, betas=(0.9, 0.95), weight_decay=opts.weight_decay)


def draft_head(head_matrix: np.ndarray, head_target_ids: np.ndarray | None):
    """(target id of each draft row [Vd], whether each target id has a row [V], the target's
    head rows of the draft vocabulary transposed [Ht, Vd]) for the soft labels."""
    vocab = int(head_matrix.shape[0])
    head_ids = np.arange(vocab, dtype=np.int64) if head_target_ids is None else head_target_ids
    in_head = np.zeros(vocab, bool)
    in_head[head_ids] = True
    rows = head_matrix if head_target_ids is None else head_matrix[head_target_ids]
    return head_ids, in_head, mx.array(np.ascontiguousarray(rows.T, np.float32))
