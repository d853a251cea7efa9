"""What the Hugging Face-style block drafter checkpoints share (z-lab DFlash, SpecForge DSpark
and DeepSpec): Qwen3 layers run on [anchor, MASK ...] with the fused context as extra keys/values,
bidirectional in the block; the taps concatenated without a norm, fc without bias, the hidden
norm after it; taps stored as "output of layer i"; the target's full vocabulary.

`read` and `output` are the reading and writing they share; each format module passes what is
its own (its keys, its algorithm, where it stores the taps, whether the head is the target's).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from woodcock.errors import DrafterError
from woodcock.formats import hf_config as hf
from woodcock.ir import (
    DecoderLayer,
    DFlash,
    Drafter,
    DrafterSpec,
    Fusion,
    Head,
    Taps,
    Target,
    VocabMap,
    Weights,
    error_prefix,
)

LAYER_CONVENTION = "layer_output"
# Keys of a block format's config besides hf_config.LAYER_KEYS: its layers are full attention.
BLOCK_KEYS = frozenset(
    {
        "layer_types",
        "sliding_window",
        "use_sliding_window",
        "max_window_layers",
        "tie_word_embeddings",
    }
)


# ---------------------------------------------------------------------------------------------
# read


def read(
    path: Path,
    fmt: str,
    known: Iterable[str],
    read_own: Callable[[Mapping[str, Any], tuple[DecoderLayer, ...]], tuple[DFlash, Any]],
    *,
    taps: Sequence[int] | None,
    taps_key: str,
    head: Head,
    renames: Sequence[tuple[str, str]] = (),
) -> Drafter:
    """A block drafter from a checkpoint of format `fmt` whose config.json may hold the keys
    `known`. `read_own(config, layers)` reads the format's own keys: (the algorithm, the tap ids
    stored under `taps_key`, or None). `taps` (canonical ids) supplies the taps when the config
    does not record them and must agree with them when it does. A `head` shared with the target
    refuses a checkpoint that stores its own."""
    path = Path(path)
    config_path, config = hf.read_config(path)
    with error_prefix(f"{config_path}: "):
        hf.check_keys(config, known, fmt)
        _check_copied_sizes(config)
        layers = block_layers(config)
        algorithm, stored_taps = read_own(config, layers)
        target_layers = read_target_layers(config)
        tap_ids = hf.read_taps(
            stored_taps,
            taps,
            LAYER_CONVENTION,
            taps_key,
            target_layers=target_layers,
            hf_final_norm=True,
        )
        if any(i < 0 for i in tap_ids):
            raise DrafterError(
                f"{taps_key} = {stored_taps!r}: -1 (the embedding output) is the lowest id"
            )
        vocab = hf.integer(config.get("vocab_size", hf.QWEN3_DEFAULTS["vocab_size"]), "vocab_size")
    tensors = hf.read_tensors(path, renames)
    if head.lm_head == "shared":
        refuse_own_head(path, tensors, fmt)
    with error_prefix(f"{path}: "), hf.naming_defaulted_dimensions(config, hf.QWEN3_DEFAULTS):
        spec = DrafterSpec(
            algorithm=algorithm,
            target=Target(
                num_hidden_layers=target_layers,
                hidden_size=layers[0].hidden_size,
                vocab_size=vocab,
            ),
            taps=Taps(tap_ids),
            fusion=Fusion(tap_norm="none", fc_bias=False, hidden_norm=True),
            layers=layers,
            head=head,
            draft_vocab_size=vocab,
        )
        return Drafter(spec, VocabMap(), Weights(tensors))


def block_layers(config: Mapping[str, Any]) -> tuple[DecoderLayer, ...]:
    count = hf.integer(
        config.get("num_hidden_layers", hf.QWEN3_DEFAULTS["num_hidden_layers"]), "num_hidden_layers"
    )
    check_full_attention(config, count)
    theta, scaling = hf.read_rope(config)
    return hf.build_layers(
        count,
        style="qwen3",
        input="hidden",
        attention="block_bidirectional",
        sliding_window=None,
        rope_theta=theta,
        rope_scaling=scaling,
        attention_bias=hf.boolean(config.get("attention_bias", False), "attention_bias"),
        mlp_bias=False,
        **hf.layer_kwargs(config, hf.QWEN3_DEFAULTS),
    )


def check_full_attention(config: Mapping[str, Any], count: int) -> None:
    """Block formats here run every layer as full attention; sliding layers in a block follow
    rules (a window per slot) the IR does not describe, so they are refused."""
    layer_types = config.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != count:
            raise DrafterError(
                f"layer_types = {layer_types!r}: expected {count} entries (num_hidden_layers)"
            )
        for i, kind in enumerate(layer_types):
            if kind not in ("full_attention", "sliding_attention"):
                raise DrafterError(f"layer_types[{i}] = {kind!r}: expected 'full_attention'")
        if any(kind != "full_attention" for kind in layer_types):
            raise DrafterError(
                f"layer_types = {layer_types!r}: sliding-window layers in a block are not"
                " supported (their per-slot window is not what the IR describes)"
            )
        return
    if config.get("use_sliding_window"):
        first = config.get("max_window_layers", hf.QWEN3_DEFAULTS["max_window_layers"])
        if hf.integer(first, "max_window_layers") < count:
            raise DrafterError(
                "use_sliding_window = true makes some layers sliding-window layers; not supported"
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
    if n is None:
        return None
    if hf.integer(n, "num_target_layers") < 1:
        raise DrafterError(f"num_target_layers = {n}: expected the target's layer count, >= 1")
    return n


def refuse_own_head(path: Path, tensors: dict, fmt: str) -> None:
    own = sorted({"embed_tokens.weight", "lm_head.weight"} & set(tensors))
    if own:
        raise DrafterError(
            f"{path}: {fmt} takes the embedding and LM head from the target, but the checkpoint"
            f" also stores {', '.join(own)} (an early preview?); refusing to guess which is meant"
        )


# ---------------------------------------------------------------------------------------------
# write


def output(
    drafter: Drafter,
    fmt: str,
    problems: Sequence[str],
    identity: Mapping[str, Any],
    own_keys: Callable[[DecoderLayer], Mapping[str, Any]],
    notes: Sequence[str] = (),
) -> hf.Output:
    """What format `fmt` writes for a block drafter, or a DrafterError naming the `problems` the
    format module found (what else it cannot hold), else those of `check_block`. The config:
    `identity` (architectures, auto_map), the Qwen3 layers, block_size, `own_keys(layer)`, the
    dtype; the tensors keep their canonical names."""
    if problems:
        raise DrafterError(f"{fmt} cannot hold " + "; ".join(problems))
    spec = drafter.spec
    layer = check_block(spec, fmt)
    config = {
        **identity,
        **block_config(layer, spec),
        "block_size": spec.algorithm.block_size,
        **own_keys(layer),
        **hf.torch_dtype(drafter),
    }
    tensors, sources = hf.output_tensors(drafter)
    return hf.Output(config, tensors, sources, notes=list(notes))


def check_block(spec: DrafterSpec, fmt: str) -> DecoderLayer:
    """What every block format here fixes: hidden_norm(fc(concat taps)) without tap norm or fc
    bias, taps as wide as the drafter, uniform full-attention Qwen3 layers, bidirectional in
    the block. Returns the layer facts for the config."""
    problems = []
    fusion = spec.fusion
    if fusion.tap_norm != "none" or not fusion.hidden_norm or fusion.fc_bias:
        problems.append(
            f"fusion tap_norm={fusion.tap_norm!r}, hidden_norm={fusion.hidden_norm},"
            f" fc_bias={fusion.fc_bias} (it computes hidden_norm(fc(concat)) only)"
        )
    if spec.target.hidden_size != spec.hidden_size:
        problems.append(
            f"target hidden size {spec.target.hidden_size} != draft hidden size"
            f" {spec.hidden_size} (its fc is n_taps * hidden_size wide)"
        )
    for i, layer in enumerate(spec.layers):
        if layer.style != "qwen3":
            problems.append(f"layers[{i}] style {layer.style!r} (its layers are Qwen3 layers)")
        if layer.mlp_bias:
            problems.append(f"layers[{i}] MLP biases")
        if layer.sliding_window is not None or layer.attention != "block_bidirectional":
            problems.append(
                f"layers[{i}] {layer.attention} attention with window {layer.sliding_window}"
                " (only full, bidirectional-in-block attention)"
            )
    if problems:
        raise DrafterError(f"{fmt} cannot hold " + "; ".join(problems))
    return hf.uniform_layers(spec, fmt)


def block_config(layer: DecoderLayer, spec: DrafterSpec) -> dict[str, Any]:
    count = len(spec.layers)
    config = {
        "model_type": "qwen3",
        **hf.layer_config(layer, count),
        "layer_types": ["full_attention"] * count,
        "sliding_window": None,
        "use_sliding_window": False,
        "max_window_layers": count,
        "vocab_size": spec.target.vocab_size,
    }
    if spec.target.num_hidden_layers is not None:
        config["num_target_layers"] = spec.target.num_hidden_layers
    return config


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


# SpecForge's exports of its DFlash and DSpark drafters carry keys its block drafters never read
# (sgl-project/SpecForge@a6b6b02:specforge/modeling/auto.py sets draft_vocab_size to vocab_size;
# its qwen3.6-27b-dspark config holds "target_hidden_size": null): read where they say nothing
# new, refused where they would mean another size.
COPIED_SIZES = {"draft_vocab_size": "vocab_size", "target_hidden_size": "hidden_size"}


def _check_copied_sizes(config: dict) -> None:
    for key, size_key in COPIED_SIZES.items():
        value = config.get(key)
        if value is not None and value != config.get(size_key):
            raise DrafterError(
                f"{key} = {value!r}: expected null or {size_key} ({config.get(size_key)!r}); a"
                " block drafter here reads neither"
            )
