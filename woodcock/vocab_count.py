"""`woodcock vocab count`: how often each target token occurs in a corpus, with a hold-out split
to measure how much of unseen text a truncated draft head covers.

Input: a directory of text files (those matching --glob, read as UTF-8 and tokenized with the
target's tokenizer, `transformers.AutoTokenizer` from the target directory, no special tokens
added), or a .jsonl file whose lines are token-id lists, objects with `input_ids` / `token_ids`,
or objects with `text` (tokenized). The corpus is cut into segments (a JSONL line; for text
files, runs of whole lines of up to 64 KiB); each segment goes to the hold-out split with
probability --holdout, drawn from a seeded generator in file order, so a run is reproducible.

Output, in --out: vocab_counts.npz (`counts`: int64 [target vocab] of the training split;
`holdout_counts`: the same for the hold-out split) and vocab_counts.json (source, sizes, and
`holdout_coverage`: for head sizes N, the fraction of hold-out tokens among the N most frequent
training tokens). The vocabulary size is the target config's vocab_size, which may exceed the
tokenizer's length (Qwen3: 151936 rows, 151669 tokens).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer

from woodcock.cli_options import DefaultableTarget
from woodcock.converters.vocab import COUNTS_FILE, COUNTS_INFO, coverage_by_size
from woodcock.errors import DrafterError
from woodcock.jsonfile import is_int_list, jsonl_records, outside_range
from woodcock.provenance import portable_path
from woodcock.staging import staged_file

# `woodcock` imports this module to register the command: target_checkpoint (which loads every
# drafter format) and transformers are imported when a count runs, not at every start-up.

app = typer.Typer(
    name="vocab",
    help="Token counts for draft-vocabulary truncation (woodcock convert --truncate-vocab).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

SEGMENT_BYTES = 64 * 1024
TEXT_BATCH = 64


@app.callback()
def _vocab() -> None:
    """Token counts for draft-vocabulary truncation."""


@app.command("count")
def count_command(
    source: Annotated[
        Path, typer.Argument(help="A directory of text files, or a .jsonl of token ids or texts.")
    ],
    out: Annotated[
        Path, typer.Option("--out", help="Directory for vocab_counts.npz and vocab_counts.json.")
    ],
    target: DefaultableTarget = None,
    holdout: Annotated[
        float, typer.Option("--holdout", help="Fraction of segments held out for coverage.")
    ] = 0.05,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the hold-out split.")] = 0,
    glob: Annotated[
        str, typer.Option("--glob", help="Which files of a directory to read.")
    ] = "**/*.txt",
    force: Annotated[
        bool, typer.Option("--force", help="Replace existing counts files in --out.")
    ] = False,
) -> None:
    """Count target tokens in a corpus: vocab_counts.npz + vocab_counts.json."""
    from woodcock.default_target import resolve_target
    from woodcock.loading import resolve_source

    target_dir = resolve_source(resolve_target(target))
    info = count_tokens(source, target_dir, out, holdout=holdout, seed=seed, glob=glob, force=force)
    tokens = info["tokens"]
    coverage = info["holdout_coverage"]
    shown = (
        ", ".join(f"{n}: {100 * c:.1f}%" for n, c in coverage.items() if c is not None)
        or "none (no hold-out tokens)"
    )
    typer.echo(
        f"{out}/{COUNTS_FILE}: {tokens['train']:,} training and {tokens['holdout']:,} hold-out"
        f" tokens, {info['distinct_tokens']:,} distinct of {info['vocab_size']:,};"
        f" hold-out coverage by head size: {shown}"
    )


def count_tokens(
    source: Path,
    target: Path,
    out: Path,
    *,
    holdout: float = 0.05,
    seed: int = 0,
    glob: str = "**/*.txt",
    force: bool = False,
) -> dict[str, Any]:
    """Count, write the two files and return the info written to vocab_counts.json."""
    from woodcock.target_checkpoint import target_from_config

    source, target, out = Path(source), Path(target), Path(out)
    if not 0.0 <= holdout < 1.0:
        raise DrafterError(f"--holdout {holdout}: expected a fraction in [0, 1)")
    if seed < 0:
        raise DrafterError(f"--seed {seed}: expected 0 or more")
    if not source.exists():
        raise DrafterError(f"{source}: no such file or directory")
    files = [out / COUNTS_FILE, out / COUNTS_INFO]
    if not force and any(f.exists() for f in files):
        raise DrafterError(f"{out}: already holds {COUNTS_FILE}; pass --force to replace it")
    vocab = target_from_config(target).vocab_size
    tokenizer = _Tokenizer(target)
    rng = np.random.default_rng(seed)
    counts = {False: np.zeros(vocab, np.int64), True: np.zeros(vocab, np.int64)}
    segments = {False: 0, True: 0}
    pending: dict[bool, list] = {False: [], True: []}

    def flush(split: bool) -> None:
        if pending[split]:
            counts[split] += np.bincount(np.concatenate(pending[split]), minlength=vocab)
            pending[split].clear()

    for where, batch in _segments(source, glob, tokenizer):
        for ids in batch:
            is_holdout = bool(rng.random() < holdout)
            segments[is_holdout] += 1
            if not ids:
                continue
            bad = outside_range(ids, vocab)
            if bad is not None:
                raise DrafterError(
                    f"{where}: token id {bad} is outside the target vocabulary [0, {vocab})"
                )
            pending[is_holdout].append(np.asarray(ids, dtype=np.int64))
            if len(pending[is_holdout]) >= 4096:
                flush(is_holdout)
    flush(False)
    flush(True)
    train, held = counts[False], counts[True]
    if int(train.sum()) == 0:
        raise DrafterError(f"{source}: no tokens counted (empty corpus, or --glob {glob!r})")
    sizes = sorted({2**k for k in range(4, 18)} | {32000})
    info = {
        "source": portable_path(source, out),
        "target": portable_path(target, out),
        "tokenizer": tokenizer.name,
        "vocab_size": vocab,
        "segments": {"train": segments[False], "holdout": segments[True]},
        "tokens": {"train": int(train.sum()), "holdout": int(held.sum())},
        "distinct_tokens": int(np.count_nonzero(train + held)),
        "holdout_fraction": holdout,
        "seed": seed,
        "holdout_coverage": coverage_by_size(train, held, [n for n in sizes if n < vocab]),
    }
    out.mkdir(parents=True, exist_ok=True)
    _replace(out / COUNTS_FILE, lambda f: np.savez(f, counts=train, holdout_counts=held))
    _replace(out / COUNTS_INFO, lambda f: f.write((json.dumps(info, indent=2) + "\n").encode()))
    return info


def _replace(path: Path, write) -> None:
    """Whole or nothing: written aside (a killed run's leftover is removed by the next run that
    writes `path`), then renamed over it."""
    with staged_file(path) as temporary, open(temporary, "wb") as f:
        write(f)


class _Tokenizer:
    """The target's tokenizer, loaded on first use (token-id corpora never need it)."""

    def __init__(self, path: Path):
        self.path = path
        self._tokenizer = None
        self.name: str | None = None

    def encode(self, texts: list[str]) -> list[list[int]]:
        if self._tokenizer is None:
            try:
                from transformers import AutoTokenizer
            except ImportError:
                raise DrafterError(
                    "tokenizing text needs transformers (pip install 'woodcock[torch]')"
                ) from None
            try:
                self._tokenizer = AutoTokenizer.from_pretrained(
                    str(self.path), local_files_only=True
                )
            except (OSError, ValueError) as e:
                first = str(e).splitlines()[0] if str(e) else type(e).__name__
                raise DrafterError(f"{self.path}: no usable tokenizer ({first})") from None
            self.name = type(self._tokenizer).__name__
        return self._tokenizer(texts, add_special_tokens=False)["input_ids"]


def _segments(
    source: Path, glob: str, tokenizer: _Tokenizer
) -> Iterator[tuple[str, list[list[int]]]]:
    """(where, token-id lists of consecutive segments), in a reproducible order."""
    if source.is_dir():
        files = sorted(p for p in source.glob(glob) if p.is_file())
        if not files:
            raise DrafterError(f"{source}: no files match --glob {glob!r}")
        for file in files:
            texts = list(_text_segments(file))
            for start in range(0, len(texts), TEXT_BATCH):
                yield str(file), tokenizer.encode(texts[start : start + TEXT_BATCH])
    elif source.suffix == ".jsonl":
        yield from _jsonl_segments(source, tokenizer)
    else:
        raise DrafterError(f"{source}: expected a directory of text files or a .jsonl file")


def _text_segments(file: Path) -> Iterator[str]:
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DrafterError(f"{file}: cannot be read as UTF-8 text ({e})") from None
    segment: list[str] = []
    size = 0
    for line in text.splitlines(keepends=True):
        length = len(line.encode("utf-8"))
        if segment and size + length > SEGMENT_BYTES:
            yield "".join(segment)
            segment, size = [], 0
        segment.append(line)
        size += length
    if segment:
        yield "".join(segment)


def _jsonl_segments(file: Path, tokenizer: _Tokenizer) -> Iterator[tuple[str, list[list[int]]]]:
    for where, record in jsonl_records(file):
        key = None
        if isinstance(record, dict):
            key = next((k for k in ("input_ids", "token_ids", "text") if k in record), None)
            if key is None:
                raise DrafterError(f"{where}: expected input_ids, token_ids or text")
            record = record[key]
        if isinstance(record, str) and key in (None, "text"):
            yield where, tokenizer.encode([record])
        elif key != "text" and is_int_list(record):
            yield where, [record]
        elif key is None:
            raise DrafterError(f"{where}: expected a list of token ids or a text")
        else:
            wanted = "a string" if key == "text" else "a list of token ids"
            raise DrafterError(f"{where}: {key} must be {wanted}, found {type(record).__name__}")
