"""Load a target and a drafter for generation: the mlx-lm model, its tokenizer, the tap adapter
and the MLX drafter of the right algorithm, checked against each other before any token."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from woodcock.errors import DrafterError
from woodcock.ir import Drafter
from woodcock.loading import load_drafter
from woodcock.runtime.target import MlxTarget

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


@dataclass(frozen=True)
class DrafterChoice:
    """`PATH`, `PATH@N` (keep the N most frequent tokens' head rows, by the drafter's own token
    counts) or `PATH@COUNTS:N` (by the counts in COUNTS, a vocab_counts.npz)."""

    source: str
    counts: str | None = None
    head_size: int | None = None

    @classmethod
    def parse(cls, text: str) -> DrafterChoice:
        if "@" not in text:
            return cls(text)
        source, _, truncation = text.rpartition("@")
        counts, _, size = truncation.rpartition(":")
        try:
            head_size = int(size)
        except ValueError:
            raise DrafterError(
                f"--drafter {text!r}: expected PATH, PATH@N or PATH@COUNTS:N with N a number"
            ) from None
        if head_size < 1:
            raise DrafterError(f"--drafter {text!r}: N must be at least 1")
        return cls(source, counts or None, head_size)


def truncated_head(drafter: Drafter, choice: DrafterChoice) -> np.ndarray | None:
    """Draft-head rows to keep: those of the N most frequent target tokens (ties: lower id),
    ascending. The verification still uses the full vocabulary, so the output is unchanged."""
    if choice.head_size is None:
        return None
    if choice.counts is None:
        if drafter.vocab.counts is None:
            raise DrafterError(
                f"--drafter {choice.source}@{choice.head_size}: the drafter ships no token"
                " counts; name a counts file: PATH@COUNTS:N"
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
    if choice.head_size >= len(target_ids):
        return None
    order = np.lexsort((target_ids, -counts[target_ids]))  # by count descending, then id
    return np.sort(order[: choice.head_size])


def _read_counts(path: Path) -> np.ndarray:
    from woodcock.formats.woodcock import COUNTS

    file = path / COUNTS if path.is_dir() else path
    try:
        with np.load(file, allow_pickle=False) as archive:
            return np.asarray(archive["counts"], dtype=np.int64)
    except (OSError, KeyError, ValueError) as e:
        raise DrafterError(f"{file}: expected a .npz with a 'counts' array ({e})") from None


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
    drafter: object  # Eagle3Drafter or BlockDrafter
    spec: object
    holdout_agreement: list[float] | None = None  # by draft step, when the drafter records it


def open_session(target_source: str, drafter_text: str, *, dtype: str | None = None) -> Session:
    from mlx_lm import load

    choice = DrafterChoice.parse(drafter_text)
    drafter = load_drafter(choice.source)
    head_ids = truncated_head(drafter, choice)
    model, tokenizer = load(target_source)
    compute_dtype = default_dtype(dtype)
    if compute_dtype is not None:
        model.set_dtype(compute_dtype)
    target = MlxTarget(model, drafter.spec.taps.layer_ids, name=f"target {target_source}")
    target.check_fits(drafter.spec)
    shared = (
        target.shared_tensors()
        if "shared" in (drafter.spec.head.lm_head, drafter.spec.head.embedding)
        else None
    )
    runtime_dtype = compute_dtype or mx.float32
    if drafter.spec.is_block:
        from woodcock.runtime.block import BlockDrafter

        if head_ids is not None:
            raise DrafterError(
                "a truncated head (@N) is for EAGLE-3 drafters; block drafters draft once per block"
            )
        runtime = BlockDrafter(drafter, shared, dtype=runtime_dtype)
    else:
        from woodcock.runtime.eagle3 import Eagle3Drafter

        runtime = Eagle3Drafter(drafter, shared, dtype=runtime_dtype, head_ids=head_ids)
    return Session(model, tokenizer, target, runtime, drafter.spec)
