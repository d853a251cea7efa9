"""SpecForge / SGLang DSpark (sgl-project/SpecForge `DSparkDraftModel`,
`specforge/modeling/draft/dspark.py` on the DFlash backbone of `dflash.py`; e.g.
configs/qwen3-8b-dspark.json).

    config.json        the z-lab DFlash layout (a Qwen3 config, block_size, num_target_layers)
                       with architectures ["DSparkDraftModel"], auto_map
                       {"AutoModel": "dspark.DSparkDraftModel"} and dflash_config
                       {attention_mode, mask_token_id, target_layer_ids, projector_type "dspark",
                       markov_rank, markov_head_type, confidence_head_alpha,
                       enable_confidence_head, confidence_head_with_markov}
    model.safetensors  the DFlash tensors plus markov_head.markov_w1.weight [V, r],
                       markov_head.markov_w2.weight [V, r], gate_proj / joint_proj for the gated
                       / rnn heads, confidence_head.proj.{weight, bias}; legacy `logit_head.`
                       prefixes are read as SpecForge remaps them. No embedding, no LM head.

Layer ids are "output of layer i", canonical i + 1 (the last target layer is refused, as for
z-lab). Keys SpecForge reads with a default take it (markov_rank 0, markov_head_type vanilla,
enable_confidence_head = confidence_head_alpha > 0, confidence_head_with_markov false). The
vocabulary is the target's: the Markov head and the LM head cover all of it.

The anchor is the first prediction slot (sample_from_anchor true): SpecForge trains slot k of a
block on the token k + 1 after the anchor, with the anchor as the first Markov previous token
(`OnlineDSparkModel._build_dspark_labels_and_mask` and `forward`, SpecForge a6b6b02). Its
`spec_generate` helper samples the last block_size - 1 slots instead, which does not match its
own training; this format follows the training.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from woodcock.errors import DrafterError
from woodcock.formats import hf_block as block
from woodcock.formats import hf_config as hf
from woodcock.ir import (
    DecoderLayer,
    Drafter,
    DrafterSpec,
    DSpark,
    Head,
    error_prefix,
)

NAME = "specforge-dspark"
LAYER_CONVENTION = block.LAYER_CONVENTION
SIGNATURE = "config.json with dflash_config.projector_type dspark (DSparkDraftModel)"
ARCHITECTURE = "DSparkDraftModel"
AUTO_MAP = {"AutoModel": "dspark.DSparkDraftModel"}
TAPS_KEY = "dflash_config.target_layer_ids"
# The format always takes embedding and LM head from the target: `convert --target` records the
# target's facts but does not copy those in.
SHARES_HEAD = True
LEGACY_RENAMES = (
    ("logit_head.markov_head.", "markov_head."),
    ("logit_head.confidence_head.", "confidence_head."),
)
KNOWN = (
    hf.INERT_KEYS
    | hf.LAYER_KEYS
    | block.BLOCK_KEYS
    | set(block.COPIED_SIZES)
    | {
        "auto_map",
        "block_size",
        "dflash_config",
        "num_target_layers",
    }
)
DSPARK_CONFIG_KEYS = {
    "attention_mode",
    "mask_token_id",
    "target_layer_ids",
    "projector_type",
    "markov_rank",
    "markov_head_type",
    "confidence_head_alpha",
    "enable_confidence_head",
    "confidence_head_with_markov",
}


def is_dspark_config(config: dict) -> bool:
    dflash = config.get("dflash_config")
    if not isinstance(dflash, dict):
        return False
    return dflash.get("projector_type") == "dspark" or ARCHITECTURE in hf.architectures(config)


def matches(path: Path) -> bool:
    config = hf.config_or_none(path)
    return (
        config is not None and "speculators_model_type" not in config and is_dspark_config(config)
    )


def stored_name(canonical: str) -> str:
    return canonical


def stored_taps(spec: DrafterSpec) -> list[int]:
    return hf.stored_taps(spec, LAYER_CONVENTION, hf_final_norm=True, fmt="SpecForge DSpark")


# ---------------------------------------------------------------------------------------------
# read


def read(path: Path, *, taps: Sequence[int] | None = None) -> Drafter:
    """`taps` (canonical ids) supplies the taps when dflash_config does not record them."""
    return block.read(
        path,
        "SpecForge DSpark",
        KNOWN,
        _read_own,
        taps=taps,
        taps_key=TAPS_KEY,
        head=Head(lm_head="shared", embedding="shared"),
        renames=LEGACY_RENAMES,
    )


def _read_own(config: dict, layers: tuple[DecoderLayer, ...]) -> tuple[DSpark, list | None]:
    dspark = block.read_dflash_config(config, DSPARK_CONFIG_KEYS)
    projector = dspark.get("projector_type", "dspark")
    if projector != "dspark":
        raise DrafterError(f"dflash_config.projector_type = {projector!r}: expected 'dspark'")
    _check_attention_mode(dspark, layers[0])
    return _read_algorithm(config, dspark), dspark.get("target_layer_ids")


def _read_algorithm(config: dict, dspark: dict) -> DSpark:
    rank = hf.integer(dspark.get("markov_rank", 0) or 0, "dflash_config.markov_rank")
    kind = dspark.get("markov_head_type", "vanilla")
    if not isinstance(kind, str):
        raise DrafterError(f"dflash_config.markov_head_type = {kind!r}: expected a string")
    alpha = dspark.get("confidence_head_alpha", 0.0) or 0.0
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        raise DrafterError(f"dflash_config.confidence_head_alpha = {alpha!r}: expected a number")
    confidence = hf.boolean(
        dspark.get("enable_confidence_head", alpha > 0.0), "dflash_config.enable_confidence_head"
    )
    with_markov = hf.boolean(
        dspark.get("confidence_head_with_markov", False),
        "dflash_config.confidence_head_with_markov",
    )
    if with_markov and rank == 0:
        raise DrafterError(
            "dflash_config.confidence_head_with_markov = true requires markov_rank > 0"
        )
    block_size = hf.integer(hf.required(config, "block_size"), "block_size")
    with error_prefix("dflash_config."):
        return DSpark(
            block_size=block_size,
            mask_token_id=hf.integer(hf.required(dspark, "mask_token_id"), "mask_token_id"),
            sample_from_anchor=True,
            markov_head_type=kind.lower(),
            markov_rank=rank,
            confidence_head=confidence,
            confidence_head_with_markov=with_markov,
        )


def _check_attention_mode(dspark: dict, layer) -> None:
    mode = str(dspark.get("attention_mode", "gqa")).lower()
    heads, kv = layer.num_attention_heads, layer.num_key_value_heads
    if mode not in ("gqa", "mha"):
        raise DrafterError(f"dflash_config.attention_mode = {mode!r}: expected 'gqa' or 'mha'")
    if (mode == "gqa") != (kv < heads):
        raise DrafterError(
            f"dflash_config.attention_mode = {mode!r} with {heads} heads and {kv} kv heads:"
            " SpecForge requires gqa for fewer kv heads and mha for as many"
        )


# ---------------------------------------------------------------------------------------------
# write


def prepare(drafter: Drafter) -> hf.Output:
    """What `write` would write, or a DrafterError naming what SpecForge DSpark cannot hold."""
    spec = drafter.spec
    algorithm = spec.algorithm
    if not isinstance(algorithm, DSpark):
        raise DrafterError(f"SpecForge DSpark holds DSpark drafters only, not {algorithm.name}")
    problems = []
    if not algorithm.sample_from_anchor:
        problems.append("sample_from_anchor = false (SpecForge trains the anchor-first layout)")
    problems += block.shared_head_problems(drafter, "SpecForge DSpark")
    problems += block.target_layers_problems(spec, "SpecForge's DFlashDraftModel")
    rank = algorithm.markov_rank

    def dflash_config(layer: DecoderLayer) -> dict:
        return {
            "dflash_config": {
                "attention_mode": "gqa"
                if layer.num_key_value_heads < layer.num_attention_heads
                else "mha",
                "mask_token_id": algorithm.mask_token_id,
                "target_layer_ids": stored_taps(spec),
                "projector_type": "dspark",
                "markov_rank": rank,
                "markov_head_type": algorithm.markov_head_type,
                "confidence_head_alpha": 1.0 if algorithm.confidence_head else 0.0,
                "enable_confidence_head": algorithm.confidence_head,
                # SpecForge refuses the flag without a Markov head even when the confidence head
                # is off (where it is inert)
                "confidence_head_with_markov": algorithm.confidence_head_with_markov and rank > 0,
            }
        }

    return block.output(
        drafter,
        "SpecForge DSpark",
        problems,
        {"architectures": [ARCHITECTURE], "auto_map": dict(AUTO_MAP)},
        dflash_config,
    )


def write(drafter: Drafter, path: Path, *, force: bool = False) -> None:
    hf.write_output(prepare(drafter), Path(path), force=force)
