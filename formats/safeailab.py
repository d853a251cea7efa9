"""SafeAILab EAGLE-3 (SafeAILab/EAGLE, `eagle/model/cnets.py` and `ea_model.py`).

    config.json                 a plain Llama config (`EConfig`) plus `draft_vocab_size`, and
                                `target_hidden_size` when the drafter is narrower than the target
    model.safetensors           (or pytorch_model.bin, which the runtime tries first)
        fc.weight [H, 3*Ht]     no bias
        midlayer.*              the one decoder layer (canonical `layers.0.*`): a free rename
        norm.weight, lm_head.weight [Vd, H]
        embed_tokens.weight     optional: without it the runtime loads the target's embedding
        d2t [Vd] int64 offsets, t2d [V] bool   when Vd < V (ignored by the runtime when Vd = V)

What the runtime fixes, so what this format can hold: exactly one Llama layer (no q/k norm, no
biases, head_dim = hidden_size / num_attention_heads, full attention), three taps with no tap
norm, the raw hidden state as residual and as fed-back state (norm_before_residual and
norm_output false), plain RoPE (rope_theta, default 10000) or linear scaling, which the runtime
always computes with base 10000.

Taps are not stored: the target model code captures the input of layers 2, N//2 and N-3 (after
2, N//2 and N-3 layers in canonical ids). Reading therefore needs --taps; writing refuses taps
that are not of that form. The chain length (speculative_tokens) is not stored either: the
reader takes the IR's default.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from woodcock.errors import DrafterError
from woodcock.formats import hf_config as hf
from woodcock.ir import (
    CANONICAL_LAYER_CONVENTION,
    Drafter,
    DrafterSpec,
    Eagle3,
    Fusion,
    Head,
    Taps,
    Weights,
    error_prefix,
)
from woodcock.tensorfile import read_torch_bin

NAME = "safeailab"
LAYER_CONVENTION = CANONICAL_LAYER_CONVENTION
SIGNATURE = "config.json with draft_vocab_size (plain Llama config, midlayer.* weights)"

BIN = "pytorch_model.bin"
RENAMES = (("midlayer.", "layers.0."),)
OUT_RENAMES = (("layers.0.", "midlayer."),)
VOCAB_KEYS = {"vocab_size", "draft_vocab_size", "target_hidden_size"}
# Read by the runtime but inert for EAGLE-3: `bias` (the EAGLE-3 fc never has one), the layer
# count (one midlayer whatever it says: copied base configs say 32 or 40) and the window keys.
INERT = {
    "bias",
    "num_hidden_layers",
    "tie_word_embeddings",
    "sliding_window",
    "use_sliding_window",
    "max_window_layers",
}
KNOWN = hf.INERT_KEYS | hf.LAYER_KEYS | VOCAB_KEYS | INERT | {"mlp_bias"}
FAMILY_ARCHITECTURES = {
    "LlamaForCausalLMEagle3",
    "DFlashDraftModel",
    "DSparkDraftModel",
    "Qwen3DSparkModel",
}


def matches(path: Path) -> bool:
    config = hf.config_or_none(path)
    if config is None or "draft_vocab_size" not in config:
        return False
    if {"speculators_model_type", "dflash_config", "markov_rank"} & set(config):
        return False
    return not FAMILY_ARCHITECTURES & set(hf.architectures(config))


def stored_name(canonical: str) -> str:
    return hf.rename(canonical, OUT_RENAMES)


def stored_taps(spec: DrafterSpec) -> None:
    """Not stored: the runtime's target code fixes them."""
    return None


# ---------------------------------------------------------------------------------------------
# read


def read(path: Path, *, taps: Sequence[int] | None = None) -> Drafter:
    """`taps` (canonical ids) is required: SafeAILab does not store them."""
    path = Path(path)
    config_path, config = hf.read_config(path)
    with error_prefix(f"{config_path}: "):
        hf.check_keys(config, KNOWN, "SafeAILab EAGLE-3")
        if taps is None:
            raise DrafterError(
                "SafeAILab EAGLE-3 does not store its taps (its target code captures the input"
                " of layers 2, N//2 and N-3); pass --taps, e.g. 2,18,33 for a 36-layer target"
            )
        kwargs = hf.layer_kwargs(config, hf.LLAMA_DEFAULTS)
        heads, hidden = kwargs["num_attention_heads"], kwargs["hidden_size"]
        if "head_dim" in config and config["head_dim"] != hidden // heads:
            raise DrafterError(
                f"head_dim = {config['head_dim']!r}: SafeAILab ignores it and uses hidden_size /"
                f" num_attention_heads = {hidden // heads} (a SpecForge checkpoint?)"
            )
        for key in ("attention_bias", "mlp_bias"):
            if config.get(key):
                raise DrafterError(f"{key} = true: SafeAILab's layer has no biases")
        theta, scaling = _read_rope(config)
        layers, target, draft_vocab = hf.one_layer_eagle3(config, kwargs, theta, scaling)
    tensors = _read_weights(path)
    vocab = hf.vocab_from_offsets(path, tensors, draft_vocab, target.vocab_size)
    has_embedding = "embed_tokens.weight" in tensors
    if config.get("target_hidden_size") is not None and not has_embedding:
        raise DrafterError(
            f"{path}: target_hidden_size is set, so SafeAILab uses the checkpoint's own"
            " embed_tokens.weight, which is missing (the runtime would leave it random)"
        )
    with error_prefix(f"{path}: "), hf.naming_defaulted_dimensions(config, hf.LLAMA_DEFAULTS):
        spec = DrafterSpec(
            algorithm=Eagle3(norm_before_residual=False, norm_output=False),
            target=target,
            taps=Taps(tuple(taps)),
            fusion=Fusion(tap_norm="none", fc_bias=False, hidden_norm=False),
            layers=layers,
            head=Head(lm_head="own", embedding="own" if has_embedding else "shared"),
            draft_vocab_size=draft_vocab,
        )
        return Drafter(spec, vocab, Weights(tensors))


def _read_rope(config: dict) -> tuple[float, dict | None]:
    scaling = config.get("rope_scaling")
    if "rope_parameters" in config:
        raise DrafterError(
            "rope_parameters: SafeAILab reads rope_theta and rope_scaling only (transformers 4)"
        )
    if scaling is None:
        return hf.read_rope(config, allowed=())
    if not isinstance(scaling, dict) or set(scaling) != {"type", "factor"}:
        raise DrafterError(
            f"rope_scaling = {scaling!r}: SafeAILab expects {{'type': ..., 'factor': ...}}"
        )
    factor = scaling["factor"]
    if scaling["type"] != "linear" or not isinstance(factor, float) or factor <= 1.0:
        raise DrafterError(
            f"rope_scaling = {scaling!r}: only linear scaling with a float factor > 1 is"
            " supported (SafeAILab's dynamic scaling is its own NTK variant)"
        )
    # With scaling, SafeAILab builds its rotary embedding without rope_theta: base 10000.
    return hf.DEFAULT_ROPE_THETA, {"rope_type": "linear", "factor": factor}


def _read_weights(path: Path) -> dict[str, np.ndarray]:
    if (path / BIN).is_file():  # the runtime tries pytorch_model.bin first
        return {hf.rename(k, RENAMES): v for k, v in read_torch_bin(path / BIN).items()}
    return hf.read_tensors(path, RENAMES)


# ---------------------------------------------------------------------------------------------
# write


def prepare(drafter: Drafter) -> hf.Output:
    """What `write` would write, or a DrafterError naming what SafeAILab cannot hold."""
    spec = drafter.spec
    _check_representable(spec)
    layer = spec.layers[0]
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **hf.layer_config(layer, 1),
        "vocab_size": spec.target.vocab_size,
        "draft_vocab_size": spec.draft_vocab_size,
        **hf.torch_dtype(drafter),
    }
    for key in ("head_dim", "attention_bias", "attention_dropout"):
        config.pop(key)  # SafeAILab has no such settings; head_dim is hidden / heads
    if layer.rope_scaling is None:
        config["rope_scaling"] = None
    else:
        config.pop("rope_theta")  # ignored with scaling: the base is always 10000
        config["rope_scaling"] = {"type": "linear", "factor": float(layer.rope_scaling["factor"])}
    if spec.target.hidden_size != spec.hidden_size:
        config["target_hidden_size"] = spec.target.hidden_size
    tensors, sources = hf.output_tensors(drafter, OUT_RENAMES)
    if drafter.vocab.draft_to_target is not None:
        for name, array in hf.offsets_and_mask(drafter).items():
            tensors[name] = array
            sources[name] = "(vocabulary map)"
    return hf.Output(
        config,
        tensors,
        sources,
        notes=[
            "taps are not stored: SafeAILab's target code captures layers 2, N//2 and N-3",
        ],
    )


def write(drafter: Drafter, path: Path, *, force: bool = False) -> None:
    hf.write_output(prepare(drafter), Path(path), force=force)


def _check_representable(spec: DrafterSpec) -> None:
    layer, problems = hf.one_layer_eagle3_problems(spec, "SafeAILab")
    algorithm = spec.algorithm
    if layer.head_dim * layer.num_attention_heads != layer.hidden_size:
        problems.append(
            f"head_dim {layer.head_dim} (SafeAILab uses hidden_size / num_attention_heads ="
            f" {layer.hidden_size // layer.num_attention_heads})"
        )
    if layer.rope_scaling is not None and (
        layer.rope_scaling.get("rope_type") != "linear"
        or set(layer.rope_scaling) != {"rope_type", "factor"}
        or layer.rope_theta != hf.DEFAULT_ROPE_THETA
        or float(layer.rope_scaling["factor"]) <= 1.0
    ):
        problems.append(
            f"rope scaling {layer.rope_scaling!r} with theta {layer.rope_theta:g} (only linear"
            " scaling with base 10000 is possible)"
        )
    if algorithm.norm_before_residual:
        problems.append("norm_before_residual")
    if algorithm.norm_output:
        problems.append("norm_output (post-norm feedback)")
    if spec.fusion.tap_norm != "none":
        problems.append(f"tap norm {spec.fusion.tap_norm!r}")
    if spec.fusion.fc_bias:
        problems.append("an fc bias")
    if spec.head.lm_head != "own":
        problems.append("a shared lm_head (SafeAILab stores its own; pass --target to copy it in)")
    if problems:
        raise DrafterError("SafeAILab EAGLE-3 cannot hold " + "; ".join(problems))
    _check_taps(spec)


def _check_taps(spec: DrafterSpec) -> None:
    ids = spec.taps.layer_ids
    n = spec.target.num_hidden_layers
    implied = ids[-1] + 3 if n is None else n
    expected = tuple(sorted({2, implied // 2, implied - 3}))
    if ids != expected or len(ids) != 3:
        where = f"N = {n}" if n is not None else f"N = {implied} implied by the last tap"
        raise DrafterError(
            f"taps {list(ids)}: SafeAILab's target code always captures ids (2, N//2, N-3) ="
            f" {list(expected)} ({where}); it cannot hold other taps"
        )
