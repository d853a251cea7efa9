"""DeepSpec DSpark (deepseek-ai/DeepSpec `Qwen3DSparkModel`,
`deepspec/modeling/dspark/qwen3/{config,modeling}.py`, saved with `save_pretrained`).

    config.json        the target's Qwen3 config, copied, with architectures
                       ["Qwen3DSparkModel"] and flat keys num_target_layers, block_size,
                       layer_types, mask_token_id, target_layer_ids, num_anchors (training
                       only), enable_confidence_head, confidence_head_with_markov (read only with
                       the head), markov_rank, markov_head_type (read only with rank > 0),
                       tie_word_embeddings false
    model.safetensors  embed_tokens.weight [V, H] and lm_head.weight [V, H] (the target's,
                       copied and frozen), fc.weight, hidden_norm.weight, norm.weight,
                       layers.{i}.* (Qwen3 layers), markov_head.markov_w1.weight [V, r],
                       markov_head.markov_w2.weight [V, r] (plus gate_proj / joint_proj),
                       confidence_head.proj.{weight, bias}

Layer ids are "output of layer i" with -1 for the embedding output (`extract_context_feature`),
canonical i + 1. The last target layer is refused (DeepSpec refuses it too: Hugging Face's last
hidden state is after the final norm). The anchor is the first prediction slot
(sample_from_anchor true; `build_dspark_proposal` samples all block_size slots). The vocabulary
is the target's: no draft-to-target map. A DeepSpec "DFlash" is this model with markov_rank 0
and no confidence head, so it reads as a DSpark without heads.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from woodcock.converters.layer_ids import from_canonical
from woodcock.errors import DrafterError
from woodcock.formats import hf_block as block
from woodcock.formats import hf_config as hf
from woodcock.ir import (
    DecoderLayer,
    Drafter,
    DrafterSpec,
    DSpark,
    Head,
)

NAME = "deepspec-dspark"
LAYER_CONVENTION = block.LAYER_CONVENTION
SIGNATURE = "config.json with architectures Qwen3DSparkModel (flat target_layer_ids, markov_rank)"
ARCHITECTURE = "Qwen3DSparkModel"
NUM_ANCHORS = 512  # training only, but the model class requires the key; DeepSpec's value
DSPARK_KEYS = {
    "num_target_layers",
    "block_size",
    "mask_token_id",
    "target_layer_ids",
    "num_anchors",
    "enable_confidence_head",
    "confidence_head_with_markov",
    "markov_rank",
    "markov_head_type",
}
KNOWN = hf.INERT_KEYS | hf.LAYER_KEYS | block.BLOCK_KEYS | DSPARK_KEYS
TAPS_KEY = "target_layer_ids"


def matches(path: Path) -> bool:
    config = hf.config_or_none(path)
    if config is None or {"speculators_model_type", "dflash_config"} & set(config):
        return False
    return ARCHITECTURE in hf.architectures(config) or {"target_layer_ids", "markov_rank"} <= set(
        config
    )


def stored_name(canonical: str) -> str:
    return canonical


# ---------------------------------------------------------------------------------------------
# read


def read(path: Path, *, taps: Sequence[int] | None = None) -> Drafter:
    """`taps` (canonical ids) must agree with target_layer_ids when both are given."""
    return block.read(
        path,
        "DeepSpec DSpark",
        KNOWN,
        _read_own,
        taps=taps,
        taps_key=TAPS_KEY,
        head=Head(lm_head="own", embedding="own"),
    )


def _read_own(config: dict, layers: tuple[DecoderLayer, ...]) -> tuple[DSpark, list | None]:
    if config.get("tie_word_embeddings"):
        raise DrafterError(
            "tie_word_embeddings = true: DeepSpec stores lm_head and embed_tokens separately"
        )
    return _read_algorithm(config), config.get("target_layer_ids")


def _read_algorithm(config: dict) -> DSpark:
    rank = hf.integer(hf.required(config, "markov_rank"), "markov_rank")
    kind = "vanilla"  # inert without a Markov head
    if rank > 0:
        kind = hf.required(config, "markov_head_type")
        if not isinstance(kind, str):
            raise DrafterError(f"markov_head_type = {kind!r}: expected a string")
        kind = kind.lower()
    confidence = hf.boolean(hf.required(config, "enable_confidence_head"), "enable_confidence_head")
    with_markov = config.get("confidence_head_with_markov")
    if confidence:
        with_markov = hf.boolean(
            hf.required(config, "confidence_head_with_markov"), "confidence_head_with_markov"
        )
    elif with_markov is not None:
        with_markov = hf.boolean(with_markov, "confidence_head_with_markov")
    return DSpark(
        block_size=hf.integer(hf.required(config, "block_size"), "block_size"),
        mask_token_id=hf.integer(hf.required(config, "mask_token_id"), "mask_token_id"),
        sample_from_anchor=True,
        markov_head_type=kind,
        markov_rank=rank,
        confidence_head=confidence,
        confidence_head_with_markov=bool(with_markov),
    )


# ---------------------------------------------------------------------------------------------
# write


def prepare(drafter: Drafter) -> hf.Output:
    """What `write` would write, or a DrafterError naming what DeepSpec cannot hold."""
    spec = drafter.spec
    algorithm = spec.algorithm
    if not isinstance(algorithm, DSpark):
        raise DrafterError(f"DeepSpec DSpark holds DSpark drafters only, not {algorithm.name}")
    problems = []
    if not algorithm.sample_from_anchor:
        problems.append("sample_from_anchor = false (DeepSpec drafts from the anchor slot on)")
    if drafter.vocab.draft_to_target is not None:
        problems.append(
            f"a reduced draft vocabulary ({spec.draft_vocab_size} of {spec.target.vocab_size}"
            " ids): DeepSpec's LM head and Markov head cover the target's whole vocabulary"
        )
    shared = [part for part in ("embedding", "lm_head") if getattr(spec.head, part) == "shared"]
    if shared:
        problems.append(
            f"the {' and '.join(shared)} shared with the target (DeepSpec stores both; pass"
            " --target to copy them in)"
        )
    return block.output(
        drafter,
        "DeepSpec DSpark",
        problems,
        {"architectures": [ARCHITECTURE]},
        lambda layer: {
            "mask_token_id": algorithm.mask_token_id,
            "target_layer_ids": stored_taps(spec),
            "num_anchors": NUM_ANCHORS,
            "enable_confidence_head": algorithm.confidence_head,
            "confidence_head_with_markov": algorithm.confidence_head_with_markov,
            "markov_rank": algorithm.markov_rank,
            "markov_head_type": algorithm.markov_head_type,
        },
        notes=[f"num_anchors = {NUM_ANCHORS} is a training setting the model class requires"],
    )


def write(drafter: Drafter, path: Path, *, force: bool = False) -> None:
    hf.write_output(prepare(drafter), Path(path), force=force)


def stored_taps(spec: DrafterSpec) -> list[int]:
    """Canonical 0 (the embedding output) is DeepSpec's -1; the rest is output-of-layer."""
    ids = spec.taps.layer_ids
    hf.stored_taps(spec, "after_layers", hf_final_norm=True, fmt="DeepSpec DSpark")
    rest = list(from_canonical([i for i in ids if i > 0], LAYER_CONVENTION))
    return [-1] * (0 in ids) + rest
