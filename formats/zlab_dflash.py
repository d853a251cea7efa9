"""z-lab DFlash (z-lab/dflash `dflash/model.py` `DFlashDraftModel`; the same files SpecForge
trains and exports for DFlash, e.g. its configs/qwen3-8b-dflash.json).

    config.json        a Qwen3 config plus architectures ["DFlashDraftModel"], auto_map
                       {"AutoModel": "dflash.DFlashDraftModel"}, block_size (top level; newer
                       checkpoints put it in dflash_config), num_target_layers and
                       dflash_config {mask_token_id, target_layer_ids}
    model.safetensors  fc.weight [H, A*H], hidden_norm.weight, norm.weight and layers.{i}.* with
                       q/k norms; no embedding and no LM head: both are the target's

Layer ids are "output of layer i" (the runtime reads Hugging Face hidden_states[i + 1]),
canonical i + 1. The id of the last target layer is refused: Hugging Face's last hidden state is
after the final norm, which no canonical id means. Drafting: one pass over [anchor, MASK x
(block_size - 1)], bidirectional in the block, slots 1.. predict their own positions
(sample_from_anchor false), over the target's full vocabulary (no draft-to-target map).

`auto_map` names the remote-code file dflash.py that z-lab's repositories ship; the writer does
not write that code (load with z-lab's `DFlashDraftModel.from_pretrained`, or add the file).
num_target_layers is required on write: `DFlashDraftModel.__init__` evaluates its default-taps
formula from it even when target_layer_ids is set (dict.get's default argument).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from woodcock.errors import DrafterError
from woodcock.formats import hf_block as block
from woodcock.formats import hf_config as hf
from woodcock.formats import specforge_dspark
from woodcock.ir import (
    DecoderLayer,
    DFlash,
    Drafter,
    DrafterSpec,
    DSpark,
    Head,
)

NAME = "zlab-dflash"
LAYER_CONVENTION = block.LAYER_CONVENTION
SIGNATURE = "config.json with dflash_config (DFlashDraftModel)"
ARCHITECTURE = "DFlashDraftModel"
AUTO_MAP = {"AutoModel": "dflash.DFlashDraftModel"}
TAPS_KEY = "dflash_config.target_layer_ids"
# The format always takes embedding and LM head from the target: `convert --target` records the
# target's facts but does not copy those in.
SHARES_HEAD = True

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
DFLASH_CONFIG_KEYS = {"mask_token_id", "target_layer_ids", "block_size"}


def matches(path: Path) -> bool:
    config = hf.config_or_none(path)
    if config is None or "speculators_model_type" in config:
        return False
    if specforge_dspark.is_dspark_config(config):
        return False
    return isinstance(config.get("dflash_config"), dict) or ARCHITECTURE in hf.architectures(config)


def stored_name(canonical: str) -> str:
    return canonical


def stored_taps(spec: DrafterSpec) -> list[int]:
    return hf.stored_taps(spec, LAYER_CONVENTION, hf_final_norm=True, fmt="z-lab DFlash")


# ---------------------------------------------------------------------------------------------
# read


def read(path: Path, *, taps: Sequence[int] | None = None) -> Drafter:
    """`taps` (canonical ids) supplies the taps when dflash_config does not record them."""
    return block.read(
        path,
        "z-lab DFlash",
        KNOWN,
        _read_own,
        taps=taps,
        taps_key=TAPS_KEY,
        head=Head(lm_head="shared", embedding="shared"),
    )


def _read_own(config: dict, layers: tuple[DecoderLayer, ...]) -> tuple[DFlash, list | None]:
    dflash = block.read_dflash_config(config, DFLASH_CONFIG_KEYS)
    block_size = config.get("block_size")
    if "block_size" in dflash:
        if block_size is not None and block_size != dflash["block_size"]:
            raise DrafterError(
                f"block_size = {block_size!r} disagrees with dflash_config.block_size"
                f" ({dflash['block_size']!r})"
            )
        block_size = dflash["block_size"]
    if block_size is None:
        raise DrafterError("missing key block_size")
    algorithm = DFlash(
        block_size=hf.integer(block_size, "block_size"),
        mask_token_id=hf.integer(
            hf.required(dflash, "mask_token_id", "dflash_config."), "mask_token_id"
        ),
        sample_from_anchor=False,
    )
    return algorithm, dflash.get("target_layer_ids")


# ---------------------------------------------------------------------------------------------
# write


def prepare(drafter: Drafter) -> hf.Output:
    """What `write` would write, or a DrafterError naming what z-lab DFlash cannot hold."""
    spec = drafter.spec
    algorithm = spec.algorithm
    if isinstance(algorithm, DSpark) or not isinstance(algorithm, DFlash):
        raise DrafterError(f"z-lab DFlash holds DFlash drafters only, not {algorithm.name}")
    problems = []
    if algorithm.sample_from_anchor:
        problems.append("sample_from_anchor (z-lab drafts from the mask slots only)")
    problems += block.shared_head_problems(drafter, "z-lab DFlash")
    problems += block.target_layers_problems(spec, "z-lab's DFlashDraftModel")
    return block.output(
        drafter,
        "z-lab DFlash",
        problems,
        {"architectures": [ARCHITECTURE], "auto_map": dict(AUTO_MAP)},
        lambda layer: {
            "dflash_config": {
                "mask_token_id": algorithm.mask_token_id,
                "target_layer_ids": stored_taps(spec),
            }
        },
    )


def write(drafter: Drafter, path: Path, *, force: bool = False) -> None:
    hf.write_output(prepare(drafter), Path(path), force=force)
