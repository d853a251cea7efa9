"""What a drafter needs from its target's checkpoint directory: the facts in config.json and the
tensors a drafter may share (token embedding, LM head). Read without torch or transformers."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from woodcock.default_target import cache_dir
from woodcock.errors import DrafterError
from woodcock.ir import Drafter, Target
from woodcock.jsonfile import read_json_object
from woodcock.loading import resolve_source
from woodcock.tensorfile import read_checkpoint

# MLX and mlx-lm are imported by the functions that build MLX arrays or models: reading and
# converting drafters works without loading them.

EMBEDDING_SUFFIXES = ("embed_tokens.weight", "tok_embeddings.weight", "llm.embed.weight")
HEAD_NAMES = ("lm_head.weight", "output.weight", "llm.unembed.weight")


def _text_config(config: dict) -> dict:
    """Multimodal configs keep the language model's facts under text_config."""
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def target_from_config(source: str | Path) -> Target:
    path = resolve_source(source)
    config_path = path / "config.json"
    config = read_json_object(config_path)
    text = _text_config(config)
    facts = {}
    for key in ("num_hidden_layers", "hidden_size", "vocab_size"):
        if not isinstance(text.get(key), int):
            raise DrafterError(f"{config_path}: {key} = {text.get(key)!r}: expected an integer")
        facts[key] = text[key]
    architectures = config.get("architectures") or []
    return Target(name_or_path=str(source), architectures=tuple(architectures), **facts)


def load_target_tensors(source: str | Path) -> dict[str, np.ndarray]:
    """{"embed_tokens.weight": [V, Ht], "lm_head.weight": [V, Ht]}, memory-mapped; the LM head is
    the embedding when the target ties them (no separate head tensor)."""
    path = resolve_source(source)
    embedding = head = None
    for name, array in read_checkpoint(path).items():
        if embedding is None and name.endswith(EMBEDDING_SUFFIXES):
            embedding = array
        if head is None and name.endswith(HEAD_NAMES):
            head = array
    if embedding is None:
        raise DrafterError(
            f"{path}: no token embedding among the target's tensors"
            f" (looked for names ending in {', '.join(EMBEDDING_SUFFIXES)})"
        )
    return {"embed_tokens.weight": embedding, "lm_head.weight": embedding if head is None else head}


def drafter_arrays(
    drafter: Drafter, target_tensors: Mapping | None, head_rows: np.ndarray | None = None
) -> dict:
    """Every tensor a runtime needs, by canonical name: the drafter's own weights plus what it
    shares with the target (`load_target_tensors` or the MLX target's arrays): the embedding
    [V, H], and the head's rows of the draft vocabulary [Vd, H]. head_rows: keep only these
    draft rows of the head, own or shared (a truncated head). Only the kept rows of a (maybe
    memory-mapped) target head are read."""
    spec = drafter.spec
    arrays = dict(drafter.weights)
    shape = (spec.target.vocab_size, spec.hidden_size)
    for part, name in (("embedding", "embed_tokens.weight"), ("lm_head", "lm_head.weight")):
        if getattr(spec.head, part) != "shared":
            continue
        if target_tensors is None or name not in target_tensors:
            raise DrafterError(
                f"target_tensors[{name!r}] missing: the drafter's {part} is shared with the"
                " target; pass load_target_tensors(target_dir) (--target)"
            )
        if tuple(target_tensors[name].shape) != shape:
            raise DrafterError(
                f"target_tensors[{name!r}].shape = {tuple(target_tensors[name].shape)}:"
                f" expected {shape}"
                " (target vocab, drafter hidden size)"
            )
        arrays[name] = target_tensors[name]
    target_ids = drafter.vocab.target_ids(spec)
    if spec.head.lm_head == "shared" and (
        head_rows is not None or drafter.vocab.draft_to_target is not None
    ):
        rows = target_ids if head_rows is None else target_ids[head_rows]
        arrays["lm_head.weight"] = _take_rows(arrays["lm_head.weight"], rows)
    elif head_rows is not None:
        arrays["lm_head.weight"] = _take_rows(arrays["lm_head.weight"], head_rows)
    return arrays


def _take_rows(array, rows: np.ndarray):
    if isinstance(array, np.ndarray):
        return array[rows]
    import mlx.core as mx

    return array[mx.array(rows)]


def load_mlx_target(source: str | Path):
    """(model, tokenizer) of an mlx-lm target by directory or Hugging Face id. The id is
    resolved here first, so that one that cannot be fetched is a one-line DrafterError naming
    it, not whatever mlx-lm's own download raises."""
    from mlx_lm import load

    path = resolve_source(source)
    if path.exists() and not path.is_dir():
        raise DrafterError(f"{source}: is a file; expected an mlx-lm model directory")
    if not path.is_dir():
        raise DrafterError(f"{source}: no such target directory (expected an mlx-lm model)")
    if not (path / "config.json").is_file():
        raise DrafterError(f"{path / 'config.json'}: missing; expected an mlx-lm model directory")
    read_json_object(path / "config.json")  # an object, or one line saying what it is
    try:
        return load(str(path))
    except (RuntimeError, ValueError, KeyError, TypeError, AttributeError) as e:
        # mlx-lm's own loader on a damaged model: a truncated weights file, a config it cannot
        # build the model from; the user's input either way
        detail = str(e).splitlines()[0] if str(e) else ""
        hint = ""
        if cache_dir().resolve() in path.resolve().parents:
            hint = "; woodcock made it in its cache: remove it to convert it again"
        raise DrafterError(
            f"{path}: mlx-lm cannot load it: {type(e).__name__}: {detail}{hint}"
        ) from None
