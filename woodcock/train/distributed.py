"""Data-parallel training on MLX's own distributed engine: `mlx.launch -n N woodcock train ...`
starts N processes (ranks) of the same command, and `mx.distributed.init()` finds the group they
form; run plainly, the group has one rank and every method here is the identity.

Every rank holds the same drafter and optimizer state (the weights start from the seed, and each
rank applies the same update) and walks the same global batches. Each takes its share of every
batch (`Group.shard`), runs the forward and backward pass on it, and the ranks sum what a step
needs across the group (`Group.sum`, `Group.sum_arrays`: all_sum). Rank 0 alone writes
checkpoints, the log and the drafter (`Group.writes`); the others wait at `Group.barrier` where
they would otherwise read what it writes.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, TypeVar

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

Item = TypeVar("Item")


class Group:
    def __init__(self):
        self._group = mx.distributed.init()
        self.rank, self.size = self._group.rank(), self._group.size()

    @property
    def writes(self) -> bool:
        """Whether this rank writes the run's files."""
        return self.rank == 0

    def shard(self, items: Sequence[Item]) -> list[Item]:
        """This rank's share of a global batch: every size-th item from its rank on, so that the
        lengths, sorted within a batch, spread evenly; empty when the batch has fewer items than
        ranks."""
        return list(items[self.rank :: self.size])

    def sum(self, values: np.ndarray) -> np.ndarray:
        """`values` summed over the ranks, in float32 (counts are exact up to 2^24)."""
        if self.size == 1:
            return values
        summed = mx.distributed.all_sum(mx.array(np.asarray(values, np.float32)), group=self._group)
        return np.array(summed).astype(np.asarray(values).dtype)

    def sum_fields(self, record: Any, names: Sequence[str]) -> None:
        """Sum these attributes of `record` (numbers or numpy arrays) over the ranks, in place."""
        if self.size == 1:
            return
        values = [np.asarray(getattr(record, name)) for name in names]
        summed = self.sum(np.concatenate([v.astype(np.float64).ravel() for v in values]))
        offsets = itertools.accumulate(v.size for v in values)
        for name, value, end in zip(names, values, offsets, strict=True):
            part = summed[end - value.size : end].reshape(value.shape).astype(value.dtype)
            setattr(record, name, part.item() if part.ndim == 0 else part)

    def sum_arrays(self, tree):
        """A tree of float32 MLX arrays (gradients, losses) summed over the ranks, in one all_sum
        (fewer, larger messages)."""
        if self.size == 1:
            return tree
        flat = tree_flatten(tree)
        ends = list(itertools.accumulate(a.size for _, a in flat))
        together = mx.concatenate([a.reshape(-1) for _, a in flat])
        parts = mx.split(mx.distributed.all_sum(together, group=self._group), ends[:-1])
        return tree_unflatten(
            [(name, part.reshape(a.shape)) for (name, a), part in zip(flat, parts, strict=True)]
        )

    def barrier(self) -> None:
        """Wait until every rank gets here."""
        if self.size > 1:
            mx.eval(mx.distributed.all_sum(mx.array(1.0), group=self._group))


def zero_gradients(model):
    """The gradients of a rank whose share of a batch is empty."""
    return tree_map(mx.zeros_like, model.trainable_parameters())
