"""Fixtures shared by the speculators interop tests: the harness, tiny verifiers, drafters built
with speculators' own classes (cached per session) and verifier inputs."""

from __future__ import annotations

from pathlib import Path

import pytest
from speculators_variants import SEQ, VARIANTS, VERIFIERS


@pytest.fixture(scope="session")
def H():  # noqa: N802
    import speculators_harness

    return speculators_harness


@pytest.fixture(scope="session")
def torch():
    import torch

    return torch


@pytest.fixture(scope="session")
def verifiers(H, tmp_path_factory):  # noqa: N803
    root = tmp_path_factory.mktemp("verifiers")
    return {name: H.make_verifier(root / name, **kw) for name, kw in VERIFIERS.items()}


@pytest.fixture(scope="session")
def built(H, verifiers, tmp_path_factory):  # noqa: N803
    root = tmp_path_factory.mktemp("drafters")
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            cache[name] = H.build(name, root / name, verifiers[VARIANTS[name].verifier], seed=7)
        return cache[name]

    return get


@pytest.fixture(scope="session")
def inputs(H, verifiers):  # noqa: N803
    cache: dict = {}

    def get(verifier: str, layer_ids, seq_len: int = SEQ, seed: int = 3):
        key = (verifier, tuple(layer_ids), seq_len, seed)
        if key not in cache:
            cache[key] = H.make_inputs(verifiers[verifier], layer_ids, seq_len, seed)
        return cache[key]

    return get
