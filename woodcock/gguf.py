"""GGUF to mlx-lm: `convert_gguf` turns a llama-architecture GGUF with a gpt2-style byte-level
BPE vocabulary that `mx.load` can read (F32/F16/Q4_0/Q4_1/Q8_0 tensors; MLX casts other types to
fp16) into an fp32 mlx-lm `llama` directory. Every weight is dequantized to fp32 (on the MLX CPU
backend quantized and half-precision matmuls cost linearly in the number of query rows, which
makes verifying k drafted tokens as slow as k decode steps), renamed to mlx-lm's parameter names,
and the q/k rows that llama.cpp permutes for its interleaved RoPE are put back in Hugging Face
order, so the result is a plain llama checkpoint (`rope_traditional` false) whose q/k projections
match the original model's. The tokenizer is rebuilt with the `tokenizers` library from the GGUF's
vocabulary, merges, token types and pre-tokenizer name; the chat template is copied from the GGUF
metadata.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from woodcock.errors import DrafterError

# Every `woodcock` start-up imports this module (through default_target): MLX, tokenizers and
# rich are imported in the functions that convert, not here.

# Part of the default target's cache key: bump it whenever the converted output changes.
CONVERTER_VERSION = 1

# llama.cpp GGUF tensor names -> mlx-lm llama parameter names.
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# MLX keeps Q4_0/Q4_1/Q8_0 as affine quantization with blocks of 32 along the input dimension.
_GGUF_GROUP_SIZE = 32

# llama.cpp pre-tokenizer names (tokenizer.ggml.pre) whose split is the GPT-2 regex applied
# after isolating every digit (llama-vocab.cpp: the STARCODER/SMOLLM/... case), and those that
# use the GPT-2 regex alone.
_PRE_DIGITS_THEN_GPT2 = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"}
_PRE_GPT2 = {"default", "gpt-2", "gpt2", "mpt", "olmo", "jais"}

# GGUF token types (llama.cpp llama_token_type).
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4


def convert_gguf(
    gguf_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    progress: bool = False,
    label: str | None = None,
) -> Path:
    """Write an mlx-lm `llama` directory for a llama GGUF into `out_dir` (created if missing):
    config.json, model.safetensors (fp32) and tokenizer.json + tokenizer_config.json.
    Returns `out_dir`. Use `staging.staged_directory` around it for an all-or-nothing result."""
    import mlx.core as mx

    gguf_path = Path(gguf_path)
    out = Path(out_dir)
    try:
        tensors, meta = mx.load(str(gguf_path), return_metadata=True)
    except (OSError, RuntimeError, ValueError) as exc:
        raise DrafterError(f"{gguf_path}: cannot read it as GGUF: {exc}") from None
    meta = {key: _plain(value) for key, value in meta.items()}
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise DrafterError(
            f"{gguf_path}: general.architecture is {arch!r}; only 'llama' can be converted"
        )
    config = llama_config(meta, tensors, source=gguf_path)
    groups = _tensor_groups(tensors, source=gguf_path)
    out.mkdir(parents=True, exist_ok=True)

    with _progress_bar(progress) as bar:
        task = bar.add_task(f"converting {label or gguf_path.name}", total=len(groups) + 2)
        weights: dict[str, Any] = {}
        for gguf_name, parts in groups.items():
            name, tensor = _convert_tensor(gguf_name, parts, config, source=gguf_path)
            mx.eval(tensor)
            weights[name] = tensor
            bar.advance(task)
        mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
        del weights
        bar.advance(task)
        tokenizer_config = write_tokenizer(meta, out, source=gguf_path)
        bar.advance(task)

    config.update(
        {
            key: tokenizer_config[f"_{key}"]
            for key in ("bos_token_id", "eos_token_id", "pad_token_id")
            if tokenizer_config.get(f"_{key}") is not None
        }
    )
    for key in [key for key in tokenizer_config if key.startswith("_")]:
        del tokenizer_config[key]
    _write_json(out / "tokenizer_config.json", tokenizer_config)
    _write_json(out / "config.json", config)
    return out


def llama_config(meta: dict[str, Any], tensors: dict[str, Any], *, source: Path) -> dict:
    """A Hugging Face / mlx-lm llama config.json from the GGUF metadata."""

    def need(key: str) -> Any:
        value = meta.get(f"llama.{key}")
        if value is None:
            raise DrafterError(f"{source}: metadata key llama.{key} is missing")
        return value

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    kv_heads = int(meta.get("llama.attention.head_count_kv") or heads)
    head_dim = int(meta.get("llama.attention.key_length") or hidden // heads)
    rope_dims = int(meta.get("llama.rope.dimension_count") or head_dim)
    if rope_dims != head_dim:
        raise DrafterError(
            f"{source}: llama.rope.dimension_count is {rope_dims}, expected the head size"
            f" {head_dim} (partial RoPE is not supported)"
        )
    if "token_embd.weight" not in tensors:
        raise DrafterError(f"{source}: tensor token_embd.weight is missing")
    vocab = meta.get("tokenizer.ggml.tokens")
    vocab_size = int(meta.get("llama.vocab_size") or (len(vocab) if vocab else 0))
    if not vocab_size:
        vocab_size = int(tensors["token_embd.weight"].shape[0])

    rope_scaling = None
    scaling_type = meta.get("llama.rope.scaling.type")
    if scaling_type not in (None, "none"):
        factor = meta.get("llama.rope.scaling.factor")
        if scaling_type != "linear" or factor is None:
            raise DrafterError(
                f"{source}: llama.rope.scaling.type is {scaling_type!r}; only 'linear' (with"
                " llama.rope.scaling.factor) is supported"
            )
        rope_scaling = {"type": "linear", "factor": float(factor)}

    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": int(need("block_count")),
        "intermediate_size": int(need("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(meta.get("llama.attention.layer_norm_rms_epsilon") or 1e-5),
        "vocab_size": vocab_size,
        "max_position_embeddings": int(meta.get("llama.context_length") or 2048),
        "rope_theta": float(meta.get("llama.rope.freq_base") or 10000.0),
        "rope_traditional": False,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in tensors,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "torch_dtype": "float32",
        "use_cache": True,
    }


def _tensor_groups(tensors: dict[str, Any], *, source: Path) -> dict[str, dict[str, Any]]:
    """GGUF tensors grouped by parameter: 'blk.0.attn_q.weight' -> {'weight', 'scales',
    'biases'}, with the quantization parts under the weight's name."""
    groups: dict[str, dict[str, Any]] = {}
    for key in sorted(tensors, key=_natural_key):
        stem, _, part = key.rpartition(".")
        if part in ("scales", "biases"):
            groups.setdefault(f"{stem}.weight", {})[part] = tensors[key]
        elif part in ("weight", "bias"):
            groups.setdefault(key, {})["value"] = tensors[key]
        else:
            raise DrafterError(f"{source}: unexpected tensor {key}")
    for key, parts in groups.items():
        if "value" not in parts:
            raise DrafterError(f"{source}: tensor {key} is missing (only its scales/biases)")
    return groups


def _natural_key(name: str) -> list:
    return [int(piece) if piece.isdigit() else piece for piece in name.split(".")]


def _mlx_name(gguf_name: str, *, source: Path) -> str:
    stem, _, suffix = gguf_name.rpartition(".")
    pieces = stem.split(".")
    if len(pieces) == 1 and stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    if len(pieces) == 3 and pieces[0] == "blk" and pieces[1].isdigit():
        if pieces[2] in _LAYER_NAMES:
            return f"model.layers.{pieces[1]}.{_LAYER_NAMES[pieces[2]]}.{suffix}"
    raise DrafterError(f"{source}: unexpected tensor {gguf_name} for a llama model")


def _convert_tensor(
    gguf_name: str, parts: dict[str, Any], config: dict, *, source: Path
) -> tuple[str, Any]:
    """Rename, dequantize to fp32 and (for q/k) un-permute one parameter."""
    import mlx.core as mx

    value = parts["value"]
    if "scales" in parts:
        if "biases" not in parts:
            raise DrafterError(f"{source}: {gguf_name} has scales but no biases")
        scales = parts["scales"]
        in_features = scales.shape[-1] * _GGUF_GROUP_SIZE
        bits, rest = divmod(value.shape[-1] * 32, in_features)
        if rest or bits not in (2, 3, 4, 5, 6, 8):
            raise DrafterError(
                f"{source}: {gguf_name} has packed shape {tuple(value.shape)} and scales"
                f" {tuple(scales.shape)}, which is no {_GGUF_GROUP_SIZE}-wide affine quantization"
            )
        value = mx.dequantize(
            value,
            scales.astype(mx.float32),
            parts["biases"].astype(mx.float32),
            group_size=_GGUF_GROUP_SIZE,
            bits=bits,
        )
    value = value.astype(mx.float32)
    stem = gguf_name.rpartition(".")[0]
    if stem.endswith(".attn_q"):
        value = unpermute_qk(value, config["num_attention_heads"])
    elif stem.endswith(".attn_k"):
        value = unpermute_qk(value, config["num_key_value_heads"])
    return _mlx_name(gguf_name, source=source), value


def unpermute_qk(weight: Any, heads: int) -> Any:
    """Undo llama.cpp's q/k row permutation. Its converter stores each head's rows as
    (pairs, 2) interleaved for GPT-J-style RoPE, i.e. hf.reshape(heads, 2, d/2, ...)
    .swapaxes(1, 2); this puts the rows back in Hugging Face (rotate-half) order. Works for
    weights (rows, in) and bias vectors (rows,)."""
    rows = weight.shape[0]
    head_dim = rows // heads
    rest = tuple(weight.shape[1:])
    return weight.reshape(heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


# --- tokenizer -----------------------------------------------------------------------------


def write_tokenizer(meta: dict[str, Any], out: Path, *, source: Path) -> dict:
    """Build tokenizer.json from the GGUF's byte-level BPE and return the tokenizer_config.json
    content (with the special token ids under private '_' keys for config.json)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise DrafterError(
            f"{source}: tokenizer.ggml.model is {kind!r}; only 'gpt2' (byte-level BPE) can be"
            " converted"
        )
    tokens = meta.get("tokenizer.ggml.tokens")
    merges = meta.get("tokenizer.ggml.merges")
    if not tokens or merges is None:
        raise DrafterError(f"{source}: tokenizer.ggml.tokens or tokenizer.ggml.merges is missing")
    vocab = {token: index for index, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise DrafterError(f"{source}: tokenizer.ggml.tokens has duplicate entries")
    pairs = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not sep or not left or not right:
            raise DrafterError(f"{source}: tokenizer.ggml.merges entry {merge!r} is not 'a b'")
        pairs.append((left, right))

    pre = meta.get("tokenizer.ggml.pre") or "default"
    prefix_space = bool(meta.get("tokenizer.ggml.add_space_prefix") or False)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=prefix_space, use_regex=True)
    if pre in _PRE_DIGITS_THEN_GPT2:
        pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif pre in _PRE_GPT2:
        pre_tokenizer = byte_level
    else:
        raise DrafterError(
            f"{source}: tokenizer.ggml.pre is {pre!r}; supported: "
            + ", ".join(sorted(_PRE_DIGITS_THEN_GPT2 | _PRE_GPT2))
        )

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()

    types = meta.get("tokenizer.ggml.token_type")
    types = list(types) if types is not None else [1] * len(tokens)
    special = [t for t, kind in zip(tokens, types, strict=True) if kind == _TOKEN_CONTROL]
    user = [t for t, kind in zip(tokens, types, strict=True) if kind == _TOKEN_USER_DEFINED]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])

    def token_of(key: str) -> tuple[int | None, str | None]:
        index = meta.get(f"tokenizer.ggml.{key}_token_id")
        if index is None:
            return None, None
        index = int(index)
        if not 0 <= index < len(tokens):
            raise DrafterError(
                f"{source}: tokenizer.ggml.{key}_token_id is {index}, outside the vocabulary"
                f" of {len(tokens)}"
            )
        return index, tokens[index]

    bos_id, bos = token_of("bos")
    eos_id, eos = token_of("eos")
    pad_id, pad = token_of("padding")
    _, unk = token_of("unknown")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token") or False) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token") or False) and eos is not None
    if add_bos or add_eos:
        first = [bos] if add_bos else []
        last = [eos] if add_eos else []
        tokenizer.post_processor = processors.TemplateProcessing(
            single=" ".join([*first, "$A", *last]),
            pair=" ".join([*first, "$A", *last, *first, "$B:1", *last]),
            special_tokens=[(t, vocab[t]) for t in dict.fromkeys(first + last)],
        )
    for token in (bos, eos, pad, unk):
        if token is not None and tokenizer.token_to_id(token) != vocab[token]:
            raise DrafterError(f"{source}: special token {token!r} lost its id")
    tokenizer.save(str(out / "tokenizer.json"))

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.get("llama.context_length") or 2048),
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": pad,
        "unk_token": unk,
        "additional_special_tokens": [t for t in special if t not in (bos, eos, pad, unk)],
    }
    template = meta.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    config = {key: value for key, value in config.items() if value is not None}
    config.update({"_bos_token_id": bos_id, "_eos_token_id": eos_id, "_pad_token_id": pad_id})
    return config


# --- helpers ------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """GGUF metadata as Python values: 0-d arrays become scalars, 1-d arrays lists; float32
    scalars keep their shortest decimal form (1e-05, not 9.999999747378752e-06)."""
    import mlx.core as mx

    if not hasattr(value, "tolist"):
        return value
    if value.ndim == 0 and value.dtype == mx.float32:
        return float(str(np.float32(value.item())))
    return value.tolist()


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def stderr_console():
    from rich.console import Console

    return Console(stderr=True)


class _NoProgress:
    def __enter__(self) -> _NoProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def add_task(self, *args: object, **kwargs: object) -> int:
        return 0

    def advance(self, *args: object, **kwargs: object) -> None:
        return None


def _progress_bar(enabled: bool):
    if not enabled:
        return _NoProgress()
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=stderr_console(),
        transient=True,
    )
