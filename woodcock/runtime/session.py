"""Load a target and a drafter for generation: the mlx-lm model, its tokenizer, the tap adapter
and the MLX drafter of the right algorithm, checked against each other before any token."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from woodcock.converters.vocab import load_counts
from woodcock.errors import DrafterError
from woodcock.ir import Drafter, DrafterSpec
from woodcock.loading import load_drafter_with_format, resolve_source
from woodcock.runtime.backend import configure_tf32
from woodcock.runtime.block import BlockDrafter
from woodcock.runtime.eagle3 import Eagle3Drafter
from woodcock.runtime.ngram import NgramDrafter, PromptLookup
from woodcock.runtime.target import MlxTarget
from woodcock.target_checkpoint import load_mlx_target

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


@dataclass(frozen=True)
class DrafterChoice:
    """`PATH`, `PATH@N` (keep the N most frequent tokens' head rows, by the drafter's own token
    counts), `PATH@COUNTS:N` (by the counts in COUNTS, a vocab_counts.npz), or several sizes
    `PATH@COUNTS:N1,N2` where a command measures more than one; `ngram` for prompt lookup."""

    source: str | Path
    counts: str | None = None
    head_sizes: tuple[int, ...] = ()

    @classmethod
    def parse(cls, text: str | Path) -> DrafterChoice:
        if isinstance(text, Path):  # a local directory, whatever its name holds
            return cls(text)
        if not isinstance(text, str):
            raise DrafterError(
                f"drafter = {text!r}: expected a directory, a Hugging Face id or 'ngram' as a"
                " string or a Path"
            )
        if "@" not in text:
            return cls(text)
        source, _, truncation = text.rpartition("@")
        if source == "ngram":
            raise DrafterError(
                f"--drafter {text!r}: prompt lookup (ngram) has no draft head to truncate"
            )
        counts, _, sizes = truncation.rpartition(":")
        try:
            head_sizes = tuple(int(size) for size in sizes.split(","))
        except ValueError:
            raise DrafterError(
                f"--drafter {text!r}: expected PATH, PATH@N or PATH@COUNTS:N with N a number"
            ) from None
        if min(head_sizes) < 1:
            raise DrafterError(f"--drafter {text!r}: N must be at least 1")
        return cls(source, counts or None, head_sizes)


def truncated_head(drafter: Drafter, choice: DrafterChoice, head_size: int) -> np.ndarray | None:
    """Draft-head rows to keep: those of the `head_size` most frequent target tokens (ties:
    lower id), ascending. Verification still uses the full vocabulary: the output is unchanged."""
    if choice.counts is None:
        if drafter.vocab.counts is None:
            raise DrafterError(
                f"--drafter {choice.source}@{head_size}: the drafter ships no token counts;"
                " name a counts file: PATH@COUNTS:N"
            )
        counts = drafter.vocab.counts.counts
    else:
        counts = _read_counts(Path(choice.counts))
    target_ids = drafter.vocab.target_ids(drafter.spec)
    if counts.shape != (drafter.spec.target.vocab_size,):
        raise DrafterError(
            f"{choice.counts}: {counts.shape[0]} counts, the target vocabulary has"
            f" {drafter.spec.target.vocab_size} tokens"
        )
    if head_size >= len(target_ids):
        return None
    order = np.lexsort((target_ids, -counts[target_ids]))  # by count descending, then id
    return np.sort(order[:head_size])


def _read_counts(path: Path) -> np.ndarray:
    return load_counts(path).counts.counts


def default_dtype(requested: str | None):
    if requested is not None:
        if requested not in DTYPES:
            raise DrafterError(f"--dtype {requested!r}: expected one of {', '.join(DTYPES)}")
        return DTYPES[requested]
    # Half-precision and quantized matmuls do not use BLAS on the CPU backend: fp32 is faster.
    return mx.float32 if mx.default_device() == mx.cpu else None


@dataclass
class Session:
    model: object
    tokenizer: object
    target: MlxTarget
    drafter: object  # Eagle3Drafter, BlockDrafter or NgramDrafter
    spec: DrafterSpec | None  # None for the n-gram drafter
    head_label: str = "full"  # which draft head: "full" or its number of rows
    holdout_agreement: list[float] | None = None  # by draft step, when the drafter records it
    choice: DrafterChoice | None = None
    ir: Drafter | None = None
    shared: dict | None = None
    runtime_dtype: object = mx.float32
    lookup: object = None  # PromptLookup next to a model drafter, or None

    @property
    def dtype_name(self) -> str:
        """The runtime dtype as users write it ("float32")."""
        return str(self.runtime_dtype).removeprefix("mlx.core.")

    def drafter_with_head(self, head_size: int | None):
        """Another runtime drafter over the same weights, with a truncated head (None: full)."""
        head_ids = None if head_size is None else truncated_head(self.ir, self.choice, head_size)
        return runtime_drafter(self.ir, self.shared, dtype=self.runtime_dtype, head_ids=head_ids)


def runtime_drafter(
    drafter: Drafter, shared: dict | None, *, dtype=mx.float32, head_ids: np.ndarray | None = None
):
    """The MLX drafter of the IR's algorithm (BlockDrafter for DFlash / DSpark, else
    Eagle3Drafter). shared: the target's tensors the drafter takes from it; head_ids: the
    draft-head rows to keep (EAGLE-3 only; None: all)."""
    if drafter.spec.is_block:
        if head_ids is not None:
            raise DrafterError(
                "a truncated head (@N) is for EAGLE-3 drafters; block drafters draft once per block"
            )
        return BlockDrafter(drafter, shared, dtype=dtype)
    return Eagle3Drafter(drafter, shared, dtype=dtype, head_ids=head_ids)


def open_session(
    target_source: str,
    drafter_text: str,
    *,
    dtype: str | None = None,
    many_heads: bool = False,
    lookup: bool = True,
    loaded: tuple | None = None,
) -> Session:
    """many_heads: the caller measures several head sizes (`drafter_with_head`); otherwise at
    most one size may be given and the session's drafter uses it. lookup: rounds whose recent
    tokens repeat copy from the context instead of asking the model drafter (PromptLookup).
    loaded: (model, tokenizer) of target_source already loaded by another session, to share."""
    configure_tf32()  # before the target's first matmul: exact fp32 verifies on a GPU by default
    choice = DrafterChoice.parse(drafter_text)
    if len(choice.head_sizes) > 1 and not many_heads:
        raise DrafterError(f"--drafter {drafter_text!r}: give one head size here")
    model, tokenizer = loaded or load_mlx_target(target_source)
    compute_dtype = default_dtype(dtype)
    if compute_dtype is not None:
        model.set_dtype(compute_dtype)
    name = f"target {target_source}"
    if choice.source == "ngram":
        target = MlxTarget(model, (), name=name)
        return Session(model, tokenizer, target, NgramDrafter(target.vocab_size), None)
    drafter, fmt = load_drafter_with_format(choice.source)
    agreement = None
    if fmt.NAME == "woodcock":
        agreement = fmt.read_provenance(resolve_source(choice.source)).get("holdout_agreement")
    target = MlxTarget(model, drafter.spec.taps.layer_ids, name=name)
    target.check_fits(drafter.spec)
    head = drafter.spec.head
    shared = target.shared_tensors() if "shared" in (head.lm_head, head.embedding) else None
    runtime_dtype = compute_dtype or mx.float32
    size = choice.head_sizes[0] if len(choice.head_sizes) == 1 else None
    head_ids = None if size is None else truncated_head(drafter, choice, size)
    runtime = runtime_drafter(drafter, shared, dtype=runtime_dtype, head_ids=head_ids)
    return Session(
        model,
        tokenizer,
        target,
        runtime,
        drafter.spec,
        head_label="full" if head_ids is None else str(size),
        holdout_agreement=agreement,
        choice=choice,
        ir=drafter,
        shared=shared,
        runtime_dtype=runtime_dtype,
        lookup=PromptLookup(target.vocab_size) if lookup else None,
    )
