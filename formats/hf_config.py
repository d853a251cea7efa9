"""Pieces shared by the formats whose config.json is a Hugging Face decoder config with a few
extra keys: SafeAILab and SpecForge EAGLE-3, z-lab DFlash, DeepSpec and SpecForge DSpark.

Keys a format's own runtime reads with a class default take that default when missing (that is
how the runtime reads the file); keys nobody here knows are refused, since they may change the
math. A writer first builds everything it would write (`Output`): `--dry-run` prints that, `write`
stores it. Tensors are the drafter's own arrays under new names: a rename never copies.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from woodcock.converters.layer_ids import from_canonical, to_canonical
from woodcock.errors import DrafterError
from woodcock.ir import (
    ROPE_TYPES,
    DecoderLayer,
    Drafter,
    DrafterSpec,
    Target,
    VocabMap,
    error_prefix,
)
from woodcock.jsonfile import read_json_object, write_json
from woodcock.staging import staged_directory
from woodcock.tensorfile import read_checkpoint, write_safetensors

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
TORCH_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}

# Keys of a copied Hugging Face config that do not change what a draft layer computes.
INERT_KEYS = frozenset(
    {
        "architectures",
        "model_type",
        "dtype",
        "torch_dtype",
        "transformers_version",
        "initializer_range",
        "use_cache",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "pretraining_tp",
        "attention_dropout",
        "_name_or_path",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
    }
)
# The decoder-layer keys every format here reads (with the class defaults below).
LAYER_KEYS = frozenset(
    {
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_act",
        "max_position_embeddings",
        "rms_norm_eps",
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "attention_bias",
        "vocab_size",
        "num_hidden_layers",
    }
)
# transformers 5.x class defaults for the keys a draft layer depends on (tests check them
# against transformers). None: derived (llama: kv heads = heads, head_dim = hidden / heads).
HF_LAYER_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": None,
        "head_dim": None,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "mlp_bias": False,
    },
    "qwen3": {
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 22016,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "head_dim": 128,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_window_layers": 28,
    },
}
QWEN3_DEFAULTS = HF_LAYER_DEFAULTS["qwen3"]  # checked against transformers in the tests
LLAMA_DEFAULTS = HF_LAYER_DEFAULTS["llama"]
DEFAULT_ROPE_THETA = 10000.0
# the keys that size a drafter's tensors
DIMENSION_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)


@contextlib.contextmanager
def naming_defaulted_dimensions(
    config: Mapping[str, Any], defaults: Mapping[str, Any], where: str = ""
) -> Iterator[None]:
    """A tensor of a shape the config does not imply, where the config left a dimension to the
    class default (as transformers reads it): the likely cause is the missing key, so the error
    names it besides the tensor."""
    try:
        yield
    except DrafterError as e:
        missing = [k for k in DIMENSION_KEYS if k not in config and defaults.get(k) is not None]
        if ".shape = " not in str(e) or not missing:
            raise
        names = ", ".join(where + k for k in missing)
        values = ", ".join(str(defaults[k]) for k in missing)
        plural = "s" if len(missing) > 1 else ""
        raise DrafterError(
            f"{e} (config.json does not state {names}; the Hugging Face class default{plural}"
            f" {values} {'were' if plural else 'was'} taken)"
        ) from None


@dataclass
class Output:
    """Everything a writer would write. `sources` maps each output tensor to the canonical name
    it holds, or to a description in parentheses for tensors built from the vocabulary map."""

    config: dict[str, Any]
    tensors: dict[str, np.ndarray]
    sources: dict[str, str]
    files: tuple[str, ...] = (CONFIG, WEIGHTS)
    notes: list[str] = field(default_factory=list)


def read_config(path: Path) -> tuple[Path, dict[str, Any]]:
    config_path = Path(path) / CONFIG
    return config_path, read_json_object(config_path)


def config_or_none(path: Path) -> dict[str, Any] | None:
    """The config for format detection: None when absent or unreadable (detection never fails)."""
    try:
        return read_json_object(Path(path) / CONFIG)
    except DrafterError:
        return None


def architectures(config: Mapping[str, Any]) -> list[str]:
    archs = config.get("architectures")
    return [a for a in archs if isinstance(a, str)] if isinstance(archs, list) else []


def check_keys(config: Mapping[str, Any], known: Iterable[str], what: str) -> None:
    unknown = sorted(set(config) - set(known))
    if unknown:
        raise DrafterError(
            f"unknown key(s) {', '.join(unknown)} for {what} (they may change the math;"
            " refusing to guess)"
        )


def integer(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise DrafterError(f"{name} = {value!r}: expected an integer")
    return value


def boolean(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise DrafterError(f"{name} = {value!r}: expected true or false")
    return value


def required(config: Mapping[str, Any], key: str, where: str = "") -> Any:
    if key not in config or config[key] is None:
        raise DrafterError(f"missing key {where}{key}")
    return config[key]


# ---------------------------------------------------------------------------------------------
# Layer ids


def read_taps(
    stored: Any,
    override: Sequence[int] | None,
    convention: str,
    key: str,
    *,
    target_layers: int | None = None,
    hf_final_norm: bool = False,
) -> tuple[int, ...]:
    """Canonical tap ids from the stored ones (or from --taps when none are stored; when both
    exist they must agree). hf_final_norm: the runtime reads Hugging Face hidden_states, whose
    last entry is after the final norm, so "output of the last layer" is not the IR's id N."""
    if stored is None or stored == []:
        if override is None:
            raise DrafterError(
                f"{key} is not recorded: the tapped target layers are unknown; pass them with"
                " --taps (canonical ids: residual stream after L layers)"
            )
        return tuple(override)
    if not isinstance(stored, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in stored
    ):
        raise DrafterError(f"{key} = {stored!r}: expected a list of layer ids")
    if any(b <= a for a, b in zip(stored, stored[1:], strict=False)):
        raise DrafterError(f"{key} = {stored!r}: expected strictly ascending ids")
    if hf_final_norm and target_layers is not None and target_layers - 1 in stored:
        raise DrafterError(
            f"{key} = {stored!r} includes the last target layer ({target_layers - 1}): this"
            " runtime reads Hugging Face hidden_states, where that entry is after the final norm,"
            " which no canonical tap id means"
        )
    canonical = to_canonical(stored, convention)
    if target_layers is not None:
        outside = [s for s, c in zip(stored, canonical, strict=True) if not 0 <= c <= target_layers]
        if outside:
            raise DrafterError(
                f"{key} = {stored!r}: {outside[0]} is no layer of the {target_layers}-layer target"
                " (num_target_layers)"
            )
    if override is not None and tuple(override) != canonical:
        raise DrafterError(
            f"{key} = {stored!r} ({convention}) is canonical {list(canonical)}; --taps"
            f" {list(override)} disagrees"
        )
    return canonical


def stored_taps(
    spec: DrafterSpec, convention: str, *, hf_final_norm: bool = False, fmt: str = ""
) -> list[int]:
    ids = spec.taps.layer_ids
    n = spec.target.num_hidden_layers
    if hf_final_norm and n is not None and n in ids:
        raise DrafterError(
            f"taps {list(ids)} include id {n} (the last layer's output before the final norm):"
            f" {fmt} reads Hugging Face hidden_states, where that entry is after the final norm"
        )
    return list(from_canonical(ids, convention))


# ---------------------------------------------------------------------------------------------
# Decoder layers


def read_rope(config: Mapping[str, Any], allowed: Iterable[str] = ROPE_TYPES) -> tuple[float, Any]:
    """(rope_theta, rope_scaling in the IR's form) from either spelling: rope_theta/rope_scaling
    (transformers 4) or rope_parameters (transformers 5, maybe one entry per layer type)."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        if len({repr(sorted(v.items())) for v in params.values()}) > 1:
            raise DrafterError(f"rope_parameters = {params!r}: per-layer-type rope differs")
        params = next(iter(params.values()))
    if params is not None:
        if not isinstance(params, dict) or "rope_theta" not in params:
            raise DrafterError(f"rope_parameters = {params!r}: expected an object with rope_theta")
        theta = params["rope_theta"]
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        legacy = config.get("rope_scaling")
        if "rope_theta" in config and config["rope_theta"] != theta:
            raise DrafterError(
                f"rope_theta = {config['rope_theta']!r} disagrees with rope_parameters ({theta!r})"
            )
        if legacy and _rope_kind(legacy) != _rope_kind(scaling):
            raise DrafterError(f"rope_scaling = {legacy!r} disagrees with rope_parameters")
    else:
        theta = config.get("rope_theta", DEFAULT_ROPE_THETA)
        scaling = config.get("rope_scaling") or {}
        if not isinstance(scaling, dict):
            raise DrafterError(f"rope_scaling = {scaling!r}: expected an object or null")
        scaling = dict(scaling)
    if "type" in scaling:  # the pre-4.45 spelling
        kind = scaling.pop("type")
        if scaling.setdefault("rope_type", kind) != kind:
            raise DrafterError(
                f"rope scaling names two types: {kind!r} and {scaling['rope_type']!r}"
            )
    if isinstance(theta, bool) or not isinstance(theta, int | float):
        raise DrafterError(f"rope_theta = {theta!r}: expected a number")
    kind = scaling.get("rope_type", "default")
    if kind == "default":
        extra = sorted(set(scaling) - {"rope_type"})
        if extra:
            raise DrafterError(f"rope parameters {', '.join(extra)} given for default RoPE")
        return float(theta), None
    allowed = tuple(allowed)
    if kind not in allowed:
        raise DrafterError(
            f"rope_type = {kind!r}: this format's runtime is only known to match Hugging Face"
            f" for {', '.join(allowed) or 'plain RoPE'}"
        )
    return float(theta), scaling


def _rope_kind(scaling: Mapping[str, Any]) -> str:
    return scaling.get("rope_type", scaling.get("type", "default"))


def layer_kwargs(config: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The DecoderLayer fields a Hugging Face config states, class defaults for the rest
    (llama: kv heads = heads, head_dim = hidden / heads)."""
    value = {key: config.get(key, default) for key, default in defaults.items()}
    hidden = integer(value["hidden_size"], "hidden_size")
    heads = integer(value["num_attention_heads"], "num_attention_heads")
    if value["num_key_value_heads"] is None:
        value["num_key_value_heads"] = heads
    if value["head_dim"] is None:
        value["head_dim"] = hidden // heads
    return {
        "hidden_size": hidden,
        "intermediate_size": value["intermediate_size"],
        "num_attention_heads": heads,
        "num_key_value_heads": value["num_key_value_heads"],
        "head_dim": value["head_dim"],
        "rms_norm_eps": value["rms_norm_eps"],
        "max_position_embeddings": value["max_position_embeddings"],
        "hidden_act": value["hidden_act"],
    }


def build_layers(count: int, **fields: Any) -> tuple[DecoderLayer, ...]:
    layers = []
    for i in range(count):
        values = dict(fields)
        if values.pop("eagle3", False):
            values["input"] = "embed_and_hidden" if i == 0 else "hidden"
        with error_prefix(f"layers[{i}]."):
            layers.append(DecoderLayer(**values))
    return tuple(layers)


# The layer facts one Hugging Face config states for every layer.
UNIFORM_LAYER_FIELDS = (
    "style",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "max_position_embeddings",
    "attention_bias",
    "mlp_bias",
    "hidden_act",
    "sliding_window",
    "attention",
)


def uniform_layers(
    spec: DrafterSpec, fmt: str, fields: Sequence[str] = UNIFORM_LAYER_FIELDS
) -> DecoderLayer:
    """The one set of layer facts a single Hugging Face config can state."""
    first = spec.layers[0]
    for i, layer in enumerate(spec.layers[1:], start=1):
        for name in fields:
            if getattr(layer, name) != getattr(first, name):
                raise DrafterError(
                    f"layers[{i}].{name} = {getattr(layer, name)!r} differs from layers[0]"
                    f" ({getattr(first, name)!r}); {fmt} has one config for every layer"
                )
    return first


def layer_config(layer: DecoderLayer, count: int) -> dict[str, Any]:
    """The decoder keys of a Hugging Face config, with transformers-4 RoPE keys (every runtime
    here reads those; transformers 5 converts them)."""
    scaling = None if layer.rope_scaling is None else dict(layer.rope_scaling)
    return {
        "hidden_size": layer.hidden_size,
        "intermediate_size": layer.intermediate_size,
        "num_hidden_layers": count,
        "num_attention_heads": layer.num_attention_heads,
        "num_key_value_heads": layer.num_key_value_heads,
        "head_dim": layer.head_dim,
        "hidden_act": layer.hidden_act,
        "rms_norm_eps": layer.rms_norm_eps,
        "max_position_embeddings": layer.max_position_embeddings,
        "rope_theta": layer.rope_theta,
        "rope_scaling": scaling,
        "attention_bias": layer.attention_bias,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
    }


def torch_dtype(drafter: Drafter) -> dict[str, str]:
    dtypes = drafter.weights.dtypes
    if len(dtypes) == 1 and next(iter(dtypes)) in TORCH_DTYPES:
        return {"torch_dtype": TORCH_DTYPES[next(iter(dtypes))]}
    return {}


# ---------------------------------------------------------------------------------------------
# Tensors


def rename(name: str, renames: Sequence[tuple[str, str]]) -> str:
    """Apply the first matching prefix rename."""
    for old, new in renames:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def read_tensors(path: Path, renames: Sequence[tuple[str, str]] = ()) -> dict[str, np.ndarray]:
    """The checkpoint's tensors (memory-mapped) under canonical names: `renames` are
    (stored prefix, canonical prefix) pairs."""
    tensors: dict[str, np.ndarray] = {}
    for name, array in read_checkpoint(path).items():
        canonical = rename(name, renames)
        if canonical in tensors:
            raise DrafterError(f"{path}: tensors {name!r} and {canonical!r} both hold {canonical}")
        tensors[canonical] = array
    return tensors


def output_tensors(
    drafter: Drafter, renames: Sequence[tuple[str, str]] = ()
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The drafter's tensors under their stored names (the same arrays: nothing is copied)."""
    tensors, sources = {}, {}
    for name, array in drafter.weights.items():
        stored = rename(name, renames)
        tensors[stored] = array
        sources[stored] = name
    return tensors, sources


def offsets_and_mask(drafter: Drafter) -> dict[str, np.ndarray]:
    """`d2t` (int64 offsets: target id = i + d2t[i]) and `t2d` (bool over the target vocab);
    the identity and an all-true mask for a full vocabulary."""
    spec = drafter.spec
    ids = drafter.vocab.target_ids(spec)
    t2d = np.zeros(spec.target.vocab_size, dtype=np.bool_)
    t2d[ids] = True
    return {"d2t": ids - np.arange(spec.draft_vocab_size, dtype=np.int64), "t2d": t2d}


def vocab_from_offsets(
    where: Path,
    tensors: dict[str, np.ndarray],
    draft_vocab: int,
    vocab: int,
    *,
    needs_d2t: bool = True,
) -> VocabMap:
    """The vocabulary map that the `d2t` offsets and/or the `t2d` mask give (checked against each
    other when both are present), both taken out of `tensors`; absolute target ids, or none for
    a full vocabulary, whose buffers must then be the identity.
    needs_d2t: the format's runtime maps drafts through d2t, so the mask alone is not enough."""
    d2t, t2d = tensors.pop("d2t", None), tensors.pop("t2d", None)
    return VocabMap(_target_ids(where, d2t, t2d, draft_vocab, vocab, needs_d2t))


def _target_ids(
    where: Path,
    d2t: np.ndarray | None,
    t2d: np.ndarray | None,
    draft_vocab: int,
    vocab: int,
    needs_d2t: bool,
) -> np.ndarray | None:
    where = where / "model.safetensors" if where.is_dir() else where
    if needs_d2t and d2t is None and draft_vocab != vocab:
        raise DrafterError(
            f"{where}: draft_vocab_size {draft_vocab} < vocab_size {vocab} but there is no d2t:"
            " the draft-to-target map is missing (an identity map would be wrong)"
        )
    ids = None
    if d2t is not None:
        if d2t.shape != (draft_vocab,) or d2t.dtype.kind not in "iu":
            raise DrafterError(
                f"{where}: d2t is {d2t.dtype} {list(d2t.shape)}, expected int64 [{draft_vocab}]"
            )
        ids = np.arange(draft_vocab, dtype=np.int64) + d2t.astype(np.int64)
    if t2d is not None:
        if t2d.shape != (vocab,) or t2d.dtype != np.bool_:
            raise DrafterError(
                f"{where}: t2d is {t2d.dtype} {list(t2d.shape)}, expected bool [{vocab}]"
            )
        selected = np.flatnonzero(t2d)
        if ids is None:
            ids = selected
        elif not np.array_equal(np.sort(ids), selected):
            raise DrafterError(
                f"{where}: d2t and t2d disagree: i + d2t[i] does not give the target ids t2d"
                " marks (is d2t stored as absolute ids instead of offsets?)"
            )
    if draft_vocab == vocab:
        if ids is not None and not np.array_equal(ids, np.arange(vocab)):
            raise DrafterError(f"{where}: d2t/t2d map a full-size draft vocabulary to other ids")
        return None
    if ids is None:
        raise DrafterError(
            f"{where}: draft_vocab_size {draft_vocab} < vocab_size {vocab} but there is no d2t"
            " or t2d: the draft-to-target map is missing (an identity map would be wrong)"
        )
    return ids


def write_output(output: Output, path: Path, *, force: bool) -> None:
    with staged_directory(path, force=force) as out:
        write_safetensors(out / WEIGHTS, output.tensors, {"format": "pt"}, digest=False)
        write_json(out / CONFIG, output.config)


def one_layer_eagle3(
    config: Mapping[str, Any], layer: Mapping[str, Any], theta: float, scaling: Any
) -> tuple[tuple[DecoderLayer, ...], Target, int]:
    """What every one-layer Llama EAGLE-3 research format reads the same way: (its layer, from
    `layer` (`layer_kwargs`) and the RoPE read; the target, from vocab_size and
    target_hidden_size; draft_vocab_size)."""
    layers = build_layers(
        1,
        eagle3=True,
        style="llama",
        attention="causal",
        sliding_window=None,
        rope_theta=theta,
        rope_scaling=scaling,
        **layer,
    )
    vocab = integer(config.get("vocab_size", LLAMA_DEFAULTS["vocab_size"]), "vocab_size")
    draft_vocab = integer(required(config, "draft_vocab_size"), "draft_vocab_size")
    target_hidden = config.get("target_hidden_size")
    target = Target(
        num_hidden_layers=None,
        hidden_size=layer["hidden_size"]
        if target_hidden is None
        else integer(target_hidden, "target_hidden_size"),
        vocab_size=vocab,
    )
    return layers, target, draft_vocab


def one_layer_eagle3_problems(spec: DrafterSpec, owner: str) -> tuple[DecoderLayer, list[str]]:
    """What every one-layer Llama EAGLE-3 research format fixes: raises for another algorithm or
    layer count; returns the layer and what else it cannot hold (q/k norm, biases, a window)."""
    if spec.algorithm.name != "eagle3":
        raise DrafterError(f"{owner} holds EAGLE-3 drafters only, not {spec.algorithm.name}")
    if len(spec.layers) != 1:
        raise DrafterError(
            f"{owner} EAGLE-3 has exactly one decoder layer; this drafter has {len(spec.layers)}"
        )
    layer = spec.layers[0]
    problems = []
    if layer.style != "llama":
        problems.append(f"layer style {layer.style!r} ({owner}'s layer has no q/k norm)")
    if layer.attention_bias or layer.mlp_bias:
        problems.append("biases in the layer")
    if layer.sliding_window is not None:
        problems.append(f"a sliding window of {layer.sliding_window}")
    return layer, problems
