"""The speculators / vLLM format (vllm-project/speculators 0.9.0): EAGLE-3, DFlash and DSpark.

    config.json        speculators_model_type, speculators_config (proposal, verifier),
                       transformer_layer_config (a Hugging Face llama/qwen3 config of the draft
                       layers), draft_vocab_size and the algorithm's keys
    model.safetensors  canonical tensor names (the IR's), plus `d2t` (int64 [Vd], offsets:
                       target id = i + d2t[i]) and `t2d` (bool [V]) when the vocabulary is reduced

Layer ids count the residual stream after L layers, as the IR does. Not stored: the target's
layer count; embed_tokens (EAGLE-3 optional, DFlash/DSpark never) and, for full-vocabulary
DFlash/DSpark, lm_head: those are "shared" in the IR. Keys missing from transformer_layer_config
take the Hugging Face class defaults (that is how speculators and vLLM read it); the algorithm
flags that speculators and vLLM default differently are required on read and always written.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from woodcock.errors import DrafterError
from woodcock.formats import hf_config as hf
from woodcock.ir import (
    CANONICAL_LAYER_CONVENTION,
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
    Weights,
    error_prefix,
)
from woodcock.jsonfile import read_json_object, write_json
from woodcock.staging import staged_directory
from woodcock.tensorfile import read_checkpoint, write_safetensors

NAME = "speculators"
LAYER_CONVENTION = CANONICAL_LAYER_CONVENTION
SIGNATURE = "config.json with speculators_model_type"
SPECULATORS_VERSION = "0.9.0"

ARCHITECTURES = {
    "eagle3": "Eagle3DraftModel",
    "dflash": "DFlashDraftModel",
    "dspark": "DSparkDraftModel",
}
COMMON_KEYS = {
    "speculators_model_type",
    "architectures",
    "speculators_version",
    "speculators_config",
    "transformer_layer_config",
    "draft_vocab_size",
    "target_hidden_size",
    "tie_word_embeddings",
    "dtype",
    "torch_dtype",
    "transformers_version",
    "auto_map",
}
EAGLE3_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
BLOCK_KEYS = ("block_size", "aux_hidden_state_layer_ids", "mask_token_id", "sample_from_anchor")
DSPARK_KEYS = (
    "markov_rank",
    "markov_head_type",
    "enable_confidence_head",
    "confidence_head_with_markov",
)
ALGORITHM_KEYS = {
    "eagle3": {*EAGLE3_FLAGS, "eagle_aux_hidden_state_layer_ids", "embed_requires_grad"},
    "dflash": {*BLOCK_KEYS, "sliding_window_non_causal"},
    "dspark": {*BLOCK_KEYS, "sliding_window_non_causal", *DSPARK_KEYS},
}

# Keys of transformer_layer_config read besides the class defaults' own.
LAYER_KEYS_READ = {
    "model_type",
    "mlp_bias",
    "layer_types",
    "sliding_window",
    "use_sliding_window",
    "max_window_layers",
    "rope_parameters",
    "rope_theta",
    "rope_scaling",
    "num_aux_hidden_states",
}
# vLLM's llama EAGLE-3 sizes fc for this many taps unless transformer_layer_config says
# num_aux_hidden_states (it reads neither speculators' top-level ids nor their count)
VLLM_DEFAULT_TAPS = 3
# Keys of a Hugging Face decoder config that do not change what a draft layer computes.
# (model_type names the layer style and is read; tie_word_embeddings is a model-level key)
INERT_LAYER_KEYS = (hf.INERT_KEYS - {"model_type"}) | {"tie_word_embeddings"}


def matches(path: Path) -> bool:
    config = Path(path) / "config.json"
    return config.is_file() and "speculators_model_type" in read_json_object(config)


# ---------------------------------------------------------------------------------------------
# read


def read(path: Path, *, taps: Sequence[int] | None = None) -> Drafter:
    """`taps` (canonical ids) supplies the tap ids when the config lacks them; where it has
    them, the two must agree."""
    path = Path(path)
    config_path = path / "config.json"
    config = read_json_object(config_path)
    with error_prefix(f"{config_path}: "):
        algorithm_name = config.get("speculators_model_type")
        if not isinstance(algorithm_name, str) or algorithm_name not in ALGORITHM_KEYS:
            raise DrafterError(
                f"speculators_model_type = {algorithm_name!r}: expected one of"
                f" {', '.join(ALGORITHM_KEYS)}"
            )
        unknown = sorted(set(config) - COMMON_KEYS - ALGORITHM_KEYS[algorithm_name])
        if unknown:
            raise DrafterError(f"unknown key(s) {', '.join(unknown)} for {algorithm_name}")
        layer_config = _require(config, "transformer_layer_config", dict)
        with error_prefix("transformer_layer_config."):
            layers = _read_layers(layer_config, algorithm_name, config)
        proposal = _read_speculators_config(config, algorithm_name)
        algorithm, fusion = _read_algorithm(config, algorithm_name, proposal)
        stored_taps = config.get(
            "eagle_aux_hidden_state_layer_ids"
            if algorithm_name == "eagle3"
            else "aux_hidden_state_layer_ids"
        )
        tap_ids = _tap_ids(stored_taps, taps, algorithm_name)
        counted = layer_config.get("num_aux_hidden_states")
        if counted is not None and counted != len(tap_ids):
            raise DrafterError(
                f"transformer_layer_config.num_aux_hidden_states = {counted!r}: expected"
                f" {len(tap_ids)}, the number of tapped layers {list(tap_ids)}"
            )
        default_vocab = hf.HF_LAYER_DEFAULTS[_style(layer_config)]["vocab_size"]
        vocab_size = layer_config.get("vocab_size", default_vocab)
        vocab_size = hf.integer(vocab_size, "transformer_layer_config.vocab_size")
        hidden = layers[0].hidden_size
        target_hidden = config.get("target_hidden_size")
        verifier = config["speculators_config"]["verifier"]
        architectures = verifier.get("architectures") or []
        if not isinstance(architectures, list) or not all(
            isinstance(a, str) for a in architectures
        ):
            raise DrafterError(
                f"speculators_config.verifier.architectures = {architectures!r}: expected a list"
                " of strings"
            )
        target = Target(
            num_hidden_layers=None,
            hidden_size=hidden
            if target_hidden is None
            else hf.integer(target_hidden, "target_hidden_size"),
            vocab_size=vocab_size,
            name_or_path=verifier.get("name_or_path"),
            architectures=tuple(architectures),
        )
        draft_vocab_size = hf.integer(_require(config, "draft_vocab_size", int), "draft_vocab_size")
    tensors = read_checkpoint(path)
    vocab = hf.vocab_from_offsets(path, tensors, draft_vocab_size, vocab_size, needs_d2t=False)
    head = Head(
        lm_head="own" if "lm_head.weight" in tensors else "shared",
        embedding="own" if "embed_tokens.weight" in tensors else "shared",
    )
    defaults = hf.HF_LAYER_DEFAULTS[_style(layer_config)]
    where = "transformer_layer_config."
    with (
        error_prefix(f"{path}: "),
        hf.naming_defaulted_dimensions(layer_config, defaults, where),
    ):
        spec = DrafterSpec(
            algorithm=algorithm,
            target=target,
            taps=Taps(tap_ids),
            fusion=fusion,
            layers=layers,
            head=head,
            draft_vocab_size=draft_vocab_size,
        )
        return Drafter(spec, vocab, Weights(tensors))


def _require(mapping: dict, key: str, kind: type) -> Any:
    if key not in mapping:
        raise DrafterError(f"missing key {key}")
    value = mapping[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise DrafterError(f"{key} = {value!r}: expected {kind.__name__}")
    return value


def _style(layer_config: dict) -> str:
    model_type = layer_config.get(
        "model_type", "qwen3"
    )  # speculators builds Qwen3Config without it
    if model_type not in hf.HF_LAYER_DEFAULTS:
        raise DrafterError(
            f"transformer_layer_config.model_type = {model_type!r}: expected 'llama' or 'qwen3'"
        )
    return model_type


def _read_layers(cfg: dict, algorithm_name: str, config: dict) -> tuple[DecoderLayer, ...]:
    style = _style(cfg)
    defaults = hf.HF_LAYER_DEFAULTS[style]
    unknown = sorted(set(cfg) - set(defaults) - LAYER_KEYS_READ - INERT_LAYER_KEYS)
    if unknown:
        raise DrafterError(
            f"unknown key(s) {', '.join(unknown)} (they may change the layer's math)"
        )
    kwargs = hf.layer_kwargs(cfg, defaults)
    num_layers = hf.integer(
        cfg.get("num_hidden_layers", defaults["num_hidden_layers"]), "num_hidden_layers"
    )
    if num_layers < 1:
        raise DrafterError(f"num_hidden_layers = {num_layers}: expected at least one layer")
    layer_types = _layer_types(cfg, style, num_layers)
    any_sliding = "sliding_attention" in layer_types
    window = cfg.get("sliding_window", defaults.get("sliding_window")) if any_sliding else None
    if any_sliding and not isinstance(window, int):
        raise DrafterError(f"sliding_window = {window!r}: expected an integer for sliding layers")
    theta, scaling = hf.read_rope(cfg)
    mlp_bias = cfg.get("mlp_bias", False) or False
    block = algorithm_name != "eagle3"
    if block and any_sliding:
        if "sliding_window_non_causal" not in config:
            raise DrafterError(
                "missing key sliding_window_non_causal (sliding layers are causal in the block"
                " unless it is true; refusing to guess)"
            )
    non_causal = hf.boolean(
        config.get("sliding_window_non_causal", False), "sliding_window_non_causal"
    )
    layers = []
    for i, layer_type in enumerate(layer_types):
        sliding = layer_type == "sliding_attention"
        if not block:
            attention = "causal"
        elif sliding and not non_causal:
            attention = "block_causal"
        else:
            attention = "block_bidirectional"
        with error_prefix(f"layers[{i}]."):
            layers.append(
                DecoderLayer(
                    # speculators runs DFlash/DSpark layers as Qwen3 layers whatever model_type says
                    style="qwen3" if block else style,
                    input="embed_and_hidden" if not block and i == 0 else "hidden",
                    attention=attention,
                    sliding_window=window if sliding else None,
                    rope_theta=theta,
                    rope_scaling=scaling,
                    attention_bias=cfg.get("attention_bias", defaults["attention_bias"]),
                    mlp_bias=mlp_bias,
                    **kwargs,
                )
            )
    return tuple(layers)


def _layer_types(cfg: dict, style: str, num_layers: int) -> list[str]:
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        if style == "qwen3" and cfg.get("use_sliding_window", False):
            first = cfg.get("max_window_layers", hf.HF_LAYER_DEFAULTS["qwen3"]["max_window_layers"])
            return [
                "sliding_attention" if i >= first else "full_attention" for i in range(num_layers)
            ]
        return ["full_attention"] * num_layers
    if (
        not isinstance(layer_types, list)
        or len(layer_types) != num_layers
        or not set(layer_types) <= {"full_attention", "sliding_attention"}
    ):
        raise DrafterError(
            f"layer_types = {layer_types!r}: expected {num_layers} entries of"
            " 'full_attention' or 'sliding_attention'"
        )
    if style == "qwen3" and "use_sliding_window" in cfg and not cfg["use_sliding_window"]:
        # Qwen3Config drops the window when use_sliding_window is false
        return ["full_attention"] * num_layers
    return layer_types


def _read_speculators_config(config: dict, algorithm_name: str) -> dict:
    spec_config = _require(config, "speculators_config", dict)
    with error_prefix("speculators_config."):
        algorithm = spec_config.get("algorithm")
        if algorithm != algorithm_name:
            raise DrafterError(f"algorithm = {algorithm!r}: expected {algorithm_name!r}")
        methods = _require(spec_config, "proposal_methods", list)
        default = spec_config.get("default_proposal_method")
        chosen = [m for m in methods if isinstance(m, dict) and m.get("proposal_type") == default]
        if not chosen:
            raise DrafterError(
                f"default_proposal_method = {default!r}: expected the proposal_type of one of"
                " proposal_methods"
            )
        verifier = _require(spec_config, "verifier", dict)
        if "name_or_path" not in verifier:
            raise DrafterError("verifier: missing key name_or_path")
        return chosen[0]


def _read_algorithm(config: dict, name: str, proposal: dict) -> tuple[Any, Fusion]:
    if name == "eagle3":
        missing = [flag for flag in EAGLE3_FLAGS if flag not in config]
        if missing:
            raise DrafterError(
                f"missing key(s) {', '.join(missing)}: speculators and vLLM default them"
                " differently (vLLM: norm_before_residual true), so they must be stated"
            )
        flags = {flag: _require(config, flag, bool) for flag in EAGLE3_FLAGS}
        if flags["fc_norm"] and flags["norm_before_fc"]:
            raise DrafterError("fc_norm and norm_before_fc are both true; they are exclusive")
        tap_norm = (
            "per_tap" if flags["fc_norm"] else "concat" if flags["norm_before_fc"] else "none"
        )
        algorithm = Eagle3(
            norm_before_residual=flags["norm_before_residual"],
            norm_output=flags["norm_output"],
            speculative_tokens=hf.integer(proposal.get("speculative_tokens"), "speculative_tokens"),
        )
        return algorithm, Fusion(tap_norm=tap_norm, fc_bias=False, hidden_norm=False)
    # the tap ids are checked with the taps, where --taps can supply them
    keys = ("block_size", "mask_token_id", "sample_from_anchor")
    keys += DSPARK_KEYS if name == "dspark" else ()
    missing = [key for key in keys if key not in config or config[key] is None]
    if missing:
        raise DrafterError(f"missing key(s) {', '.join(missing)} for {name}")
    block = {
        "block_size": _require(config, "block_size", int),
        "mask_token_id": _require(config, "mask_token_id", int),
        "sample_from_anchor": _require(config, "sample_from_anchor", bool),
    }
    if name == "dflash":
        algorithm = DFlash(**block)
    else:
        algorithm = DSpark(
            **block,
            markov_head_type=_require(config, "markov_head_type", str),
            markov_rank=_require(config, "markov_rank", int),
            confidence_head=_require(config, "enable_confidence_head", bool),
            confidence_head_with_markov=_require(config, "confidence_head_with_markov", bool),
        )
    return algorithm, Fusion(tap_norm="none", fc_bias=False, hidden_norm=True)


def _tap_ids(stored: Any, override: Sequence[int] | None, algorithm_name: str) -> tuple[int, ...]:
    key = (
        "eagle_aux_hidden_state_layer_ids"
        if algorithm_name == "eagle3"
        else "aux_hidden_state_layer_ids"
    )
    if not stored:
        if override is not None:
            return tuple(override)
        raise DrafterError(
            f"{key} = {stored!r}: the tapped target layers are not recorded; pass them with"
            " --taps (canonical ids: residual stream after L layers)"
        )
    if not isinstance(stored, list) or not all(isinstance(i, int) for i in stored):
        raise DrafterError(f"{key} = {stored!r}: expected a list of layer ids")
    if len(set(stored)) != len(stored):
        raise DrafterError(f"{key} = {stored!r}: repeated layer ids")
    ids = tuple(sorted(stored))  # the states are concatenated in ascending layer order
    if override is not None and tuple(override) != ids:
        raise DrafterError(
            f"{key} = {stored!r}; --taps {list(override)} disagrees (--retap replaces recorded"
            " taps)"
        )
    return ids


# ---------------------------------------------------------------------------------------------
# write


def write(drafter: Drafter, path: Path, *, force: bool = False) -> None:
    spec = drafter.spec
    config = speculators_config(spec)
    tensors = dict(drafter.weights)
    if drafter.vocab.draft_to_target is not None:
        tensors |= hf.offsets_and_mask(drafter)
    dtypes = drafter.weights.dtypes
    if len(dtypes) == 1:
        config["dtype"] = hf.TORCH_DTYPES.get(next(iter(dtypes)))
    with staged_directory(path, force=force) as out:
        write_safetensors(out / "model.safetensors", tensors, {"format": "pt"}, digest=False)
        write_json(out / "config.json", config)


def speculators_config(spec: DrafterSpec) -> dict[str, Any]:
    """The config.json that speculators 0.9.0 and vLLM read for this spec, or a DrafterError
    naming what the format cannot hold."""
    algorithm = spec.algorithm
    name = algorithm.name
    if spec.fusion.fc_bias:
        raise DrafterError("speculators cannot hold fusion.fc_bias = true (its fc has no bias)")
    if spec.draft_vocab_size < spec.target.vocab_size and spec.head.lm_head == "shared":
        # speculators itself would slice the target's head; vLLM refuses to load the drafter
        raise DrafterError(
            f"a reduced draft vocabulary ({spec.draft_vocab_size} of {spec.target.vocab_size}"
            " ids) with the target's lm_head: vLLM needs the drafter's own lm_head rows; pass"
            " --target to copy them in"
        )
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[name]],
        "speculators_model_type": name,
        "speculators_version": SPECULATORS_VERSION,
        "draft_vocab_size": spec.draft_vocab_size,
        "target_hidden_size": None
        if spec.target.hidden_size == spec.hidden_size
        else spec.target.hidden_size,
        "tie_word_embeddings": False,
    }
    if isinstance(algorithm, Eagle3):
        config["eagle_aux_hidden_state_layer_ids"] = list(spec.taps.layer_ids)
        config["norm_before_residual"] = algorithm.norm_before_residual
        config["norm_before_fc"] = spec.fusion.tap_norm == "concat"
        config["fc_norm"] = spec.fusion.tap_norm == "per_tap"
        config["norm_output"] = algorithm.norm_output
        config["embed_requires_grad"] = False
        speculative_tokens = algorithm.speculative_tokens
    else:
        if spec.fusion.tap_norm != "none" or not spec.fusion.hidden_norm:
            raise DrafterError(
                f"speculators {name} fuses taps as hidden_norm(fc(concat)): it cannot hold"
                f" fusion.tap_norm = {spec.fusion.tap_norm!r},"
                f" hidden_norm = {spec.fusion.hidden_norm}"
            )
        config["aux_hidden_state_layer_ids"] = list(spec.taps.layer_ids)
        config["block_size"] = algorithm.block_size
        config["mask_token_id"] = algorithm.mask_token_id
        config["sample_from_anchor"] = algorithm.sample_from_anchor
        config["sliding_window_non_causal"] = _sliding_non_causal(spec)
        if isinstance(algorithm, DSpark):
            config["markov_rank"] = algorithm.markov_rank
            config["markov_head_type"] = algorithm.markov_head_type
            config["enable_confidence_head"] = algorithm.confidence_head
            config["confidence_head_with_markov"] = algorithm.confidence_head_with_markov
        speculative_tokens = algorithm.num_drafts
    config["speculators_config"] = {
        "algorithm": name,
        "proposal_methods": [
            {
                "proposal_type": "greedy",
                "speculative_tokens": speculative_tokens,
                "verifier_accept_k": 1,
                "accept_tolerance": 0.0,
            }
        ],
        "default_proposal_method": "greedy",
        "verifier": {
            "name_or_path": spec.target.name_or_path,
            "architectures": list(spec.target.architectures),
        },
    }
    config["transformer_layer_config"] = _layer_config(spec)
    if isinstance(algorithm, Eagle3) and len(spec.taps.layer_ids) != VLLM_DEFAULT_TAPS:
        config["transformer_layer_config"]["num_aux_hidden_states"] = len(spec.taps.layer_ids)
    return config


def _sliding_non_causal(spec: DrafterSpec) -> bool:
    """speculators has one switch for every sliding layer; full layers are always bidirectional.
    vLLM (0.33.0, 0.34.0) reads the switch as every layer's causality (`dflash_config.causal = not
    sliding_window_non_causal`, overriding each layer in qwen3_dflash's `_dflash_layer_causal`),
    so a drafter without sliding layers says true: the same to speculators, and bidirectional
    in vLLM as trained. Causal sliding layers beside full ones must say false, and that vLLM
    then runs the full layers causal too: written as speculators means it."""
    kinds = set()
    for i, layer in enumerate(spec.layers):
        if layer.sliding_window is None:
            if layer.attention != "block_bidirectional":
                raise DrafterError(
                    f"layers[{i}].attention = {layer.attention!r} without a sliding window:"
                    " speculators makes full-attention layers bidirectional in the block"
                )
        else:
            kinds.add(layer.attention)
    if len(kinds) > 1:
        raise DrafterError(
            "sliding layers mix block_causal and block_bidirectional; speculators has one"
            " sliding_window_non_causal switch for all of them"
        )
    return kinds != {"block_causal"}


def vllm_notes(config: dict[str, Any]) -> list[str]:
    """What vLLM would run differently from what this config means to speculators, or refuse
    (vLLM 0.34.0: transformers_utils/configs/speculators/algos.py, models/qwen3_dflash.py,
    models/qwen3_dspark.py, v1/worker/gpu/spec_decode/{dflash/speculator,dspark/config}.py)."""
    name = config["speculators_model_type"]
    if name == "eagle3":
        return []
    notes = []
    layer_types = config["transformer_layer_config"].get("layer_types") or []
    non_causal = config.get("sliding_window_non_causal")
    if name == "dflash":
        if non_causal is False and "full_attention" in layer_types:
            notes.append(
                "vLLM reads sliding_window_non_causal = false as every layer causal: this"
                " drafter's full-attention layers, bidirectional in speculators, would run"
                " causal there"
            )
        if config["sample_from_anchor"]:
            notes.append("vLLM refuses DFlash drafters with sample_from_anchor = true")
        return notes
    # DSpark: no dflash_config in vLLM, so each layer's causality comes from its type alone
    if non_causal and "sliding_attention" in layer_types:
        notes.append(
            "vLLM ignores sliding_window_non_causal for DSpark: this drafter's sliding layers,"
            " bidirectional in speculators, would run causal there"
        )
    if config["markov_head_type"] != "vanilla":
        notes.append(
            f"vLLM builds only the vanilla Markov head: this drafter's"
            f" markov_head_type = {config['markov_head_type']!r} fails to load there"
        )
    if not config["sample_from_anchor"]:
        size = config["block_size"]
        notes.append(
            f"vLLM takes this drafter's {size - 1} tokens a block from this config only when it"
            f" serves the drafter itself; a --speculative-config without num_speculative_tokens"
            f" gets block_size ({size}): pass num_speculative_tokens {size - 1}"
        )
    return notes


def _layer_config(spec: DrafterSpec) -> dict[str, Any]:
    # sliding windows and attention kinds may differ by layer type (layer_types), checked below
    first = hf.uniform_layers(spec, "speculators", hf.UNIFORM_LAYER_FIELDS[:-2])
    windows = {layer.sliding_window for layer in spec.layers} - {None}
    if len(windows) > 1:
        raise DrafterError(f"sliding windows {sorted(windows)} differ; speculators has one")
    if spec.is_block and first.style != "qwen3":
        raise DrafterError(
            f"layers[0].style = {first.style!r}: speculators runs {spec.algorithm.name} layers as"
            " qwen3 layers (with q/k norm)"
        )
    if first.style == "qwen3" and first.mlp_bias:
        raise DrafterError("layers[0].mlp_bias = true: speculators' qwen3 MLP has no bias")
    rope = {"rope_type": "default", "rope_theta": first.rope_theta}
    if first.rope_scaling is not None:
        rope = {**first.rope_scaling, "rope_theta": first.rope_theta}
    layer_types = [
        "full_attention" if layer.sliding_window is None else "sliding_attention"
        for layer in spec.layers
    ]
    config = {
        "model_type": first.style,
        "vocab_size": spec.target.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": first.intermediate_size,
        "num_hidden_layers": len(spec.layers),
        "num_attention_heads": first.num_attention_heads,
        "num_key_value_heads": first.num_key_value_heads,
        "head_dim": first.head_dim,
        "hidden_act": first.hidden_act,
        "rms_norm_eps": first.rms_norm_eps,
        "max_position_embeddings": first.max_position_embeddings,
        "attention_bias": first.attention_bias,
        "tie_word_embeddings": False,
        "rope_parameters": rope,
    }
    # LlamaConfig has no window keys of its own: speculators adds them only for sliding layers.
    if first.style == "qwen3" or windows:
        config["layer_types"] = layer_types
        config["sliding_window"] = next(iter(windows)) if windows else None
        config["use_sliding_window"] = bool(windows)
    if first.style == "llama":
        config["mlp_bias"] = first.mlp_bias
    return config
