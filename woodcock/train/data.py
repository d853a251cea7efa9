"""The training data: distilled samples, the hold-out split, the draft head's tokens, padded
batches and their order (a function of the seed and the step, so a resumed run sees the same
batches)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from woodcock.errors import DrafterError
from woodcock.jsonfile import outside_range
from woodcock.train.distill import META, answer_records
from woodcock.train.features import from_fp16


@dataclass(frozen=True)
class Sample:
    id: str
    tokens: np.ndarray  # int32 [L], prompt then answer, cut to max_len
    prompt_length: int


def load_samples(data: Path, max_len: int, *, vocab_size: int) -> list[Sample]:
    """The answers in `data` as samples cut to `max_len` tokens (one keeping no answer token is
    left out). Every id must be a token of the target's `vocab_size`, and each answer's id
    unique: two `woodcock distill` runs into one folder once appended every answer twice."""
    data = Path(data)
    if not (data / META).exists():
        raise DrafterError(f"{data}: no {META}; make the data with `woodcock distill`")
    samples = []
    first_seen: dict[str, str] = {}
    for where, row in answer_records(data):
        if row["id"] in first_seen:
            line = first_seen[row["id"]].rpartition(":")[2]
            raise DrafterError(f"{where}: id {row['id']!r} occurs twice (first on line {line})")
        first_seen[row["id"]] = where
        prompt, answer = row["prompt_ids"], row["answer_ids"]
        _refuse_outside_vocabulary(where, "prompt_ids", prompt, vocab_size)
        _refuse_outside_vocabulary(where, "answer_ids", answer, vocab_size)
        tokens = np.array((prompt + answer)[:max_len], dtype=np.int32)
        if len(prompt) < 1 or len(tokens) < len(prompt) + 1:
            continue  # nothing of the answer survives the cut
        samples.append(Sample(row["id"], tokens, len(prompt)))
    if len(samples) < 2:
        raise DrafterError(
            f"{data}: {len(samples)} usable answer(s); training needs at least 2 (one is held out)"
        )
    return samples


def _refuse_outside_vocabulary(where: str, key: str, ids: list[int], vocab_size: int) -> None:
    # the target's forward does not check its ids: one past the embedding crashed it (a
    # segfault, not an error), and a negative one failed later, in the head's token counts
    bad = outside_range(ids, vocab_size)
    if bad is not None:
        raise DrafterError(
            f"{where}: {key} holds token id {bad}; expected ids in [0, {vocab_size}),"
            " the target's vocabulary"
        )


def holdout_split(samples: Sequence[Sample], share: float) -> tuple[list[Sample], list[Sample]]:
    """(train, holdout): a sample is held out when the sha256 of its id's part before any "#"
    lies in the lowest `share` of the hash range, so the split does not depend on order or on
    which other samples exist, and the turns of one conversation ("ID#TURN", as
    build_train_prompts.py names them) fall on one side with its opening ("ID"): a held-out
    answer's earlier turns are not trained on. At least one sample lands on each side."""
    keyed = [(_hash_share(s.id.partition("#")[0]), s) for s in samples]
    if len({key for key, _ in keyed}) == 1:  # one conversation: its turns are split instead
        keyed = [(_hash_share(s.id), s) for s in samples]
    holdout = [s for key, s in keyed if key < share]
    if not holdout:
        lowest = min(key for key, _ in keyed)
        holdout = [s for key, s in keyed if key == lowest]
    if len(holdout) == len(samples):
        highest = max(key for key, _ in keyed)
        holdout = [s for key, s in keyed if key != highest]
    held = {s.id for s in holdout}
    return [s for s in samples if s.id not in held], holdout


def _hash_share(text: str) -> float:
    """Where sha256(text) lies in the hash range, in [0, 1)."""
    return int(hashlib.sha256(text.encode()).hexdigest()[:12], 16) / 16**12


def answer_tokens(samples: Sequence[Sample]) -> np.ndarray:
    if not samples:
        return np.zeros(0, np.int64)
    return np.concatenate([s.tokens[s.prompt_length :] for s in samples]).astype(np.int64)


def choose_head(counts: np.ndarray, head_size: int) -> np.ndarray | None:
    """Target ids of the head rows, ascending: the `head_size` most frequent (ties: lower id);
    None when that is the whole vocabulary."""
    if head_size >= counts.shape[0]:
        return None
    order = np.lexsort((np.arange(counts.shape[0]), -counts))
    return np.sort(order[:head_size]).astype(np.int64)


def coverage(counts: np.ndarray, tokens: np.ndarray, size: int) -> float:
    head = choose_head(counts, size)
    if tokens.size == 0:
        return 0.0
    if head is None:
        return 1.0
    return float(np.isin(tokens, head).mean())


@dataclass
class Batch:
    """One padded batch; per-position arrays are [B, Lp] with Lp = R + K + 1 (R rows)."""

    tokens: np.ndarray  # x_j
    final: mx.array  # target final hidden at j, float32 [B, Lp, Ht], on the device
    argmax: np.ndarray  # target argmax at j
    taps: mx.array  # g_i for rows i < R, float32 [B, R, A*Ht], on the device
    lengths: np.ndarray  # [B]
    prompt_lengths: np.ndarray  # [B]

    @property
    def rows(self) -> int:
        return self.taps.shape[1]

    @property
    def tokens_in(self) -> int:
        return int(self.lengths.sum())


@dataclass
class BatchLengths:
    """The sequence and prompt lengths of a batch of feature-cache entries, without its rows."""

    lengths: np.ndarray  # [B]
    prompt_lengths: np.ndarray  # [B]

    @classmethod
    def of(cls, entries: Sequence[dict]) -> BatchLengths:
        return cls(
            np.array([e["length"] for e in entries], np.int64),
            np.array([e["prompt_length"] for e in entries], np.int64),
        )


def make_batch(arrays: dict[str, np.ndarray], entries: Sequence[dict], steps: int) -> Batch:
    longest = max(e["length"] for e in entries)
    rows = longest - 1
    width = rows + steps + 1
    b = len(entries)
    hidden, taps_width = arrays["final"].shape[1], arrays["taps"].shape[1]
    tokens = np.zeros((b, width), np.int32)
    argmax = np.full((b, width), -1, np.int32)
    final = np.zeros((b, width, hidden), np.float16)
    final_exp = np.zeros((b, width, 1), np.int8)
    taps = np.zeros((b, rows, taps_width), np.float16)
    taps_exp = np.zeros((b, rows, arrays["taps_exp"].shape[1]), np.int8)
    for j, e in enumerate(entries):
        s, n = e["start"], e["length"]
        tokens[j, :n] = arrays["tokens"][s : s + n]
        argmax[j, :n] = arrays["argmax"][s : s + n]
        final[j, :n] = arrays["final"][s : s + n]
        final_exp[j, :n] = arrays["final_exp"][s : s + n]
        taps[j, : n - 1] = arrays["taps"][s : s + n - 1]
        taps_exp[j, : n - 1] = arrays["taps_exp"][s : s + n - 1]
    shape = BatchLengths.of(entries)
    return Batch(
        tokens,
        from_fp16(final, final_exp),
        argmax,
        from_fp16(taps, taps_exp),
        shape.lengths,
        shape.prompt_lengths,
    )


def epoch_batches(entries: Sequence[dict], batch: int, seed: int, epoch: int) -> list[list[int]]:
    """Indices into `entries` per batch for one epoch: shuffled, then sorted by length within
    windows of 16 batches (less padding), batch order shuffled again. A function of
    (seed, epoch) only, so a resumed run sees the same batches."""
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(entries))
    window = batch * 16
    batches = []
    for start in range(0, len(order), window):
        chunk = sorted(order[start : start + window], key=lambda i: entries[i]["length"])
        batches.extend(chunk[j : j + batch] for j in range(0, len(chunk), batch))
    perm = rng.permutation(len(batches))
    return [[int(i) for i in batches[p]] for p in perm]


class BatchPlan:
    def __init__(self, entries: Sequence[dict], batch: int, seed: int):
        self.entries, self.batch, self.seed = list(entries), batch, seed
        self.per_epoch = len(epoch_batches(self.entries, batch, seed, 0))
        self._cache: dict[int, list[list[int]]] = {}

    def at(self, step: int) -> list[dict]:
        """The batch of 1-based training step `step`."""
        epoch, index = divmod(step - 1, self.per_epoch)
        if epoch not in self._cache:
            self._cache = {epoch: epoch_batches(self.entries, self.batch, self.seed, epoch)}
        return [self.entries[i] for i in self._cache[epoch][index]]


def eval_batches(
    arrays, entries: Sequence[dict], steps: int, tokens: int = 4096
) -> Iterator[Batch]:
    """The hold-out samples in batches of about `tokens` padded tokens, shortest first; made
    as they are consumed."""
    ordered = sorted(entries, key=lambda e: e["length"])
    group: list[dict] = []
    for e in ordered:
        if group and (len(group) + 1) * e["length"] > tokens:
            yield make_batch(arrays, group, steps)
            group = []
        group.append(e)
    if group:
        yield make_batch(arrays, group, steps)
