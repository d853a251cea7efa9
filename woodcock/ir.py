"""The canonical drafter IR: the one in-memory description every format reads into and writes from.

A `Drafter` is a `DrafterSpec` (every architectural fact, no arrays), a `VocabMap` (draft id ->
target id) and `Weights` (name -> array, one naming scheme, checked against the spec). Every
dataclass is frozen and validated on construction; anything inconsistent raises `DrafterError`
naming the field, the value and what was expected. Nothing has a silent default when read from
disk: `spec_from_dict` requires every key.

Canonical tensor names (those speculators and vLLM use; `DrafterSpec.tensor_shapes` is the
complete list for a given spec). H = draft hidden size, Ht = target hidden size, A = number of
taps, V = target vocab, Vd = draft vocab, r = Markov rank:

    fc_norm.{j}.weight [Ht]          per-tap RMSNorm            (fusion.tap_norm == "per_tap")
    input_norm.weight [A*Ht]         one RMSNorm over the concat (fusion.tap_norm == "concat")
    fc.weight [H, A*Ht], fc.bias [H]
    hidden_norm.weight [H]           RMSNorm after fc (DFlash/DSpark, fusion.hidden_norm)
    layers.{l}.hidden_norm.weight [H]   EAGLE-3 first layer only (input "embed_and_hidden")
    layers.{l}.{input_layernorm,post_attention_layernorm}.weight [H]
    layers.{l}.self_attn.{q,k,v,o}_proj.{weight,bias}, .{q,k}_norm.weight [head_dim] (qwen3)
    layers.{l}.mlp.{gate,up,down}_proj.{weight,bias}
    norm.weight [H]                  final norm (part of the head)
    lm_head.weight [Vd, H]           unless the head is shared with the target
    embed_tokens.weight [V, H]       unless the embedding is shared with the target
    markov_head.markov_w1.weight [V, r], markov_head.markov_w2.weight [Vd, r]
    markov_head.gate_proj.{weight [r, H+r], bias [r]}         (gated)
    markov_head.joint_proj.{weight [3r, 2r+H], bias [3r]}     (rnn)
    confidence_head.proj.{weight [1, H(+r)], bias [1]}
"""

from __future__ import annotations

import contextlib
import functools
import math
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from types import NoneType, UnionType
from typing import Any, ClassVar, Literal

import numpy as np

from woodcock.errors import DrafterError
from woodcock.tensorfile import FLOAT_DTYPES, dtype_name

# Inside Woodcock a layer id always means this; formats that count otherwise convert on read/write.
CANONICAL_LAYER_CONVENTION = "after_layers"

ROPE_TYPES = ("linear", "dynamic", "yarn", "longrope", "llama3")
# What each scaled RoPE cannot be computed without: transformers' required keys
# (modeling_rope_utils' _validate_*_rope_parameters), less original_max_position_embeddings,
# which transformers fills in from max_position_embeddings.
ROPE_REQUIRED_KEYS = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor",),
    "longrope": ("short_factor", "long_factor"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
}


# ---------------------------------------------------------------------------------------------
# Typed, validated frozen dataclasses and their JSON form


@contextlib.contextmanager
def error_prefix(prefix: str) -> Iterator[None]:
    """Prefix the path of any DrafterError raised inside, so nested errors name the full key."""
    try:
        yield
    except DrafterError as e:
        raise DrafterError(f"{prefix}{e}") from None


def _fail(name: str, value: Any, expected: str) -> typing.NoReturn:
    raise DrafterError(f"{name} = {value!r}: expected {expected}")


def _coerce(value: Any, hint: Any, name: str) -> Any:
    """Check `value` against a type hint; lists become tuples, dicts become dataclasses."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin is Literal:
        if not any(value == a and type(value) is type(a) for a in args):
            _fail(name, value, "one of " + ", ".join(repr(a) for a in args))
        return value
    if origin in (UnionType, typing.Union):
        if value is None:
            if NoneType in args:
                return None
            _fail(name, value, "a value, not null")
        options = [a for a in args if a is not NoneType]
        if all(is_dataclass(a) for a in options):
            return _coerce_variant(value, options, name)
        (single,) = options
        return _coerce(value, single, name)
    if hint is bool:
        if not isinstance(value, bool):
            _fail(name, value, "true or false")
        return value
    if hint is int:
        if not isinstance(value, int) or isinstance(value, bool):
            _fail(name, value, "an integer")
        return value
    if hint is float:
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            _fail(name, value, "a finite number")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            _fail(name, value, "a string")
        return value
    if origin is tuple:
        if not isinstance(value, list | tuple):
            _fail(name, value, "a list")
        return tuple(_coerce(v, args[0], f"{name}[{i}]") for i, v in enumerate(value))
    if origin is dict or hint is dict:
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            _fail(name, value, "an object with string keys")
        return dict(value)
    if is_dataclass(hint):
        if isinstance(value, hint):
            return value
        if isinstance(value, Mapping):
            return from_dict(hint, value, name)
        _fail(name, value, f"an object ({hint.__name__})")
    raise TypeError(f"unsupported type hint {hint!r} for {name}")


def _coerce_variant(value: Any, options: list[type], name: str) -> Any:
    """A tagged union of dataclasses, told apart by their `name` class attribute."""
    if isinstance(value, tuple(options)):
        return value
    by_name = {cls.name: cls for cls in options}
    if not isinstance(value, Mapping) or value.get("name") not in by_name:
        tag = value.get("name") if isinstance(value, Mapping) else value
        _fail(f"{name}.name", tag, "one of " + ", ".join(repr(n) for n in by_name))
    body = {k: v for k, v in value.items() if k != "name"}
    return from_dict(by_name[value["name"]], body, name)


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


class Validated:
    """Frozen-dataclass base: type-check every field after construction, then `validate()`."""

    def __post_init__(self) -> None:
        hints = _type_hints(type(self))
        for f in fields(self):
            coerced = _coerce(getattr(self, f.name), hints[f.name], f.name)
            object.__setattr__(self, f.name, coerced)
        self.validate()

    def validate(self) -> None:
        pass


def from_dict(cls: type, data: Mapping[str, Any], where: str = "") -> Any:
    """Build a dataclass from its JSON form. Every field is required and unknown keys are errors:
    a file that leaves a fact out must not be read with a default in its place."""
    names = [f.name for f in fields(cls)]
    at = f"{where}: " if where else ""
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise DrafterError(f"{at}unknown key(s) {', '.join(unknown)}; expected {', '.join(names)}")
    missing = [n for n in names if n not in data]
    if missing:
        raise DrafterError(f"{at}missing key(s) {', '.join(missing)}")
    hints = _type_hints(cls)
    prefix = f"{where}." if where else ""
    values = {n: _coerce(data[n], hints[n], prefix + n) for n in names}
    with error_prefix(prefix):
        return cls(**values)


def to_dict(obj: Any) -> Any:
    """The JSON form of a dataclass tree (tagged unions carry their `name`)."""
    if is_dataclass(obj):
        out = {"name": obj.name} if isinstance(getattr(type(obj), "name", None), str) else {}
        out.update({f.name: to_dict(getattr(obj, f.name)) for f in fields(obj)})
        return out
    if isinstance(obj, tuple | list):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def _positive(name: str, value: int) -> None:
    if value <= 0:
        _fail(name, value, "a positive integer")


# ---------------------------------------------------------------------------------------------
# The spec


@dataclass(frozen=True)
class Target(Validated):
    """The target model a drafter serves, as far as the drafter depends on it.

    num_hidden_layers is None when the drafter's format does not record it (speculators does
    not); tap ids are then checked against it once a target is given.
    """

    num_hidden_layers: int | None
    hidden_size: int
    vocab_size: int
    name_or_path: str | None = None
    architectures: tuple[str, ...] = ()

    def validate(self) -> None:
        for name in ("num_hidden_layers", "hidden_size", "vocab_size"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))


@dataclass(frozen=True)
class Taps(Validated):
    """Which target hidden states the drafter reads.

    Layer id L means the target's residual stream after L decoder layers, before the final norm:
    id 0 is the embedding output, id N (N = number of target layers) the last layer's output
    before the final norm. It equals Hugging Face `hidden_states[L]` for L < N (HF applies the
    final norm to `hidden_states[N]`). vLLM, speculators, SafeAILab EAGLE and llama.cpp count this
    way; SGLang/SpecForge, z-lab DFlash and DeepSpec store "output of layer i", which is id i+1
    here. Ids are strictly ascending: the tapped states are concatenated low to high.
    """

    layer_ids: tuple[int, ...]
    convention: Literal["after_layers"] = CANONICAL_LAYER_CONVENTION

    def validate(self) -> None:
        if not self.layer_ids:
            _fail("layer_ids", list(self.layer_ids), "at least one tapped layer")
        for i in range(1, len(self.layer_ids)):
            if self.layer_ids[i] <= self.layer_ids[i - 1]:
                _fail("layer_ids", list(self.layer_ids), "strictly ascending ids")


@dataclass(frozen=True)
class Fusion(Validated):
    """How the tapped states become one H-wide state: optional norm, fc, optional norm.

    tap_norm: "per_tap" = one RMSNorm per tapped state (speculators `fc_norm`), "concat" = one
    RMSNorm over the whole concatenation (`norm_before_fc`), "none". The two are exclusive by
    construction. hidden_norm: DFlash/DSpark's RMSNorm on the fc output.
    """

    tap_norm: Literal["none", "per_tap", "concat"]
    fc_bias: bool
    hidden_norm: bool


@dataclass(frozen=True)
class DecoderLayer(Validated):
    """One draft decoder layer.

    style: "llama", or "qwen3" (RMSNorm on each head of q and k before RoPE).
    input: "embed_and_hidden" = EAGLE-3's first layer, whose attention reads
    [RMSNorm(embedding) ; RMSNorm(hidden)] (2H wide, embedding half first); "hidden" = plain.
    attention: "causal" (EAGLE-3 chain), or inside a DFlash/DSpark block "block_bidirectional"
    / "block_causal" (context keys are always visible up to the anchor).
    sliding_window: keys further back than this many positions are not attended; None = all.
    rope_scaling: Hugging Face's rope_scaling object (with rope_type) or None for plain RoPE.
    """

    style: Literal["llama", "qwen3"]
    input: Literal["embed_and_hidden", "hidden"]
    attention: Literal["causal", "block_bidirectional", "block_causal"]
    sliding_window: int | None
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: Literal["silu"] = "silu"

    def validate(self) -> None:
        for name in (
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            _positive(name, getattr(self, name))
        if self.sliding_window is not None:
            _positive("sliding_window", self.sliding_window)
        if self.num_attention_heads % self.num_key_value_heads:
            _fail(
                "num_key_value_heads",
                self.num_key_value_heads,
                f"a divisor of num_attention_heads ({self.num_attention_heads})",
            )
        if self.head_dim % 2:
            _fail("head_dim", self.head_dim, "an even number (RoPE rotates pairs)")
        if self.rms_norm_eps <= 0:
            _fail("rms_norm_eps", self.rms_norm_eps, "a positive number")
        if self.rope_theta <= 0:
            _fail("rope_theta", self.rope_theta, "a positive number")
        if self.rope_scaling is not None:
            _check_rope_scaling(self.rope_scaling)


def _check_rope_scaling(scaling: dict[str, Any]) -> None:
    rope_type = scaling.get("rope_type")
    if rope_type not in ROPE_TYPES:
        _fail(
            "rope_scaling.rope_type",
            rope_type,
            f"one of {', '.join(ROPE_TYPES)} (plain RoPE is rope_scaling = null)",
        )
    for key in ROPE_REQUIRED_KEYS[rope_type]:
        value = scaling.get(key)
        if key in ("short_factor", "long_factor"):
            ok, expected = isinstance(value, list) and all(map(_finite, value)), "a list of numbers"
        else:
            ok, expected = _finite(value), "a number"
        if not ok:
            _fail(f"rope_scaling.{key}", value, f"{expected} (rope_type {rope_type!r} needs it)")


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class Head(Validated):
    """The output side: final norm (always the drafter's own `norm.weight`), then lm_head.

    "shared" means the tensor is not part of the drafter: it is the target's (for lm_head, the
    target's rows of the draft vocabulary) and is filled from the target at run time.
    """

    lm_head: Literal["own", "shared"]
    embedding: Literal["own", "shared"]


@dataclass(frozen=True)
class Eagle3(Validated):
    """EAGLE-3 chain drafting.

    norm_before_residual: the first layer's residual is the normalised hidden state, not the raw.
    norm_output: feed the post-final-norm state back to the next step (EAGLE-3.1), not the
    pre-norm one. speculative_tokens: the chain length the checkpoint recommends. The number of
    layers is `len(DrafterSpec.layers)`.
    """

    name: ClassVar[str] = "eagle3"
    norm_before_residual: bool
    norm_output: bool
    speculative_tokens: int = 3

    def validate(self) -> None:
        _positive("speculative_tokens", self.speculative_tokens)


@dataclass(frozen=True)
class DFlash(Validated):
    """DFlash block drafting: one pass over [anchor, MASK x (block_size - 1)].

    sample_from_anchor: True = all block_size slots are drafts (slot k predicts position p+k+1);
    False = slot 0 is the anchor and slots 1..block_size-1 predict their own positions.
    mask_token_id is a target-vocabulary id.
    """

    name: ClassVar[str] = "dflash"
    block_size: int
    mask_token_id: int
    sample_from_anchor: bool

    @property
    def num_drafts(self) -> int:
        return self.block_size if self.sample_from_anchor else self.block_size - 1

    def validate(self) -> None:
        if self.num_drafts < 1:
            _fail("block_size", self.block_size, "room for at least one draft slot")
        if self.mask_token_id < 0:
            _fail("mask_token_id", self.mask_token_id, "a target token id")


@dataclass(frozen=True)
class DSpark(DFlash):
    """DSpark: DFlash plus a Markov head (bias from the previous token, rank markov_rank; 0 = off)
    and an optional confidence head (per-slot acceptance estimate), whose input includes the
    Markov features when confidence_head_with_markov (kept as stored, inert without the head)."""

    name: ClassVar[str] = "dspark"
    markov_head_type: Literal["vanilla", "gated", "rnn"]
    markov_rank: int
    confidence_head: bool
    confidence_head_with_markov: bool

    def validate(self) -> None:
        super().validate()
        if self.markov_rank < 0:
            _fail("markov_rank", self.markov_rank, "0 (no Markov head) or a positive rank")
        if self.confidence_head and self.confidence_head_with_markov and self.markov_rank == 0:
            _fail("confidence_head_with_markov", True, "false when markov_rank is 0")


Algorithm = Eagle3 | DFlash | DSpark


@dataclass(frozen=True)
class DrafterSpec(Validated):
    """Everything about a drafter except its arrays."""

    algorithm: Eagle3 | DFlash | DSpark
    target: Target
    taps: Taps
    fusion: Fusion
    layers: tuple[DecoderLayer, ...]
    head: Head
    draft_vocab_size: int

    @property
    def hidden_size(self) -> int:
        return self.layers[0].hidden_size

    @property
    def is_block(self) -> bool:
        return isinstance(self.algorithm, DFlash)

    def validate(self) -> None:
        n, vocab = self.target.num_hidden_layers, self.target.vocab_size
        for i, layer_id in enumerate(self.taps.layer_ids):
            if layer_id < 0 or (n is not None and layer_id > n):
                _fail(
                    f"taps.layer_ids[{i}]",
                    layer_id,
                    "a non-negative id"
                    if n is None
                    else f"an id in [0, {n}] (the target has {n} layers; id L = residual stream"
                    " after L layers)",
                )
        if not self.layers:
            _fail("layers", [], "at least one decoder layer")
        hidden = self.hidden_size
        for i, layer in enumerate(self.layers):
            if layer.hidden_size != hidden:
                _fail(f"layers[{i}].hidden_size", layer.hidden_size, f"{hidden} like layers[0]")
        if not 1 <= self.draft_vocab_size <= vocab:
            _fail("draft_vocab_size", self.draft_vocab_size, f"a size in [1, {vocab}]")
        for part in ("lm_head", "embedding"):
            if getattr(self.head, part) == "shared" and self.target.hidden_size != hidden:
                _fail(
                    f"head.{part}",
                    "shared",
                    f"'own': the target's hidden size {self.target.hidden_size} differs from"
                    f" the drafter's {hidden}",
                )
        if isinstance(self.algorithm, Eagle3):
            self._validate_eagle3()
        else:
            self._validate_block()

    def _validate_eagle3(self) -> None:
        if self.fusion.hidden_norm:
            _fail("fusion.hidden_norm", True, "false for EAGLE-3 (its first layer has hidden_norm)")
        for i, layer in enumerate(self.layers):
            wanted = "embed_and_hidden" if i == 0 else "hidden"
            if layer.input != wanted:
                _fail(f"layers[{i}].input", layer.input, f"{wanted!r} in an EAGLE-3 drafter")
            if layer.attention != "causal":
                _fail(f"layers[{i}].attention", layer.attention, "'causal' in an EAGLE-3 drafter")

    def _validate_block(self) -> None:
        algorithm = self.algorithm
        for i, layer in enumerate(self.layers):
            if layer.input != "hidden":
                _fail(f"layers[{i}].input", layer.input, "'hidden' in a block drafter")
            if layer.attention == "causal":
                _fail(
                    f"layers[{i}].attention",
                    layer.attention,
                    "'block_bidirectional' or 'block_causal' in a block drafter",
                )
        context = self.layers[0].max_position_embeddings
        if algorithm.block_size > context:
            _fail(
                "algorithm.block_size",
                algorithm.block_size,
                f"at most the layers' context, max_position_embeddings = {context}",
            )
        if algorithm.mask_token_id >= self.target.vocab_size:
            _fail(
                "algorithm.mask_token_id",
                algorithm.mask_token_id,
                f"a target token id below {self.target.vocab_size}",
            )

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the drafter carries, by canonical name, with its exact shape."""
        h, ht = self.hidden_size, self.target.hidden_size
        vocab, draft_vocab, taps = (
            self.target.vocab_size,
            self.draft_vocab_size,
            len(self.taps.layer_ids),
        )
        shapes: dict[str, tuple[int, ...]] = {}
        if self.fusion.tap_norm == "per_tap":
            shapes.update({f"fc_norm.{j}.weight": (ht,) for j in range(taps)})
        elif self.fusion.tap_norm == "concat":
            shapes["input_norm.weight"] = (taps * ht,)
        shapes["fc.weight"] = (h, taps * ht)
        if self.fusion.fc_bias:
            shapes["fc.bias"] = (h,)
        if self.fusion.hidden_norm:
            shapes["hidden_norm.weight"] = (h,)
        for i, layer in enumerate(self.layers):
            shapes.update(_layer_shapes(f"layers.{i}.", layer))
        shapes["norm.weight"] = (h,)
        if self.head.lm_head == "own":
            shapes["lm_head.weight"] = (draft_vocab, h)
        if self.head.embedding == "own":
            shapes["embed_tokens.weight"] = (vocab, h)
        algorithm = self.algorithm
        if isinstance(algorithm, DSpark):
            rank = algorithm.markov_rank
            if rank:
                shapes["markov_head.markov_w1.weight"] = (vocab, rank)
                shapes["markov_head.markov_w2.weight"] = (draft_vocab, rank)
                if algorithm.markov_head_type == "gated":
                    shapes["markov_head.gate_proj.weight"] = (rank, h + rank)
                    shapes["markov_head.gate_proj.bias"] = (rank,)
                elif algorithm.markov_head_type == "rnn":
                    shapes["markov_head.joint_proj.weight"] = (3 * rank, 2 * rank + h)
                    shapes["markov_head.joint_proj.bias"] = (3 * rank,)
            if algorithm.confidence_head:
                width = h + rank if algorithm.confidence_head_with_markov else h
                shapes["confidence_head.proj.weight"] = (1, width)
                shapes["confidence_head.proj.bias"] = (1,)
        return shapes


def _layer_shapes(prefix: str, layer: DecoderLayer) -> dict[str, tuple[int, ...]]:
    h, hd = layer.hidden_size, layer.head_dim
    q_width, kv_width = layer.num_attention_heads * hd, layer.num_key_value_heads * hd
    width_in = 2 * h if layer.input == "embed_and_hidden" else h
    shapes: dict[str, tuple[int, ...]] = {}
    if layer.input == "embed_and_hidden":
        shapes[prefix + "hidden_norm.weight"] = (h,)
    shapes[prefix + "input_layernorm.weight"] = (h,)
    attention = {"q_proj": (q_width, width_in), "k_proj": (kv_width, width_in)}
    attention |= {"v_proj": (kv_width, width_in), "o_proj": (h, q_width)}
    for name, shape in attention.items():
        shapes[f"{prefix}self_attn.{name}.weight"] = shape
        if layer.attention_bias:
            shapes[f"{prefix}self_attn.{name}.bias"] = shape[:1]
    if layer.style == "qwen3":
        shapes[prefix + "self_attn.q_norm.weight"] = (hd,)
        shapes[prefix + "self_attn.k_norm.weight"] = (hd,)
    shapes[prefix + "post_attention_layernorm.weight"] = (h,)
    mlp = {"gate_proj": (layer.intermediate_size, h), "up_proj": (layer.intermediate_size, h)}
    mlp["down_proj"] = (h, layer.intermediate_size)
    for name, shape in mlp.items():
        shapes[f"{prefix}mlp.{name}.weight"] = shape
        if layer.mlp_bias:
            shapes[f"{prefix}mlp.{name}.bias"] = shape[:1]
    return shapes


def spec_to_dict(spec: DrafterSpec) -> dict[str, Any]:
    return to_dict(spec)


def spec_from_dict(data: Mapping[str, Any]) -> DrafterSpec:
    return from_dict(DrafterSpec, data)


# ---------------------------------------------------------------------------------------------
# Arrays


def _read_only(array: np.ndarray) -> np.ndarray:
    view = array.view()
    view.flags.writeable = False
    return view


@dataclass(frozen=True, eq=False)
class VocabCounts:
    """How often each target token occurred in a corpus (int64 [target vocab]), and what is known
    about that corpus (source, token total, hold-out coverage by head size, ...)."""

    counts: np.ndarray
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        counts = self.counts
        if not isinstance(counts, np.ndarray) or counts.ndim != 1 or counts.dtype.kind not in "iu":
            _fail("vocab.counts", getattr(counts, "shape", counts), "a 1-D integer array")
        if counts.size and counts.min() < 0:
            _fail("vocab.counts", int(counts.min()), "non-negative counts")
        object.__setattr__(self, "counts", _read_only(counts.astype(np.int64, copy=False)))
        object.__setattr__(self, "info", dict(self.info))


@dataclass(frozen=True, eq=False)
class VocabMap:
    """Draft id -> target id, as absolute target ids (`draft_to_target[i]` is the target id of
    draft row i), strictly ascending. None when the draft vocabulary is the target's. The offset
    `d2t` and the mask `t2d` of speculators/SafeAILab are produced and read by the formats."""

    draft_to_target: np.ndarray | None = None
    counts: VocabCounts | None = None

    def __post_init__(self) -> None:
        ids = self.draft_to_target
        if ids is None:
            return
        if not isinstance(ids, np.ndarray) or ids.ndim != 1 or ids.dtype.kind not in "iu":
            _fail("vocab.draft_to_target", getattr(ids, "shape", ids), "a 1-D integer array")
        object.__setattr__(self, "draft_to_target", _read_only(ids.astype(np.int64, copy=False)))

    def check(self, spec: DrafterSpec) -> None:
        vocab, draft_vocab = spec.target.vocab_size, spec.draft_vocab_size
        ids = self.draft_to_target
        if ids is None:
            if draft_vocab != vocab:
                _fail(
                    "vocab.draft_to_target",
                    None,
                    f"a map of {draft_vocab} target ids: the draft vocab ({draft_vocab}) is"
                    f" smaller than the target's ({vocab}) and an identity map would be wrong",
                )
        else:
            if draft_vocab == vocab:
                _fail("vocab.draft_to_target", "an array", "none: the draft vocab is the target's")
            if ids.shape != (draft_vocab,):
                _fail("vocab.draft_to_target.shape", ids.shape, f"({draft_vocab},)")
            bad = np.flatnonzero((ids < 0) | (ids >= vocab))
            if bad.size:
                i = int(bad[0])
                _fail(f"vocab.draft_to_target[{i}]", int(ids[i]), f"a target id in [0, {vocab})")
            steps = np.flatnonzero(np.diff(ids) <= 0)
            if steps.size:
                i = int(steps[0]) + 1
                what = "repeats" if ids[i] == ids[i - 1] else "comes after"
                _fail(
                    f"vocab.draft_to_target[{i}]",
                    int(ids[i]),
                    f"strictly ascending, unique target ids"
                    f" ({what} {int(ids[i - 1])} at [{i - 1}])",
                )
        if self.counts is not None and self.counts.counts.shape != (vocab,):
            _fail("vocab.counts.shape", self.counts.counts.shape, f"({vocab},): one per target id")

    def target_ids(self, spec: DrafterSpec) -> np.ndarray:
        """The target id of every draft row, identity included."""
        if self.draft_to_target is None:
            return np.arange(spec.draft_vocab_size, dtype=np.int64)
        return self.draft_to_target


FINITE_CHECK_SLICE = 1 << 24  # elements


class Weights(Mapping[str, np.ndarray]):
    """Read-only name -> array mapping. Arrays are kept as given: views of a memory-mapped file
    stay views, so a multi-gigabyte drafter is never copied just by loading it."""

    def __init__(self, tensors: Mapping[str, np.ndarray]):
        self._tensors = {}
        for name, array in tensors.items():
            if not isinstance(array, np.ndarray):
                raise DrafterError(f"weights[{name!r}]: expected a numpy array, got {type(array)}")
            self._tensors[name] = _read_only(array)

    def __getitem__(self, name: str) -> np.ndarray:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def __repr__(self) -> str:
        return f"Weights({len(self)} tensors)"

    def check(self, expected: Mapping[str, tuple[int, ...]]) -> None:
        missing = sorted(set(expected) - set(self._tensors))
        if missing:
            raise DrafterError(f"weights: missing tensor(s) {', '.join(missing)}")
        unexpected = sorted(set(self._tensors) - set(expected))
        if unexpected:
            raise DrafterError(
                f"weights: unexpected tensor(s) {', '.join(unexpected)} (not part of this spec)"
            )
        for name, shape in expected.items():
            array = self._tensors[name]
            if array.shape != shape:
                _fail(f"weights[{name!r}].shape", array.shape, f"{shape} from the spec")
            if dtype_name(array) not in FLOAT_DTYPES:
                _fail(f"weights[{name!r}].dtype", str(array.dtype), "a floating-point dtype")

    def refuse_non_finite(self, where: str) -> None:
        """A tensor holding inf or nan is a broken drafter (its acceptance collapses without
        an error): refused, naming the first. Read in slices, so a memory-mapped drafter is
        never held in memory twice."""
        for name, array in self._tensors.items():
            flat = array.reshape(-1)
            for start in range(0, flat.size, FINITE_CHECK_SLICE):
                if not np.isfinite(flat[start : start + FINITE_CHECK_SLICE]).all():
                    raise DrafterError(
                        f"{where}: tensor {name!r} holds inf or nan values; expected finite weights"
                    )

    @property
    def dtypes(self) -> dict[str, int]:
        """safetensors dtype name -> number of tensors of that dtype."""
        counts: dict[str, int] = {}
        for array in self._tensors.values():
            counts[dtype_name(array)] = counts.get(dtype_name(array), 0) + 1
        return counts


@dataclass(frozen=True, eq=False)
class Drafter:
    """A complete drafter: spec, vocabulary map and weights, checked against each other."""

    spec: DrafterSpec
    vocab: VocabMap
    weights: Weights

    def __post_init__(self) -> None:
        if not isinstance(self.weights, Weights):
            object.__setattr__(self, "weights", Weights(self.weights))
        self.vocab.check(self.spec)
        self.weights.check(self.spec.tensor_shapes())

    def parameter_counts(self) -> dict[str, int]:
        """Parameters the drafter carries ("own") and those it takes from the target ("shared")."""
        spec, h = self.spec, self.spec.hidden_size
        shared = 0
        if spec.head.embedding == "shared":
            shared += spec.target.vocab_size * h
        if spec.head.lm_head == "shared":
            shared += spec.draft_vocab_size * h
        return {"own": sum(int(a.size) for a in self.weights.values()), "shared": shared}
