"""Bind a drafter to a concrete target: record its facts, and copy in the tensors it shares."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from woodcock.errors import DrafterError
from woodcock.ir import Drafter, Head, Target, error_prefix


def attach_target(drafter: Drafter, target: Target) -> Drafter:
    """Record the target's facts (layer count, name, architectures); the sizes the drafter was
    built for (and its layer count, where recorded) must match, and the tap ids are checked
    against the layer count."""
    spec = drafter.spec
    for field in ("hidden_size", "vocab_size", "num_hidden_layers"):
        mine, theirs = getattr(spec.target, field), getattr(target, field)
        if mine is not None and mine != theirs:
            raise DrafterError(
                f"target {target.name_or_path}: {field} = {theirs}, but the drafter was built"
                f" for {mine}"
            )
    with error_prefix(f"with target {target.name_or_path}: "):
        new_spec = dataclasses.replace(spec, target=target)
    return Drafter(new_spec, drafter.vocab, drafter.weights)


def fill_shared(drafter: Drafter, target_tensors: Mapping[str, np.ndarray]) -> Drafter:
    """Make the drafter self-contained: shared embedding and lm_head become its own copies of
    the target's (lm_head: the rows of the draft vocabulary), in the dtype of the drafter's
    final norm."""
    spec = drafter.spec
    weights = dict(drafter.weights)
    dtype = drafter.weights["norm.weight"].dtype
    expected = (spec.target.vocab_size, spec.hidden_size)
    for part, name in (("embedding", "embed_tokens.weight"), ("lm_head", "lm_head.weight")):
        if getattr(spec.head, part) != "shared":
            continue
        source = target_tensors[name]
        if source.shape != expected:
            raise DrafterError(f"target {name} is {list(source.shape)}, expected {list(expected)}")
        rows = source if part == "embedding" else source[drafter.vocab.target_ids(spec)]
        weights[name] = np.asarray(rows).astype(dtype)
    new_spec = dataclasses.replace(spec, head=Head(lm_head="own", embedding="own"))
    return Drafter(new_spec, drafter.vocab, weights)


def rename_target(drafter: Drafter, name_or_path: str) -> Drafter:
    """The same drafter, recording another name or path for its target."""
    spec = drafter.spec
    target = dataclasses.replace(spec.target, name_or_path=name_or_path)
    return Drafter(dataclasses.replace(spec, target=target), drafter.vocab, drafter.weights)
