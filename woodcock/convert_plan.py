"""`woodcock convert --dry-run`: what a conversion would write, checked the way the writer checks
it, with nothing written: format, algorithm, taps (canonical and as each side stores them),
files, and every output tensor with the source tensor it comes from, its shape and dtype."""

from __future__ import annotations

from types import ModuleType

import numpy as np

from woodcock.converters.layer_ids import stored_ids
from woodcock.errors import DrafterError
from woodcock.formats.hf_config import offsets_and_mask
from woodcock.ir import Drafter, to_dict
from woodcock.tensorfile import dtype_name


def output_notes(drafter: Drafter, writer: ModuleType) -> list[str]:
    """What the writer says of its output beside the files: what the format leaves to its
    loader, and where vLLM would refuse or run it otherwise (the speculators format)."""
    if hasattr(writer, "prepare"):
        return list(writer.prepare(drafter).notes)
    if writer.NAME == "speculators":
        return writer.vllm_notes(writer.speculators_config(drafter.spec))
    return []


def output_tensors(
    drafter: Drafter, writer: ModuleType
) -> tuple[dict[str, np.ndarray], dict[str, str], list[str]]:
    """(tensors by output name, output name -> canonical name or description, files) that
    `writer.write(drafter, ...)` would produce; raises its DrafterError when the format cannot
    hold the drafter."""
    if hasattr(writer, "prepare"):
        out = writer.prepare(drafter)
        return out.tensors, out.sources, list(out.files)
    tensors = dict(drafter.weights)
    sources = {name: name for name in tensors}
    ids = drafter.vocab.draft_to_target
    if writer.NAME == "woodcock":
        files = [writer.CONFIG, writer.WEIGHTS]
        if ids is not None:
            tensors[writer.VOCAB_TENSOR], sources[writer.VOCAB_TENSOR] = ids, "(vocabulary map)"
        if drafter.vocab.counts is not None:
            files += [writer.COUNTS_FILE, writer.COUNTS_INFO]
        return tensors, sources, [*files, writer.MANIFEST]
    if writer.NAME == "speculators":
        writer.speculators_config(drafter.spec)  # the writer's own checks
        if ids is not None:
            tensors |= offsets_and_mask(drafter)
            sources["d2t"] = sources["t2d"] = "(vocabulary map)"
        return tensors, sources, ["config.json", "model.safetensors"]
    raise DrafterError(f"--dry-run: no plan for format {writer.NAME!r}")


def stored_taps(drafter: Drafter, fmt: ModuleType) -> str:
    ids = stored_ids(drafter.spec, fmt)
    if ids is None:
        return "not stored"
    return f"{ids} ({fmt.LAYER_CONVENTION})"


def plan(
    source: str,
    original: Drafter,
    reader: ModuleType,
    drafter: Drafter,
    writer: ModuleType,
    dest: str,
) -> list[str]:
    """The dry-run report: `original` as read, `drafter` as it would be written."""
    tensors, sources, files = output_tensors(drafter, writer)
    spec = drafter.spec
    algorithm = to_dict(spec.algorithm)
    name = algorithm.pop("name")
    lines = [
        f"dry run: nothing written; {source} ({reader.NAME}) -> {dest} ({writer.NAME})",
        f"algorithm  {name} ({', '.join(f'{k}={v}' for k, v in algorithm.items())})",
        f"taps       canonical {list(spec.taps.layer_ids)} ({spec.taps.convention});"
        f" source stores {stored_taps(original, reader)};"
        f" output stores {stored_taps(drafter, writer)}",
        f"vocab      {spec.draft_vocab_size:,} of {spec.target.vocab_size:,} target ids"
        f" ({'mapped' if drafter.vocab.draft_to_target is not None else 'identity'})",
        f"files      {', '.join(files)}",
        f"tensors    {len(tensors)}",
    ]
    rows = []
    for out_name in sorted(tensors):
        array = tensors[out_name]
        rows.append(
            (
                out_name,
                _source(sources[out_name], original, reader, drafter),
                f"[{', '.join(str(d) for d in array.shape)}]",
                dtype_name(array),
            )
        )
    width = max(len(r[0]) for r in rows)
    source_width = max(len(r[1]) for r in rows)
    lines += [
        f"  {o:<{width}} <- {s:<{source_width}}  {shape} {dtype}" for o, s, shape, dtype in rows
    ]
    lines += [f"note       {note}" for note in output_notes(drafter, writer)]
    return lines


def _source(canonical: str, original: Drafter, reader: ModuleType, drafter: Drafter) -> str:
    if canonical.startswith("("):
        return canonical
    if canonical not in original.weights:
        return "(from --target)"
    name = reader.stored_name(canonical) if hasattr(reader, "stored_name") else canonical
    before, after = original.weights[canonical], drafter.weights[canonical]
    if before.shape != after.shape:
        return f"{name} (vocabulary rows)"
    if before.dtype != after.dtype:
        return f"{name} (cast from {dtype_name(before)})"
    return name
