"""`woodcock convert` as a library function: read a drafter in any format, apply the converters
the options ask for (the target's facts and shared tensors, the vocabulary, the dtype, the
target's recorded name), then write it in another format, or say what would be written."""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from woodcock.convert_plan import output_notes
from woodcock.convert_plan import plan as dry_run_plan
from woodcock.converters import layer_ids
from woodcock.converters.dtype import cast
from woodcock.converters.target_binding import attach_target, fill_shared, rename_target
from woodcock.converters.vocab import apply_options
from woodcock.formats.detect import format_named
from woodcock.ir import Drafter
from woodcock.loading import load_drafter, load_drafter_with_format, resolve_source
from woodcock.staging import check, checks_in_background, refuse_replacing_inputs
from woodcock.target_checkpoint import load_target_tensors, target_from_config


@dataclass(frozen=True)
class Conversion:
    source: str
    dest: str
    reader: str  # format names
    writer: str
    drafter: Drafter  # as written (or as it would be)
    vocab_line: str | None  # what --truncate-vocab / --expand-vocab / --counts did
    plan: list[str] | None  # dry run: the lines of the plan; nothing was written
    unkept: tuple[str, ...] = ()  # facts of the drafter the output format does not keep
    notes: tuple[str, ...] = ()  # what the writer says of its output (convert_plan.output_notes)

    def summary(self) -> str:
        if self.plan is not None:
            lines = list(self.plan)
        else:
            spec = self.drafter.spec
            lines = [
                f"{self.source} ({self.reader}) -> {self.dest} ({self.writer}):"
                f" {spec.algorithm.name}, {len(self.drafter.weights)} tensors,"
                f" {self.drafter.parameter_counts()['own']:,} parameters"
            ]
        lines += [f"note: {note}" for note in self.notes]
        if self.unkept:
            lines.append(
                f"not kept by {self.writer} (the output reads back without them):"
                f" {', '.join(self.unkept)}"
            )
        return "\n".join(lines + ([self.vocab_line] if self.vocab_line else []))


def convert(
    source: str,
    dest: str | Path,
    *,
    to: str,
    source_format: str | None = None,
    target: str | None = None,
    dtype: str | None = None,
    taps: Sequence[int] | None = None,
    retap: Sequence[int] | None = None,
    truncate_vocab: int | None = None,
    counts: str | None = None,
    expand_vocab: bool = False,
    target_name: str | None = None,
    dry_run: bool = False,
    force: bool = False,
) -> Conversion:
    """Tensors are copied bit for bit where no option changes them; a format that cannot hold
    the drafter raises a DrafterError saying why. A native source's sha256s are checked while
    the output is written, and the output is renamed into place only once they pass."""
    writer = format_named(to)
    source_path = resolve_source(source)
    refuse_replacing_inputs(
        Path(dest), {"source drafter": source_path, "target": target, "counts file": counts}
    )
    with checks_in_background():
        drafter, reader = load_drafter_with_format(source_path, source_format, taps=taps)
        original = drafter
        check(lambda: original.weights.refuse_non_finite(str(source_path)))
        if retap is not None:
            drafter = layer_ids.retap(drafter, retap)
        if target is not None:
            drafter = attach_target(drafter, target_from_config(target))
            if not getattr(writer, "SHARES_HEAD", False):  # formats that always use the target's
                drafter = fill_shared(drafter, load_target_tensors(target))
        drafter, vocab_line = apply_options(drafter, truncate_vocab, counts, expand_vocab)
        if dtype is not None:
            drafter = cast(drafter, dtype)
        if target_name is not None:
            drafter = rename_target(drafter, target_name)
        plan = None
        if dry_run:
            plan = dry_run_plan(source, original, reader, drafter, writer, dest)
        elif reader.NAME == writer.NAME == "woodcock":  # keep how the drafter was made
            provenance = reader.read_provenance(source_path)
            writer.write(drafter, Path(dest), force=force, provenance=provenance)
        else:
            writer.write(drafter, Path(dest), force=force)
    unkept: tuple[str, ...] = ()
    if writer.NAME != "woodcock":  # the native format keeps everything
        unkept = _unkept(drafter, writer, None if dry_run else Path(dest))
    notes = () if dry_run else tuple(output_notes(drafter, writer))  # a plan lists them
    return Conversion(
        str(source), str(dest), reader.NAME, writer.NAME, drafter, vocab_line, plan, unkept, notes
    )


def _unkept(drafter: Drafter, writer, dest: Path | None) -> tuple[str, ...]:
    """unkept_facts of the output at `dest`; for a dry run (dest None), of a copy written to a
    scratch directory and removed at once: what a writer keeps is known only by writing."""
    taps = drafter.spec.taps.layer_ids
    if dest is not None:
        return unkept_facts(drafter, load_drafter(dest, writer.NAME, taps=taps))
    with tempfile.TemporaryDirectory(prefix="woodcock-dry-run-") as scratch:
        trial = Path(scratch) / "drafter"
        writer.write(drafter, trial)
        return unkept_facts(drafter, load_drafter(trial, writer.NAME, taps=taps))


def unkept_facts(drafter: Drafter, written: Drafter) -> tuple[str, ...]:
    """What of `drafter` its output, read back as `written`, lost: facts beside the weights and
    the math (those a format cannot hold are refused when it is written)."""
    lost = []
    if drafter.vocab.counts is not None and written.vocab.counts is None:
        lost.append("token counts (PATH@N truncation needs a counts file then)")
    mine, theirs = drafter.spec.target, written.spec.target
    for field, what in (
        ("num_hidden_layers", "the target's layer count"),
        ("name_or_path", "the target's name"),
        ("architectures", "the target's architectures"),
    ):
        if getattr(mine, field) and not getattr(theirs, field):
            lost.append(what)
    tokens = getattr(drafter.spec.algorithm, "speculative_tokens", None)
    read_back = getattr(written.spec.algorithm, "speculative_tokens", None)
    if tokens != read_back:
        lost.append(f"speculative_tokens {tokens} (read back as {read_back})")
    return tuple(lost)
