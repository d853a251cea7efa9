"""Layer-id conventions, as data. Every format module declares the one it stores.

after_layers (canonical): id L = residual stream after L decoder layers (HF hidden_states[L]);
    vLLM, speculators, SafeAILab EAGLE, llama.cpp.
layer_output: id i = output of decoder layer i (0-based) = after_layers id i + 1;
    SGLang/SpecForge, z-lab DFlash, DeepSpec. It cannot name the embedding output (canonical 0).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from types import ModuleType

from woodcock.errors import DrafterError
from woodcock.ir import CANONICAL_LAYER_CONVENTION, Drafter, Taps, error_prefix

# canonical id = stored id + offset
OFFSETS = {CANONICAL_LAYER_CONVENTION: 0, "layer_output": 1}


def _offset(convention: str) -> int:
    try:
        return OFFSETS[convention]
    except KeyError:
        raise DrafterError(
            f"unknown layer-id convention {convention!r}; expected one of {', '.join(OFFSETS)}"
        ) from None


def to_canonical(ids: Sequence[int], convention: str) -> tuple[int, ...]:
    offset = _offset(convention)
    return tuple(i + offset for i in ids)


def from_canonical(ids: Sequence[int], convention: str) -> tuple[int, ...]:
    offset = _offset(convention)
    stored = tuple(i - offset for i in ids)
    if any(i < 0 for i in stored):
        raise DrafterError(
            f"taps {list(ids)}: the {convention} convention cannot name canonical id 0"
            " (the embedding output)"
        )
    return stored


def stored_ids(spec, fmt: ModuleType) -> list[int] | None:
    """A spec's taps as format module `fmt` stores them (None: it does not store them): the
    format's own `stored_taps` where it has one (DeepSpec names the embedding output -1), else
    its declared convention applied."""
    if hasattr(fmt, "stored_taps"):
        return fmt.stored_taps(spec)
    return list(from_canonical(spec.taps.layer_ids, fmt.LAYER_CONVENTION))


def retap(drafter: Drafter, layer_ids: Sequence[int]) -> Drafter:
    """The same weights reading other target layers (canonical ids): the fix for taps recorded
    in the wrong layer-id convention, which `woodcock doctor` finds. The weights fix how many."""
    recorded = drafter.spec.taps.layer_ids
    if len(layer_ids) != len(recorded):
        raise DrafterError(
            f"--retap {list(layer_ids)}: expected {len(recorded)} ids (the drafter's weights read"
            f" {len(recorded)} target layers, recorded as {list(recorded)})"
        )
    with error_prefix(f"--retap {list(layer_ids)}: "):
        spec = dataclasses.replace(drafter.spec, taps=Taps(tuple(layer_ids)))
    return Drafter(spec, drafter.vocab, drafter.weights)
