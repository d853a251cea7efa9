"""What `woodcock inspect` reports about a drafter, as data first and text second."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from woodcock.converters.layer_ids import stored_ids
from woodcock.ir import Drafter, to_dict
from woodcock.loading import load_drafter_with_format, resolve_source


def drafter_warnings(drafter: Drafter) -> list[str]:
    """Legal but risky facts a user should know before running or converting the drafter."""
    spec, warnings = drafter.spec, []
    shared = [part for part in ("embedding", "lm_head") if getattr(spec.head, part) == "shared"]
    if shared and not spec.target.name_or_path:
        warnings.append(
            f"{' and '.join(shared)} shared with the target, but no target is named:"
            " pass --target when running or converting"
        )
    if spec.draft_vocab_size < spec.target.vocab_size and drafter.vocab.counts is None:
        warnings.append(
            "reduced draft vocabulary without token counts: re-truncating or reporting coverage"
            " needs a counts file"
        )
    for i, layer in enumerate(spec.layers):
        if (
            layer.sliding_window is not None
            and layer.sliding_window < layer.max_position_embeddings
        ):
            warnings.append(
                f"layers[{i}] attends only the last {layer.sliding_window} positions (sliding"
                " window); runtimes that ignore layer types will disagree on long contexts"
            )
    if spec.target.num_hidden_layers is None:
        warnings.append(
            "the format does not record the target's layer count: tap ids are unchecked until"
            " a target is given (--target)"
        )
    dtypes = drafter.weights.dtypes
    if len(dtypes) > 1:
        warnings.append(f"weights mix dtypes: {', '.join(f'{n} x{c}' for n, c in dtypes.items())}")
    return warnings


def describe(source: str, *, taps: Sequence[int] | None = None) -> dict[str, Any]:
    path = resolve_source(source)
    drafter, fmt = load_drafter_with_format(path, taps=taps)
    spec = drafter.spec
    ids = spec.taps.layer_ids
    vocab: dict[str, Any] = {
        "draft_vocab_size": spec.draft_vocab_size,
        "target_vocab_size": spec.target.vocab_size,
        "mapped": drafter.vocab.draft_to_target is not None,
        "counts": drafter.vocab.counts is not None,
    }
    if drafter.vocab.counts is not None:
        vocab["counts_info"] = drafter.vocab.counts.info
    return {
        "path": str(path),
        "format": fmt.NAME,
        "algorithm": to_dict(spec.algorithm),
        "target": to_dict(spec.target),
        "taps": {
            "canonical": {"convention": spec.taps.convention, "layer_ids": list(ids)},
            "stored": {
                "convention": fmt.LAYER_CONVENTION,
                "layer_ids": stored_ids(spec, fmt),  # None: the format does not store them
            },
        },
        "fusion": to_dict(spec.fusion),
        "layers": [to_dict(layer) for layer in spec.layers],
        "head": to_dict(spec.head),
        "vocab": vocab,
        "parameters": drafter.parameter_counts(),
        "dtypes": drafter.weights.dtypes,
        "warnings": drafter_warnings(drafter),
    }


def render_text(report: dict[str, Any]) -> str:
    algorithm = dict(report["algorithm"])
    name = algorithm.pop("name")
    target = report["target"]
    taps = report["taps"]
    fusion = report["fusion"]
    head = report["head"]
    vocab = report["vocab"]
    params = report["parameters"]
    tap_norm = {
        "none": "no tap norm",
        "per_tap": "per-tap RMSNorm",
        "concat": "RMSNorm over the concat",
    }
    rows = [
        ("path", report["path"]),
        ("format", report["format"]),
        ("algorithm", f"{name} ({_pairs(algorithm)})"),
        (
            "target",
            f"{target['name_or_path'] or '(unnamed)'}:"
            f" {target['num_hidden_layers'] or 'unknown number of'} layers,"
            f" hidden {target['hidden_size']}, vocab {target['vocab_size']}",
        ),
        (
            "taps",
            f"{_ids(taps['canonical'])} canonical; "
            + (
                f"stored as {_ids(taps['stored'])}"
                if taps["stored"]["layer_ids"] is not None
                else "the format does not store them"
            ),
        ),
        (
            "fusion",
            f"{tap_norm[fusion['tap_norm']]} -> fc{' with bias' if fusion['fc_bias'] else ''}"
            f"{' -> hidden_norm' if fusion['hidden_norm'] else ''}",
        ),
        *_layer_rows(report["layers"]),
        (
            "head",
            f"final norm -> lm_head {head['lm_head']}; embedding {head['embedding']}"
            " (shared = taken from the target)",
        ),
        (
            "vocab",
            f"{vocab['draft_vocab_size']} of {vocab['target_vocab_size']} target ids"
            + (" (mapped)" if vocab["mapped"] else " (identity)")
            + ("; token counts present" if vocab["counts"] else ""),
        ),
        ("parameters", f"{params['own']:,} own, {params['shared']:,} shared with the target"),
        ("dtype", ", ".join(f"{n} ({c} tensors)" for n, c in report["dtypes"].items())),
    ]
    warnings = report["warnings"] or ["none"]
    rows += [("warning" if w != "none" else "warnings", w) for w in warnings]
    width = max(len(key) for key, _ in rows)
    return "\n".join(f"{key:<{width}}  {value}" for key, value in rows)


def _pairs(values: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in values.items())


def _ids(taps: dict[str, Any]) -> str:
    return f"{taps['layer_ids']} ({taps['convention']})"


def _layer_rows(layers: list[dict[str, Any]]) -> list[tuple[str, str]]:
    rows = []
    for i, layer in enumerate(layers):
        window = f", window {layer['sliding_window']}" if layer["sliding_window"] else ""
        rope = f"rope theta {layer['rope_theta']:g}"
        if layer["rope_scaling"]:
            rope += f" {layer['rope_scaling'].get('rope_type')}"
        rows.append(
            (
                f"layer {i}",
                f"{layer['style']}, input {layer['input']}, {layer['attention']}{window};"
                f" hidden {layer['hidden_size']}, heads {layer['num_attention_heads']}/"
                f"{layer['num_key_value_heads']} x {layer['head_dim']},"
                f" mlp {layer['intermediate_size']},"
                f" {rope}, eps {layer['rms_norm_eps']:g}",
            )
        )
    return rows
