"""What `woodcock.train.train.train` asks of a training algorithm: a run, built from the target
and the data, that trains one batch at a time, evaluates on the hold-out and says what its
drafter records. `Eagle3Run` (`woodcock.train.eagle3_trainer`) and `BlockRun`
(`woodcock.train.block_trainer`) are the two."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from woodcock.ir import Drafter, DrafterSpec
from woodcock.train.distributed import Group
from woodcock.train.features import TargetRunner
from woodcock.train.options import TrainOptions, TrainReport


@dataclass
class RunInputs:
    """What a run is built from."""

    opts: TrainOptions
    runner: TargetRunner  # the loaded target
    taps: tuple[int, ...]
    head_ids: np.ndarray | None  # target ids of the head rows; None: the whole vocabulary
    draft_vocab: int
    init: Drafter | None  # --init: the drafter to start from
    arrays: dict[str, np.ndarray]  # the feature cache
    holdout_entries: list[dict]  # the feature cache's index entries of the hold-out samples
    group: Group  # the processes training together (one when not launched with mlx.launch)


class TrainingRun(Protocol):
    """One algorithm's run: its drafter's spec and module, the optimizer, its steps and its
    hold-out evaluation."""

    name: str  # the provenance's trainer
    spec: DrafterSpec
    model: Any  # the MLX module being trained, the runtime's model of `spec`
    optimizer: Any  # its MLX optimizer: checkpoints save and restore its state

    def __init__(self, inputs: RunInputs) -> None: ...

    def train_step(self, entries: Sequence[dict], step: int) -> tuple[int, dict[str, Any]]:
        """One optimizer step on the batch of these feature-cache entries, this rank's share of
        them on this rank: (the batch's tokens, the step's log metrics over the whole batch,
        "loss" among them)."""
        ...

    def evaluate(self) -> dict[str, Any]:
        """The hold-out figures, the same samples every time (on every rank: all of them)."""
        ...

    def record(self, report: TrainReport, initial: dict, last: dict) -> dict[str, Any]:
        """Fill `report` from the first and last evaluations; returns the provenance's
        hold-out fields."""
        ...
