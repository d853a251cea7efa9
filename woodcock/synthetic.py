"""Random drafters of any spec: for tests, parity checks and conversion benchmarks."""

from __future__ import annotations

import numpy as np

from woodcock.errors import DrafterError
from woodcock.ir import (
    DecoderLayer,
    DFlash,
    Drafter,
    DrafterSpec,
    DSpark,
    Eagle3,
    Fusion,
    Head,
    Taps,
    Target,
    VocabMap,
)
from woodcock.tensorfile import DTYPES


def random_weights(spec: DrafterSpec, dtype: str = "F32", seed: int = 0) -> dict[str, np.ndarray]:
    """Normal(0, 0.02) matrices and norm weights near 1 (not exactly 1, so that a norm applied
    twice or not at all changes the output)."""
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in spec.tensor_shapes().items():
        if name.endswith("norm.weight"):
            values = 1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)
        else:
            values = 0.02 * rng.standard_normal(shape, dtype=np.float32)
        weights[name] = values.astype(DTYPES[dtype])
    return weights


def random_vocab_map(spec: DrafterSpec, seed: int = 0) -> VocabMap:
    vocab, draft_vocab = spec.target.vocab_size, spec.draft_vocab_size
    if draft_vocab == vocab:
        return VocabMap()
    rng = np.random.default_rng(seed)
    return VocabMap(np.sort(rng.choice(vocab, size=draft_vocab, replace=False)).astype(np.int64))


def random_drafter(spec: DrafterSpec, dtype: str = "F32", seed: int = 0) -> Drafter:
    if not isinstance(spec, DrafterSpec):
        raise DrafterError(f"spec = {spec!r:.80}: expected a DrafterSpec (tiny_spec() makes one)")
    if dtype not in DTYPES:
        raise DrafterError(f"dtype = {dtype!r}: expected one of {', '.join(DTYPES)}")
    return Drafter(spec, random_vocab_map(spec, seed), random_weights(spec, dtype, seed))


def tiny_spec(
    algorithm: str = "eagle3",
    *,
    num_layers: int = 1,
    style: str = "llama",
    hidden_size: int = 32,
    vocab_size: int = 96,
    draft_vocab_size: int | None = None,
    target_layers: int = 4,
    taps: tuple[int, ...] | None = None,
    tap_norm: str = "none",
    **algorithm_fields,
) -> DrafterSpec:
    """A small valid spec of any algorithm; keyword arguments not named here go to the
    algorithm block (e.g. norm_output=True, block_size=4, markov_head_type="rnn"). `taps`
    defaults to a low, a middle and a high layer, as EAGLE-3 reads them."""
    block = algorithm != "eagle3"
    layers = tuple(
        DecoderLayer(
            style=style,
            input="embed_and_hidden" if not block and i == 0 else "hidden",
            attention="block_bidirectional" if block else "causal",
            sliding_window=None,
            hidden_size=hidden_size,
            intermediate_size=2 * hidden_size,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=hidden_size // 4,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            rope_scaling=None,
            max_position_embeddings=256,
        )
        for i in range(num_layers)
    )
    if algorithm == "eagle3":
        fields = {"norm_before_residual": False, "norm_output": False} | algorithm_fields
        algo = Eagle3(**fields)
    elif algorithm == "dflash":
        fields = {"block_size": 4, "mask_token_id": vocab_size - 1, "sample_from_anchor": False}
        algo = DFlash(**(fields | algorithm_fields))
    elif algorithm == "dspark":
        fields = {
            "block_size": 4,
            "mask_token_id": vocab_size - 1,
            "sample_from_anchor": True,
            "markov_head_type": "vanilla",
            "markov_rank": 8,
            "confidence_head": True,
            "confidence_head_with_markov": True,
        }
        algo = DSpark(**(fields | algorithm_fields))
    else:
        raise ValueError(f"unknown algorithm {algorithm!r}")
    return DrafterSpec(
        algorithm=algo,
        target=Target(
            num_hidden_layers=target_layers,
            hidden_size=hidden_size,
            vocab_size=vocab_size,
            name_or_path="tiny-random-target",
        ),
        taps=Taps((1, target_layers // 2, target_layers - 1) if taps is None else taps),
        fusion=Fusion(tap_norm=tap_norm, fc_bias=False, hidden_norm=block),
        layers=layers,
        # a reduced vocabulary comes with its own head rows (what vLLM needs)
        head=Head(
            lm_head="shared" if block and not draft_vocab_size else "own", embedding="shared"
        ),
        draft_vocab_size=draft_vocab_size or vocab_size,
    )
