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
from woodcock.formats import hf_config as hf
from woodcock.ir import (
    DFlash,
    Drafter,
    DrafterSpec,
    DSpark,
    Head,
    error_prefix,
)

NAME = "zlab-dflash"
LAYER_CONVENTION = "layer_output"
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
    | hf.BLOCK_KEYS
    | {
        "auto_map",
        "block_size",
        "dflash_config",
        "num_target_layers",
    }
)
DFLASH_CONFIG_KEYS = {"mask_token_id", "target_layer_ids", "block_size"}


def matches(path: Path) -> bool:
    from woodcock.formats import specforge_dspark

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
    path = Path(path)
    config_path, config = hf.read_config(path)
    with error_prefix(f"{config_path}: "):
        hf.check_keys(config, KNOWN, "z-lab DFlash")
        dflash = read_dflash_config(config, DFLASH_CONFIG_KEYS)
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
        layers = hf.block_layers(config)
        target_layers = read_target_layers(config)
        tap_ids = hf.read_taps(
            dflash.get("target_layer_ids"),
            taps,
            LAYER_CONVENTION,
            TAPS_KEY,
            target_layers=target_layers,
            hf_final_norm=True,
        )
        vocab = hf.integer(config.get("vocab_size", hf.QWEN3_DEFAULTS["vocab_size"]), "vocab_size")
        algorithm = DFlash(
            block_size=hf.integer(block_size, "block_size"),
            mask_token_id=hf.integer(
                hf.required(dflash, "mask_token_id", "dflash_config."), "mask_token_id"
            ),
            sample_from_anchor=False,
        )
    tensors = hf.read_tensors(path)
    refuse_own_head(path, tensors, "z-lab DFlash")
    return hf.block_drafter(
        path,
        algorithm,
        layers,
        target_layers=target_layers,
        vocab=vocab,
        tap_ids=tap_ids,
        tensors=tensors,
        head=Head(lm_head="shared", embedding="shared"),
    )


def read_dflash_config(config: dict, known: set[str]) -> dict:
    dflash = hf.required(config, "dflash_config")
    if not isinstance(dflash, dict):
        raise DrafterError(f"dflash_config = {dflash!r}: expected an object")
    unknown = sorted(set(dflash) - known)
    if unknown:
        raise DrafterError(
            f"dflash_config: unknown key(s) {', '.join(unknown)} (they may change the math;"
            " refusing to guess)"
        )
    return dflash


def read_target_layers(config: dict) -> int | None:
    n = config.get("num_target_layers")
    return None if n is None else hf.integer(n, "num_target_layers")


def refuse_own_head(path: Path, tensors: dict, fmt: str) -> None:
    own = sorted({"embed_tokens.weight", "lm_head.weight"} & set(tensors))
    if own:
        raise DrafterError(
            f"{path}: {fmt} takes the embedding and LM head from the target, but the checkpoint"
            f" also stores {', '.join(own)} (an early preview?); refusing to guess which is meant"
        )


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
    problems += shared_head_problems(drafter, "z-lab DFlash")
    problems += target_layers_problems(spec, "z-lab's DFlashDraftModel")
    if problems:
        raise DrafterError("z-lab DFlash cannot hold " + "; ".join(problems))
    layer = hf.check_block(spec, "z-lab DFlash")
    config = {
        "architectures": [ARCHITECTURE],
        "auto_map": dict(AUTO_MAP),
        **hf.block_config(layer, spec),
        "block_size": algorithm.block_size,
        "dflash_config": {
            "mask_token_id": algorithm.mask_token_id,
            "target_layer_ids": stored_taps(spec),
        },
        **hf.torch_dtype(drafter),
    }
    tensors, sources = hf.output_tensors(drafter)
    return hf.Output(config, tensors, sources)


def write(drafter: Drafter, path: Path, *, force: bool = False) -> None:
    hf.write_output(prepare(drafter), Path(path), force=force)


def target_layers_problems(spec: DrafterSpec, runtime: str) -> list[str]:
    if spec.target.num_hidden_layers is not None:
        return []
    return [
        f"an unknown target layer count ({runtime} needs num_target_layers: it evaluates its"
        " default-taps formula even when target_layer_ids is set; pass --target)"
    ]


def shared_head_problems(drafter: Drafter, fmt: str) -> list[str]:
    """The formats that take embedding and LM head from the target: full vocabulary only."""
    spec, problems = drafter.spec, []
    if drafter.vocab.draft_to_target is not None:
        hint = " (--expand-vocab drops the map)" if spec.head.lm_head == "shared" else ""
        problems.append(
            f"a reduced draft vocabulary ({spec.draft_vocab_size} of {spec.target.vocab_size}"
            f" ids): {fmt} has no draft-to-target map{hint}"
        )
    own = [part for part in ("embedding", "lm_head") if getattr(spec.head, part) == "own"]
    if own:
        problems.append(f"the drafter's own {' and '.join(own)} ({fmt} always uses the target's)")
    return problems
