"""SpecForge / SGLang EAGLE-3 (sgl-project/SpecForge `LlamaForCausalLMEagle3`,
`specforge/modeling/draft/llama3_eagle.py`, exported by `specforge/export/to_sglang.py` and
`to_hf.py` with `save_pretrained`).

    config.json        a Llama config with architectures ["LlamaForCausalLMEagle3"], head_dim
                       (honoured), draft_vocab_size, optional target_hidden_size, optional
                       fc_norm (EAGLE-3.1 per-tap norms), optional
                       eagle_config.eagle_aux_hidden_state_layer_ids
    model.safetensors  the SafeAILab names: fc.weight, optional fc_norm.{0,1,2}.weight,
                       midlayer.* (canonical layers.0.*), norm.weight, lm_head.weight [Vd, H],
                       t2d [V] bool and d2t [Vd] int64 offsets (always; identity when Vd = V),
                       embed_tokens.weight in the Hugging Face export only (the SGLang export
                       drops it: the embedding is then the target's)

Layer ids are "output of layer i" (SGLang adds one when it captures), canonical i + 1; the
config records them only when eagle_config has them (SpecForge otherwise derives
[1, N//2 - 1, N - 4] from the target), so reading such a checkpoint needs --taps. The writer
always records them in eagle_config.

The runtime fixes one Llama layer (no q/k norm, no biases), three taps, an fc without bias, the
raw hidden state as residual and as fed-back state (its training loop feeds the backbone output
back). `norm_output` is refused when present: at SpecForge a6b6b02 `true` means plain EAGLE-3 (it
only normalises the logits) and `false` logits without the final norm, while SpecForge PR #879
gives `true` the EAGLE-3.1 meaning; the checkpoint does not record which version trained it.
RoPE: plain, linear or llama3 (SpecForge's own code, the same formulas as Hugging Face's).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from woodcock.errors import DrafterError
from woodcock.formats import hf_config as hf
from woodcock.ir import (
    Drafter,
    DrafterSpec,
    Eagle3,
    Fusion,
    Head,
    Taps,
    Weights,
    error_prefix,
)

NAME = "specforge"
LAYER_CONVENTION = "layer_output"
SIGNATURE = "config.json with architectures LlamaForCausalLMEagle3"
ARCHITECTURE = "LlamaForCausalLMEagle3"

RENAMES = (("midlayer.", "layers.0."),)
OUT_RENAMES = (("layers.0.", "midlayer."),)
TAPS_KEY = "eagle_config.eagle_aux_hidden_state_layer_ids"
ROPE_TYPES = ("linear", "llama3")
LLAMA3_KEYS = {
    "rope_type",
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
}
KNOWN = (
    hf.INERT_KEYS
    | hf.LAYER_KEYS
    | {
        "draft_vocab_size",
        "target_hidden_size",
        "fc_norm",
        "norm_output",
        "eagle_config",
        "mlp_bias",
        # copied from the target's config by SpecForge's own configs, read nowhere in it
        # (sgl-project/SpecForge@a6b6b02:configs/gemma3-1b-eagle3.json,
        # configs/qwen3-next-80b-a3b-eagle3.json); a dense Llama layer has no sparse steps
        "target_model_type",
        "decoder_sparse_step",
        # copied from a Qwen config; a Llama layer has no window
        "max_window_layers",
        "use_sliding_window",
        "sliding_window",
        "tie_word_embeddings",
    }
)


def matches(path: Path) -> bool:
    config = hf.config_or_none(path)
    return (
        config is not None
        and "speculators_model_type" not in config
        and ARCHITECTURE in hf.architectures(config)
    )


def stored_name(canonical: str) -> str:
    return hf.rename(canonical, OUT_RENAMES)


def stored_taps(spec: DrafterSpec) -> list[int]:
    return hf.stored_taps(spec, LAYER_CONVENTION)


# ---------------------------------------------------------------------------------------------
# read


def read(path: Path, *, taps: Sequence[int] | None = None) -> Drafter:
    """`taps` (canonical ids) supplies the taps when eagle_config does not record them."""
    path = Path(path)
    config_path, config = hf.read_config(path)
    with error_prefix(f"{config_path}: "):
        hf.check_keys(config, KNOWN, "SpecForge EAGLE-3")
        if "norm_output" in config:
            raise DrafterError(
                f"norm_output = {config['norm_output']!r}: SpecForge before PR #879 trained"
                " `true` as plain EAGLE-3 (raw hidden fed back, normalised logits) and `false`"
                " without the final norm on the logits; after it `true` means post-norm feedback"
                " (EAGLE-3.1). The checkpoint does not say which SpecForge trained it; refusing"
                " to guess (delete the key if it was trained as plain EAGLE-3)"
            )
        for key in ("attention_bias", "mlp_bias"):
            if config.get(key):
                raise DrafterError(f"{key} = true: SpecForge's EAGLE-3 layer has no biases")
        stored = _eagle_config_taps(config)
        tap_ids = hf.read_taps(stored, taps, LAYER_CONVENTION, TAPS_KEY)
        kwargs = hf.layer_kwargs(config, hf.LLAMA_DEFAULTS)
        theta, scaling = hf.read_rope(config, ROPE_TYPES)
        if scaling is not None and scaling["rope_type"] == "llama3" and set(scaling) != LLAMA3_KEYS:
            raise DrafterError(
                f"rope_scaling = {scaling!r}: SpecForge applies llama3 scaling only with all of"
                f" {', '.join(sorted(LLAMA3_KEYS - {'rope_type'}))}"
            )
        layers, target, draft_vocab = hf.one_layer_eagle3(config, kwargs, theta, scaling)
        fc_norm = hf.boolean(config.get("fc_norm", False), "fc_norm")
    tensors = hf.read_tensors(path, RENAMES)
    vocab = hf.vocab_from_offsets(path, tensors, draft_vocab, target.vocab_size)
    with error_prefix(f"{path}: "), hf.naming_defaulted_dimensions(config, hf.LLAMA_DEFAULTS):
        spec = DrafterSpec(
            algorithm=Eagle3(norm_before_residual=False, norm_output=False),
            target=target,
            taps=Taps(tap_ids),
            fusion=Fusion(
                tap_norm="per_tap" if fc_norm else "none", fc_bias=False, hidden_norm=False
            ),
            layers=layers,
            head=Head(
                lm_head="own",
                embedding="own" if "embed_tokens.weight" in tensors else "shared",
            ),
            draft_vocab_size=draft_vocab,
        )
        if len(spec.taps.layer_ids) != 3:
            raise DrafterError(f"{TAPS_KEY}: SpecForge EAGLE-3 fuses exactly three taps")
        return Drafter(spec, vocab, Weights(tensors))


def _eagle_config_taps(config: dict) -> list | None:
    eagle = config.get("eagle_config")
    if eagle is None:
        return None
    if not isinstance(eagle, dict):
        raise DrafterError(f"eagle_config = {eagle!r}: expected an object")
    unknown = sorted(set(eagle) - {"eagle_aux_hidden_state_layer_ids", "use_aux_hidden_state"})
    if unknown:
        raise DrafterError(f"eagle_config: unknown key(s) {', '.join(unknown)}")
    if eagle.get("use_aux_hidden_state", True) is not True:
        raise DrafterError("eagle_config.use_aux_hidden_state must be true for EAGLE-3")
    return eagle.get("eagle_aux_hidden_state_layer_ids")


# ---------------------------------------------------------------------------------------------
# write


def prepare(drafter: Drafter) -> hf.Output:
    """What `write` would write, or a DrafterError naming what SpecForge cannot hold."""
    spec = drafter.spec
    _check_representable(spec)
    layer = spec.layers[0]
    config = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        **hf.layer_config(layer, 1),
        "mlp_bias": False,
        "vocab_size": spec.target.vocab_size,
        "draft_vocab_size": spec.draft_vocab_size,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": stored_taps(spec)},
        **hf.torch_dtype(drafter),
    }
    if spec.target.hidden_size != spec.hidden_size:
        config["target_hidden_size"] = spec.target.hidden_size
    if spec.fusion.tap_norm == "per_tap":
        config["fc_norm"] = True
    tensors, sources = hf.output_tensors(drafter, OUT_RENAMES)
    # SpecForge always carries both buffers (identity when the vocabulary is full); the SGLang
    # exporter refuses a checkpoint without them.
    for name, array in hf.offsets_and_mask(drafter).items():
        tensors[name] = array
        sources[name] = "(vocabulary map)"
    notes = []
    if spec.fusion.tap_norm == "per_tap":
        # its load_weights copies only the names it has (sgl-project/sglang@03d5a77:
        # python/sglang/srt/models/llama_eagle3.py); PR #24663 added fc_norm and norm_output
        notes.append(
            "SGLang's LlamaForCausalLMEagle3 before sgl-project/sglang PR #24663 (May 2026) has"
            " no fc_norm: it skips fc_norm.* without an error and runs this drafter without its"
            " per-tap norms"
        )
    return hf.Output(config, tensors, sources, notes=notes)


def write(drafter: Drafter, path: Path, *, force: bool = False) -> None:
    hf.write_output(prepare(drafter), Path(path), force=force)


def _check_representable(spec: DrafterSpec) -> None:
    layer, problems = hf.one_layer_eagle3_problems(spec, "SpecForge")
    algorithm = spec.algorithm
    if layer.rope_scaling is not None and (
        layer.rope_scaling.get("rope_type") not in ROPE_TYPES
        or (layer.rope_scaling["rope_type"] == "llama3" and set(layer.rope_scaling) != LLAMA3_KEYS)
    ):
        problems.append(f"rope scaling {layer.rope_scaling!r}")
    if len(spec.taps.layer_ids) != 3:
        problems.append(f"{len(spec.taps.layer_ids)} taps (it fuses exactly three)")
    if algorithm.norm_before_residual:
        problems.append("norm_before_residual")
    if algorithm.norm_output:
        problems.append(
            "norm_output (post-norm feedback: SpecForge versions disagree on what norm_output"
            " means, so it cannot be recorded unambiguously)"
        )
    if spec.fusion.tap_norm == "concat":
        problems.append("one norm over the concatenated taps (only per-tap fc_norm)")
    if spec.fusion.fc_bias:
        problems.append("an fc bias")
    if spec.head.lm_head != "own":
        problems.append("a shared lm_head (SpecForge stores its own; pass --target to copy it in)")
    if problems:
        raise DrafterError("SpecForge EAGLE-3 cannot hold " + "; ".join(problems))
