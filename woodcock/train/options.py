"""What a training run is asked for (`TrainOptions`, checked before any work; its fields declare
`woodcock train`'s options) and what it reports. One option set serves every algorithm: the
EAGLE-3 chain options (ttt_steps, step_weight) and the block options (block_size ..
freeze_head) are each left out of the recipe by the other kind, and refused when given to it."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any

from woodcock.cli_options import DefaultableTarget, parse_taps
from woodcock.errors import DrafterError


@dataclass(frozen=True)
class Flag:
    """How `woodcock train` takes a `TrainOptions` field: as --NAME (the field's name, dashed;
    --NAME/--no-NAME when negatable) with this help; `parse` makes the value from the option's
    text; `shared`: the option as the commands that share it declare it (woodcock.cli_options)."""

    help: str | None = None
    negatable: bool = False
    parse: Callable[[str | None], Any] | None = None
    shared: Any = None


FLAG = "flag"  # the metadata key of a field's Flag
DEFAULT_TOKEN_LOSS = "kl=1"


def option(default: Any = MISSING, help: str | None = None, **flag: Any) -> Any:
    """A field that is also an option of `woodcock train` (no default: a required option)."""
    return field(default=default, metadata={FLAG: Flag(help, **flag)})


@dataclass
class TrainOptions:
    """The fields made with `option` are `woodcock train`'s options, in the order of its help."""

    data: Path = option(help="A `woodcock distill` output directory.")
    out: Path = option(help="Drafter directory to write (woodcock).")
    target: str | None = option(None, shared=DefaultableTarget)  # None: the default target
    steps: int = option(300, "Optimizer steps.")
    ttt_steps: int = option(3, "Unrolled draft steps (training-time test).")
    lr: float = option(3e-4, "Peak learning rate.")
    min_lr_ratio: float = option(0.1, "Final learning rate / peak (cosine).")
    warmup: int | None = option(None, "Warm-up steps (default: 5 % of --steps).")
    weight_decay: float = option(0.01)
    clip: float = option(1.0, "Gradient-norm clipping.")
    batch: int = option(8, "Sequences per step.")
    max_len: int = option(384, "Tokens per sequence (prompt + answer), cut beyond.")
    head_size: int | None = option(
        None,
        "Draft vocabulary: the N most frequent tokens (default 8192 for eagle3; for"
        " dflash/dspark the whole vocabulary, with the target's head).",
    )
    holdout: float = option(
        0.05, "Share of the samples held out (by id; a conversation's ID#TURN turns together)."
    )
    taps: tuple[int, ...] | None = option(
        None, "Target layer ids (default 2,N/2,N-3).", parse=parse_taps
    )
    init: str | None = option(
        None,
        "Start from this drafter's weights (its taps and head rows) instead of random: a"
        " directory, or a shipped drafter's name.",
    )
    eval_every: int = option(200, "Hold-out evaluation every N steps.")
    checkpoint_every: int = option(50, "Checkpoint every N steps.")
    checkpoints: Path | None = option(None, "Checkpoint directory (default OUT.ckpt).")
    seed: int = option(0)
    resume: bool = option(False, "Continue from the last checkpoint.")
    finish: bool = option(
        False, "With --resume: stop there, write the drafter from the last checkpoint."
    )
    force: bool = option(False, "Replace OUT / start the checkpoints over.")
    algorithm: str = option("eagle3", "eagle3 (chain), dflash or dspark (block).")
    block_size: int = option(8, "dflash/dspark: slots per block.")
    layers: int = option(2, "dflash/dspark: decoder layers (Qwen3-style).")  # EAGLE-3: one
    markov_rank: int = option(256, "dspark: Markov head rank (0: none).")
    markov_head: str = option("vanilla", "dspark: vanilla, gated or rnn.")
    confidence_head: bool = option(True, "dspark: confidence head.", negatable=True)
    sample_from_anchor: bool | None = option(
        None,
        "dflash/dspark: the anchor slot drafts too (default: dspark yes, dflash no).",
        negatable=True,
    )
    anchors: int = option(16, "dflash/dspark: blocks per sequence per step.")  # at most
    decay_gamma: float = option(4.0, "dflash/dspark: slot k weighs exp(-k/gamma).")
    confidence_weight: float = option(1.0, "dspark: weight of the confidence BCE.")
    token_loss: str = option(
        DEFAULT_TOKEN_LOSS,
        "dflash/dspark: the draft slots' loss, weighted terms among kl (to the target's"
        " distribution), ce (on the target's token) and l1 (between the distributions; 2 TV):"
        " DeepSpec's DSpark recipe is ce=0.1,l1=0.9.",
        parse=lambda text: format_loss_terms(parse_loss_terms(text or "")),
    )
    freeze_head: bool = option(
        False,
        "dflash/dspark: keep a truncated head at the target's rows (a shared head is frozen).",
        negatable=True,
    )
    step_weight: float = 0.8  # EAGLE-3: TTT step k's loss weight step_weight**k
    command: list[str] | None = None  # recorded in the provenance

    @property
    def is_block(self) -> bool:
        return self.algorithm in BLOCK_ALGORITHMS

    def draft_head_size(self) -> int | None:
        """The head size asked for; None = the whole target vocabulary."""
        if self.head_size is not None:
            return self.head_size
        return None if self.is_block else 8192

    def anchor_first(self) -> bool:
        if self.sample_from_anchor is not None:
            return self.sample_from_anchor
        return self.algorithm == "dspark"

    def checkpoint_dir(self) -> Path:
        if self.checkpoints is not None:
            return Path(self.checkpoints)
        out = Path(self.out)
        return out.with_name(out.name + ".ckpt")

    def recipe(self) -> dict[str, Any]:
        """What a resumed run must share with the run it continues, besides its inputs (which
        `train` compares by content, wherever they lie: the answers, the target, the drafter
        started from, and the taps as resolved)."""
        chain = ("ttt_steps", "step_weight") if not self.is_block else ()
        keys = (
            "steps",
            *chain,
            "lr",
            "min_lr_ratio",
            "weight_decay",
            "clip",
            "batch",
            "max_len",
            "holdout",
            "seed",
        )
        recipe = {k: getattr(self, k) for k in keys}
        recipe["head_size"] = self.draft_head_size()
        recipe["warmup"] = self.warmup_steps()
        if self.is_block:
            recipe["algorithm"] = self.algorithm
            for k in ("block_size", "layers", "anchors", "decay_gamma"):
                recipe[k] = getattr(self, k)
            recipe["sample_from_anchor"] = self.anchor_first()
            # recorded where they differ from the defaults, so earlier checkpoints still resume
            if self.token_loss != DEFAULT_TOKEN_LOSS:
                recipe["token_loss"] = self.token_loss
            if self.freeze_head:
                recipe["freeze_head"] = True
            if self.algorithm == "dspark":
                for k in ("markov_rank", "markov_head", "confidence_head", "confidence_weight"):
                    recipe[k] = getattr(self, k)
        return recipe

    def warmup_steps(self) -> int:
        return self.warmup if self.warmup is not None else max(1, self.steps // 20)

    def check(self) -> None:
        if self.algorithm not in ("eagle3", *BLOCK_ALGORITHMS):
            raise DrafterError(
                f"--algorithm {self.algorithm!r}: expected eagle3, {', '.join(BLOCK_ALGORITHMS)}"
            )
        counts = ("steps", "ttt_steps", "batch", "eval_every", "checkpoint_every")
        if self.is_block:
            counts = (*counts, "layers", "anchors")
        for name in counts:
            if getattr(self, name) < 1:
                raise DrafterError(
                    f"--{name.replace('_', '-')} {getattr(self, name)}: expected >= 1"
                )
        if self.head_size is not None and self.head_size < 1:
            raise DrafterError(f"--head-size {self.head_size}: expected >= 1")
        if self.is_block:
            self._check_block()
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
        if not 0 <= self.seed < 2**64:
            raise DrafterError(f"--seed {self.seed}: expected an integer in [0, 2**64)")
        if self.warmup is not None and self.warmup < 0:
            raise DrafterError(f"--warmup {self.warmup}: expected 0 or more")
        if self.warmup_steps() > self.steps:
            raise DrafterError(f"--warmup {self.warmup}: more than --steps {self.steps}")
        if self.finish and not self.resume:
            raise DrafterError("--finish ends a checkpointed run: pass --resume with it")
        for name, algorithms in OPTION_ALGORITHMS.items():
            given = getattr(self, name)
            if self.algorithm not in algorithms and given != _default(name):
                raise DrafterError(
                    f"--{name.replace('_', '-')} {given}: an option of --algorithm"
                    f" {' or '.join(algorithms)}, not of {self.algorithm}"
                )

    def _check_block(self) -> None:
        if self.block_size < 1 + (not self.anchor_first()):
            raise DrafterError(
                f"--block-size {self.block_size}: expected room for at least one draft slot"
            )
        if self.max_len < self.block_size + 2:
            raise DrafterError(
                f"--max-len {self.max_len}: a block of {self.block_size} needs a longer sequence"
            )
        if self.markov_rank < 0:
            raise DrafterError(f"--markov-rank {self.markov_rank}: expected 0 or more")
        if self.markov_head not in MARKOV_HEADS:
            raise DrafterError(
                f"--markov-head {self.markov_head!r}: expected one of {', '.join(MARKOV_HEADS)}"
            )
        if not (math.isfinite(self.decay_gamma) and self.decay_gamma > 0):
            raise DrafterError(f"--decay-gamma {self.decay_gamma}: expected a positive number")
        if not (math.isfinite(self.confidence_weight) and self.confidence_weight >= 0):
            raise DrafterError(f"--confidence-weight {self.confidence_weight}: expected 0 or more")
        parse_loss_terms(self.token_loss)


BLOCK_ALGORITHMS = ("dflash", "dspark")
MARKOV_HEADS = ("vanilla", "gated", "rnn")
LOSS_TERMS = ("kl", "ce", "l1")

# the options one kind of drafter uses; given to another (a value other than the default) they
# are refused rather than ignored: `--block-size 8` without `--algorithm dspark` trains EAGLE-3
OPTION_ALGORITHMS = {
    "ttt_steps": ("eagle3",),
    **dict.fromkeys(
        ("block_size", "layers", "sample_from_anchor", "anchors", "decay_gamma", "token_loss"),
        BLOCK_ALGORITHMS,
    ),
    "freeze_head": BLOCK_ALGORITHMS,
    **dict.fromkeys(
        ("markov_rank", "markov_head", "confidence_head", "confidence_weight"), ("dspark",)
    ),
}


def _default(name: str) -> Any:
    return TrainOptions.__dataclass_fields__[name].default


def parse_loss_terms(text: str) -> dict[str, float]:
    """'ce=0.1,l1=0.9' -> {'ce': 0.1, 'l1': 0.9}: each term once, weights >= 0, one above 0."""
    terms: dict[str, float] = {}
    for part in text.split(","):
        name, _, weight = part.partition("=")
        name = name.strip()
        try:
            value = float(weight)
        except ValueError:
            value = math.nan
        if name not in LOSS_TERMS or name in terms or not (math.isfinite(value) and value >= 0):
            raise DrafterError(
                f"--token-loss {text!r}: expected terms like kl=1 or ce=0.1,l1=0.9, each of"
                f" {', '.join(LOSS_TERMS)} at most once with a weight of 0 or more"
            )
        terms[name] = value
    if not any(terms.values()):
        raise DrafterError(f"--token-loss {text!r}: expected a term with a weight above 0")
    return terms


def format_loss_terms(terms: dict[str, float]) -> str:
    return ",".join(f"{name}={terms[name]:g}" for name in LOSS_TERMS if name in terms)


@dataclass
class TrainReport:
    steps: int = 0
    resumed_from: int = 0
    losses: list[float] = field(default_factory=list)  # this run's steps
    holdout_agreement: list[float] = field(default_factory=list)
    holdout_agreement_unconditional: list[float] = field(default_factory=list)
    holdout_agreement_initial: list[float] = field(default_factory=list)
    holdout: dict[str, Any] = field(default_factory=dict)  # block drafters: the last evaluation
    holdout_initial: dict[str, Any] = field(default_factory=dict)
    train_tokens_per_second: float = 0.0
    feature_seconds: float = 0.0
    train_seconds: float = 0.0
    out: Path | None = None
    wrote: bool = True  # False on the other ranks of a distributed run: rank 0 writes


Progress = Callable[[str, int, int], None]  # (phase, done, total)
