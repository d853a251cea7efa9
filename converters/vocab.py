"""Draft-vocabulary truncation (FR-Spec / VocabTrim) and expansion, and token-count files.

Truncation keeps the draft rows of the N most frequent target tokens in a counts file (ties:
lower id first, the rule speculators and the runtime's `PATH@N` use): those rows of lm_head and,
for DSpark, of the Markov head's markov_w2, ascending by target id, and the draft-to-target map
that says which target id each row is. A shared LM head needs no rows copied: it stays the
target's, read through the new map. Nothing else changes, so on the kept tokens the logits are
exactly the drafter's own; verification keeps the output exact whatever the draft head is.

Expansion is the reverse: a reduced head becomes a full-vocabulary one, for formats without a
map (z-lab DFlash, DeepSpec and SpecForge DSpark). Representation: every row of a token the
drafter never had is a zero row, in lm_head and in markov_w2 alike, so such a token scores a
logit of exactly 0 (and a Markov bias of 0), not minus infinity: the IR has no LM-head bias to
carry -inf, and a mask would be a tensor no target format can hold. The kept tokens' logits are
unchanged; a greedy draft picks a token the drafter never had only when every kept logit is
below 0, and sampling gives those tokens exp(0)/Z each. Acceptance can drop; the output of
speculative decoding stays exact. A shared LM head simply loses the map: the target's head then
scores every token.

Counts files (written by `woodcock vocab count`): vocab_counts.npz with `counts` (int64 [V], the
training split) and optionally `holdout_counts` (int64 [V], the hold-out split), and
vocab_counts.json next to it describing the corpus (`holdout_coverage` by head size, ...).
"""

from __future__ import annotations

import dataclasses
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from woodcock.errors import DrafterError
from woodcock.ir import Drafter, VocabCounts, VocabMap, error_prefix
from woodcock.jsonfile import read_json_object

# the file names `woodcock vocab count` writes and the native format keeps beside a drafter
COUNTS_FILE = "vocab_counts.npz"
COUNTS_INFO = "vocab_counts.json"
HEAD_ROWS = ("lm_head.weight", "markov_head.markov_w2.weight")  # indexed by draft row


@dataclass(frozen=True, eq=False)
class CountsFile:
    """A counts file as read: the training counts (with their info) and, when the file has
    them, the hold-out counts that coverage is measured on."""

    counts: VocabCounts
    holdout: np.ndarray | None
    path: Path


def load_counts(path: str | Path) -> CountsFile:
    """A vocab_counts.npz, or a directory holding one; vocab_counts.json next to it (same stem)
    is read when present."""
    path = Path(path)
    file = path / COUNTS_FILE if path.is_dir() else path
    try:
        with np.load(file, allow_pickle=False) as archive:
            if "counts" not in archive.files:
                raise DrafterError(f"{file}: no array named 'counts' (found {archive.files})")
            counts = archive["counts"]
            holdout = archive["holdout_counts"] if "holdout_counts" in archive.files else None
    except FileNotFoundError:
        raise DrafterError(f"{file}: no such counts file") from None
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
        raise DrafterError(f"{file}: not a readable .npz archive ({e})") from None
    info_file = file.with_suffix(".json")
    info = read_json_object(info_file) if info_file.is_file() else {}
    with error_prefix(f"{file}: "):
        vocab_counts = VocabCounts(counts, info)
        if holdout is not None:
            holdout = VocabCounts(holdout).counts
            if holdout.shape != vocab_counts.counts.shape:
                raise DrafterError(
                    f"holdout_counts has {holdout.shape[0]} entries, counts has"
                    f" {vocab_counts.counts.shape[0]}"
                )
    return CountsFile(vocab_counts, holdout, file)


def most_frequent(counts: np.ndarray, candidates: np.ndarray, n: int) -> np.ndarray:
    """Positions (into `candidates`, ascending) of the n candidate ids with the highest counts;
    ties go to the lower id."""
    order = np.lexsort((candidates, -counts[candidates]))
    return np.sort(order[:n])


def coverage(counts: np.ndarray, ids: np.ndarray) -> float | None:
    """The fraction of the counted tokens whose id is in `ids` (None without any tokens)."""
    total = int(counts.sum())
    return None if total == 0 else float(counts[ids].sum()) / total


def coverage_by_size(
    train: np.ndarray, holdout: np.ndarray, sizes: list[int]
) -> dict[str, float | None]:
    """Hold-out coverage of the N most frequent training tokens, for each N."""
    order = np.lexsort((np.arange(train.shape[0]), -train))
    return {str(n): coverage(holdout, order[:n]) for n in sizes}


def truncate(
    drafter: Drafter,
    size: int,
    counts: VocabCounts | None = None,
    holdout: np.ndarray | None = None,
) -> tuple[Drafter, dict[str, Any]]:
    """Keep the draft rows of the `size` most frequent tokens (by `counts`, else the drafter's
    own). Returns the drafter (the counts attached) and a report: sizes, the training-token
    coverage and, when `holdout` counts are given, the hold-out coverage of the kept tokens."""
    spec = drafter.spec
    vocab = spec.target.vocab_size
    counts = counts if counts is not None else drafter.vocab.counts
    if counts is None:
        raise DrafterError(
            "--truncate-vocab: the drafter carries no token counts; pass --counts FILE"
            " (made by `woodcock vocab count`)"
        )
    if counts.counts.shape != (vocab,):
        raise DrafterError(
            f"token counts cover {counts.counts.shape[0]} ids, the target vocabulary has {vocab}"
        )
    ids = drafter.vocab.target_ids(spec)
    if size < 1:
        raise DrafterError(f"--truncate-vocab {size}: expected at least 1 token")
    if size > ids.shape[0]:
        raise DrafterError(
            f"--truncate-vocab {size}: the drafter has only {ids.shape[0]} draft tokens;"
            " truncation cannot add rows"
        )
    rows = most_frequent(counts.counts, ids, size)
    kept = ids[rows]
    report: dict[str, Any] = {
        "kept": size,
        "draft_vocab_before": int(ids.shape[0]),
        "target_vocab": vocab,
        "train_coverage": coverage(counts.counts, kept),
        "holdout_coverage": None if holdout is None else coverage(holdout, kept),
    }
    recorded = counts.info.get("holdout_coverage")
    if holdout is None and ids.shape[0] == vocab and isinstance(recorded, dict):
        value = recorded.get(str(size))  # measured for the N most frequent of every token
        report["holdout_coverage"] = value if isinstance(value, float) else None
    if size == ids.shape[0]:
        return Drafter(
            spec, VocabMap(drafter.vocab.draft_to_target, counts), drafter.weights
        ), report
    weights = dict(drafter.weights)
    for name in HEAD_ROWS:
        if name in weights:
            weights[name] = weights[name][rows]  # the only copy: the kept rows
    new_spec = dataclasses.replace(spec, draft_vocab_size=size)
    new_map = None if size == vocab else kept
    return Drafter(new_spec, VocabMap(new_map, counts), weights), report


def expand(drafter: Drafter) -> Drafter:
    """A reduced draft vocabulary made full: missing tokens get zero rows (see the module doc);
    a shared LM head just drops the map."""
    spec = drafter.spec
    ids = drafter.vocab.draft_to_target
    if ids is None:
        raise DrafterError("--expand-vocab: the draft vocabulary is already the target's")
    vocab = spec.target.vocab_size
    weights = dict(drafter.weights)
    for name in HEAD_ROWS:
        if name in weights:
            rows = weights[name]
            full = np.zeros((vocab, *rows.shape[1:]), dtype=rows.dtype)
            full[ids] = rows
            weights[name] = full
    new_spec = dataclasses.replace(spec, draft_vocab_size=vocab)
    return Drafter(new_spec, VocabMap(None, drafter.vocab.counts), weights)


def attach_counts(drafter: Drafter, counts: VocabCounts) -> Drafter:
    """Record token counts with the drafter (the native format stores them)."""
    vocab = drafter.spec.target.vocab_size
    if counts.counts.shape != (vocab,):
        raise DrafterError(
            f"token counts cover {counts.counts.shape[0]} ids, the target vocabulary has {vocab}"
        )
    return Drafter(drafter.spec, VocabMap(drafter.vocab.draft_to_target, counts), drafter.weights)


def describe(report: dict[str, Any]) -> str:
    """One line for the convert command."""
    parts = [
        f"kept {report['kept']:,} of {report['draft_vocab_before']:,} draft tokens"
        f" (target vocabulary {report['target_vocab']:,})"
    ]
    if report["train_coverage"] is not None:
        parts.append(f"training coverage {100 * report['train_coverage']:.2f}%")
    if report["holdout_coverage"] is not None:
        parts.append(f"hold-out coverage {100 * report['holdout_coverage']:.2f}%")
    else:
        parts.append("hold-out coverage unknown (the counts file has no hold-out split)")
    return "vocab: " + ", ".join(parts)


def apply_options(
    drafter: Drafter, size: int | None, counts_path: str | None, expand_vocab: bool
) -> tuple[Drafter, str | None]:
    """`woodcock convert --truncate-vocab N [--counts FILE]` / `--counts FILE` (attach only) /
    `--expand-vocab`: the new drafter and a line for the user (None when nothing to say)."""
    if expand_vocab and size is not None:
        raise DrafterError("--expand-vocab and --truncate-vocab exclude each other")
    loaded = load_counts(counts_path) if counts_path is not None else None
    if expand_vocab:
        before = drafter.spec.draft_vocab_size
        drafter = expand(drafter)
        if loaded is not None:
            drafter = attach_counts(drafter, loaded.counts)
        return drafter, (
            f"vocab: expanded {before:,} draft tokens to the full {drafter.spec.draft_vocab_size:,}"
            " (missing tokens get zero rows: logit 0)"
        )
    if size is None:
        if loaded is None:
            return drafter, None
        return attach_counts(drafter, loaded.counts), f"vocab: token counts from {loaded.path}"
    drafter, report = truncate(
        drafter,
        size,
        None if loaded is None else loaded.counts,
        None if loaded is None else loaded.holdout,
    )
    return drafter, describe(report)
