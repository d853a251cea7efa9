"""What a training run is asked for (`TrainOptions`, checked before any work) and what it
reports."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from woodcock.errors import DrafterError


@dataclass
class TrainOptions:
    target: str | None  # None: the default target
    data: Path
    out: Path
    steps: int = 300
    ttt_steps: int = 3
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup: int | None = None  # default: 5 % of the steps
    weight_decay: float = 0.01
    clip: float = 1.0
    step_weight: float = 0.8
    batch: int = 8  # sequences per step
    max_len: int = 384  # tokens per sequence (prompt + answer), longer ones are cut
    head_size: int = 8192
    holdout: float = 0.05
    seed: int = 0
    eval_every: int = 200
    checkpoint_every: int = 50
    taps: tuple[int, ...] | None = None
    init: str | None = None  # a drafter to start from (its taps and head rows), not random weights
    checkpoints: Path | None = None  # default: OUT.ckpt next to OUT
    resume: bool = False
    finish: bool = False  # with resume: write the drafter from the last checkpoint, no more steps
    force: bool = False
    command: list[str] | None = None  # recorded in the provenance

    def checkpoint_dir(self) -> Path:
        if self.checkpoints is not None:
            return Path(self.checkpoints)
        out = Path(self.out)
        return out.with_name(out.name + ".ckpt")

    def recipe(self) -> dict[str, Any]:
        """What a resumed run must share with the run it continues."""
        keys = (
            "steps",
            "ttt_steps",
            "lr",
            "min_lr_ratio",
            "weight_decay",
            "clip",
            "step_weight",
            "batch",
            "max_len",
            "head_size",
            "holdout",
            "seed",
        )
        recipe = {k: getattr(self, k) for k in keys}
        recipe["warmup"] = self.warmup_steps()
        recipe["taps"] = list(self.taps) if self.taps else None
        recipe["target"] = str(self.target)
        recipe["data"] = str(Path(self.data).resolve())
        if self.init is not None:
            recipe["init"] = str(self.init)
        return recipe

    def warmup_steps(self) -> int:
        return self.warmup if self.warmup is not None else max(1, self.steps // 20)

    def check(self) -> None:
        for name in ("steps", "ttt_steps", "batch", "head_size", "eval_every", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise DrafterError(
                    f"--{name.replace('_', '-')} {getattr(self, name)}: expected >= 1"
                )
        if self.max_len < 2:
            raise DrafterError(f"--max-len {self.max_len}: expected at least 2 tokens")
        if not 0.0 < self.holdout < 1.0:
            raise DrafterError(f"--holdout {self.holdout}: expected a share in (0, 1)")
        for name in ("lr", "clip"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise DrafterError(f"--{name} {getattr(self, name)}: expected a positive number")
        if not 0 <= self.min_lr_ratio <= 1:
            raise DrafterError(f"--min-lr-ratio {self.min_lr_ratio}: expected a share in [0, 1]")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise DrafterError(f"--weight-decay {self.weight_decay}: expected 0 or more")
        if self.warmup is not None and self.warmup < 0:
            raise DrafterError(f"--warmup {self.warmup}: expected 0 or more")
        if self.warmup_steps() > self.steps:
            raise DrafterError(f"--warmup {self.warmup}: more than --steps {self.steps}")
        if self.finish and not self.resume:
            raise DrafterError("--finish ends a checkpointed run: pass --resume with it")


@dataclass
class TrainReport:
    steps: int = 0
    resumed_from: int = 0
    losses: list[float] = field(default_factory=list)  # this run's steps
    holdout_agreement: list[float] = field(default_factory=list)
    holdout_agreement_unconditional: list[float] = field(default_factory=list)
    holdout_agreement_initial: list[float] = field(default_factory=list)
    train_tokens_per_second: float = 0.0
    feature_seconds: float = 0.0
    train_seconds: float = 0.0
    out: Path | None = None


Progress = Callable[[str, int, int], None]  # (phase, done, total)
