"""Any mlx-lm model as a speculative-decoding target: one forward returns the logits and the
tapped hidden states, on the model's own modules and KV cache; rejected tokens are rolled back
with the cache API. mlx-lm is not modified: for the length of a forward the entries of the
model's layer list are swapped for recorders that call the real layer (and, in a prefill, its
final norm for one that keeps only the last position, so the head runs on one row), and on the
CPU a forward of several rows computes attention and SwiGLU with woodcock.runtime.cpu_kernels
(installed in the model's attention and MLP modules of the families it knows, used only by this
forward)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import (
    KVCache,
    RotatingKVCache,
    can_trim_prompt_cache,
    make_prompt_cache,
    trim_prompt_cache,
)

from woodcock.errors import DrafterError
from woodcock.ir import DrafterSpec
from woodcock.runtime.cpu_kernels import install_kernels, kernels_in_use

# What mlx-lm's model families call their token embedding, most common first
TOKEN_EMBEDDING_NAMES = (
    "embed_tokens",
    "wte",
    "word_embeddings",
    "tok_embeddings",
    "token_embeddings",
    "embed_in",
    "embeddings",
    "embedding",
    "embed",
)


# Where mlx-lm's model args state the longest context, by family
CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")


class _Recorder:
    """Stands in for one decoder layer during a forward: calls it, keeps its input and/or output.
    Attribute reads go to the layer (mlx-lm reads e.g. `use_sliding` off its layers)."""

    def __init__(self, layer, keep_input: bool, keep_output: bool):
        self.layer, self.keep_input, self.keep_output = layer, keep_input, keep_output
        self.input = self.output = None

    def __call__(self, x, *args, **kwargs):
        if self.keep_input:
            self.input = x
        out = self.layer(x, *args, **kwargs)
        if self.keep_output:  # some families' layers return (hidden, their cache state...)
            self.output = out[0] if isinstance(out, tuple) else out
        return out

    def __getattr__(self, name):
        return getattr(self.layer, name)


@contextlib.contextmanager
def recording(layers: list, layer_ids: Sequence[int]) -> Iterator[list]:
    """Swap the entries of a model's layer list (in place) for recorders for the length of a
    forward. Once the block has exited, the yielded list holds the tapped states in the
    canonical convention (id 0: the first layer's input, id L: layer L's output), ascending.
    The runtime's target and training's feature runner both record through it."""
    wanted = sorted(set(layer_ids))
    originals = list(layers)
    recorders = [
        _Recorder(layer, keep_input=(i == 0 and 0 in wanted), keep_output=(i + 1) in wanted)
        for i, layer in enumerate(originals)
    ]
    states: list = []
    layers[:] = recorders
    try:
        yield states
    finally:
        layers[:] = originals
    states.extend(recorders[0].input if i == 0 else recorders[i - 1].output for i in wanted)
    if any(state is None for state in states):
        raise DrafterError(
            "the model's forward did not run its decoder layers from the list they were tapped"
            " in: its hidden states cannot be read"
        )


def decoder_layers(model: nn.Module) -> list:
    """The list the model's forward runs its decoder layers from, whose entries `recording`
    swaps. `model.layers` is that list in most mlx-lm families; in others it is a copy (the
    pipeline-parallel families' slice) and the list is the one inside the model holding the
    same layers."""
    layers = model.layers
    for _, module in model.named_modules():
        for value in module.values():
            if (
                isinstance(value, list)
                and len(value) == len(layers)
                and all(a is b for a, b in zip(value, layers, strict=True))
            ):
                return value
    return layers


def embedding_module(model: nn.Module) -> nn.Module:
    """The token embedding, by the names mlx-lm's families give it (`embed_tokens`, under a
    multimodal wrapper's language model too; gpt2's `wte` beside its position embedding), else
    the embedding with the most rows."""
    found = [
        (name.split(".")[-1], module)
        for name, module in model.named_modules()
        if isinstance(module, nn.Embedding | nn.QuantizedEmbedding)
    ]
    named = [(TOKEN_EMBEDDING_NAMES.index(n), m) for n, m in found if n in TOKEN_EMBEDDING_NAMES]
    if named:
        return min(named, key=lambda ranked: ranked[0])[1]
    if not found:
        raise DrafterError("the model has no token embedding (nn.Embedding) to read")
    return max((module for _, module in found), key=lambda module: module.weight.shape[0])


class _LastPosition:
    """Stands in for a model's final norm: applies it to the last position only."""

    def __init__(self, norm):
        self.norm = norm

    def __call__(self, x):
        return self.norm(x[..., -1:, :])


@contextlib.contextmanager
def head_on_last_position(model: nn.Module) -> Iterator[None]:
    """For the length of a forward (a prefill's), `model.model.norm` (mlx-lm's name for the
    final norm, the one module between the last layer and the head) is swapped for a
    _LastPosition, so the logits are those of the last position alone; a model without one is
    left whole (its head then runs on every position)."""
    inner = getattr(model, "model", None)
    norm = getattr(inner, "norm", None) if isinstance(inner, nn.Module) else None
    if not isinstance(norm, nn.Module):
        yield
        return
    inner.norm = _LastPosition(norm)
    try:
        yield
    finally:
        inner.norm = norm


def _rollback_cache(model: nn.Module) -> list:
    """mlx-lm's cache for the model, with every rotating (sliding-window) layer cache replaced by
    a plain one: a rotating cache that has wrapped cannot drop rejected tokens, and the window
    is applied by the attention mask, not by the cache, so the output is the same (the sliding
    layers then keep every key, at the memory of a full layer)."""
    return [KVCache() if isinstance(c, RotatingKVCache) else c for c in make_prompt_cache(model)]


class MlxTarget:
    """model: an mlx-lm model (`mlx_lm.load`), layer_ids: canonical tap ids (residual stream after
    L decoder layers; L = 0 the embedding output, L = N the last layer's output before the final
    norm)."""

    def __init__(self, model: nn.Module, layer_ids: Sequence[int], name: str = "target"):
        self.model, self.name = model, name
        self.layers = decoder_layers(model)  # the model's own list: entries are swapped
        self.num_layers = len(self.layers)
        bad = [i for i in layer_ids if not 0 <= i <= self.num_layers]
        if bad or list(layer_ids) != sorted(set(layer_ids)):
            raise DrafterError(
                f"{name}: tap ids {list(layer_ids)} must be ascending ids in [0,"
                f" {self.num_layers}] (the target has {self.num_layers} layers)"
            )
        self.layer_ids = tuple(layer_ids)
        install_kernels(model)
        self.cache = _rollback_cache(model)
        if not can_trim_prompt_cache(self.cache):
            kinds = sorted({type(c).__name__ for c in self.cache})
            raise DrafterError(
                f"{name}: its KV cache ({', '.join(kinds)}) cannot be rolled back, and"
                " speculative decoding must drop rejected tokens"
            )

    @property
    def context_length(self) -> int | None:
        """The longest context the model's args state, or None."""
        args = getattr(self.model, "args", None)
        value = next((getattr(args, n) for n in CONTEXT_FIELDS if getattr(args, n, None)), None)
        return int(value) if value else None

    @property
    def offset(self) -> int:
        """Tokens in the KV cache."""
        return self.cache[0].offset

    def reset(self) -> None:
        self.cache = _rollback_cache(self.model)

    def forward(self, tokens: mx.array) -> tuple[mx.array, mx.array]:
        """tokens [T] after the cached ones -> (logits [T, V], taps [T, A*Ht], ascending ids).
        Lazy: nothing is evaluated here."""
        logits, taps = self.forward_rows(tokens[None], self.cache)
        return logits[0], taps[0]

    def prefill(self, tokens: mx.array) -> tuple[mx.array, mx.array]:
        """tokens [T] after the cached ones -> (the last position's logits [V], taps [T, A*Ht]).
        Lazy. The model's final norm, and so its head, sees only the last position: the head
        over every prompt position is wasted work (on a CPU 6-12 % of the default target's
        prefill, 18-19 % for Qwen3-0.6B's shape) and memory (a [T, V] array a chunk)."""
        with head_on_last_position(self.model):
            logits, taps = self.forward(tokens)
        return logits[-1], taps

    def forward_rows(self, tokens: mx.array, cache: list) -> tuple[mx.array, mx.array]:
        """tokens [B, T] after those `cache` holds (the model's cache list: this target's own,
        or a woodcock.runtime.batch one) -> (logits [B, T, V], taps [B, T, A*Ht]). Lazy."""
        several_on_cpu = tokens.size > 1 and mx.default_device().type == mx.cpu
        with recording(self.layers, self.layer_ids) as states, kernels_in_use(several_on_cpu):
            logits = self.model(tokens, cache=cache)
        if not states:  # a drafter that reads no hidden states (n-gram)
            return logits, mx.zeros((*tokens.shape, 0))
        return logits, mx.concatenate(states, axis=-1)

    def truncate(self, length: int) -> bool:
        """Keep the first `length` cached tokens (a prefix the next prompt shares), drop the
        rest. False, with the cache emptied, where a rotating cache that has wrapped around
        cannot drop them."""
        if not 0 <= length <= self.offset:
            raise DrafterError(
                f"{self.name}: cannot keep {length} tokens of a cache holding {self.offset}"
            )
        dropped = self.offset - length
        if dropped and trim_prompt_cache(self.cache, dropped) != dropped:
            self.reset()
            return False
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and trim_prompt_cache(self.cache, num_tokens) != num_tokens:
            raise DrafterError(
                f"{self.name}: its KV cache refused to drop {num_tokens} tokens (a rotating"
                " cache that has wrapped around cannot roll back)"
            )

    # -- what a drafter takes from its target ----------------------------------------------

    @property
    def hidden_size(self) -> int:
        return int(self._embedding().shape[1])

    @property
    def vocab_size(self) -> int:
        return int(self._embedding().shape[0])

    def _embedding(self) -> mx.array:
        return _dequantized(embedding_module(self.model))

    def shared_tensors(self) -> dict[str, np.ndarray]:
        """{"embed_tokens.weight", "lm_head.weight"} [V, Ht] as numpy (the head is the embedding
        when the target ties them)."""
        embedding = self._embedding()
        heads = [m for name, m in self.model.named_modules() if name.split(".")[-1] == "lm_head"]
        if len(heads) == 1:
            head = _dequantized(heads[0])
        elif not heads and getattr(getattr(self.model, "args", None), "tie_word_embeddings", 1):
            head = embedding
        else:
            raise DrafterError(
                f"{self.name}: its head is not one `lm_head` and it does not tie its head to its"
                " embedding: a drafter that shares the target's head cannot be given it"
            )
        return {
            "embed_tokens.weight": np.array(embedding.astype(mx.float32)),
            "lm_head.weight": np.array(head.astype(mx.float32)),
        }

    def check_fits(self, spec: DrafterSpec) -> None:
        """Refuse a drafter built for another target shape before any token is generated."""
        facts = (
            ("vocab size", spec.target.vocab_size, self.vocab_size),
            ("hidden size", spec.target.hidden_size, self.hidden_size),
        )
        for what, drafter_value, target_value in facts:
            if drafter_value != target_value:
                raise DrafterError(
                    f"the drafter was built for a target {what} of {drafter_value}; {self.name}"
                    f" has {target_value}"
                )
        layers = spec.target.num_hidden_layers
        if layers is not None and layers != self.num_layers:
            raise DrafterError(
                f"the drafter was built for a target with {layers} layers; {self.name} has"
                f" {self.num_layers}"
            )


def _dequantized(module: nn.Module) -> mx.array:
    """An embedding's or linear layer's weight [rows, columns], dequantized where quantized."""
    if hasattr(module, "scales"):
        return mx.dequantize(
            module.weight, module.scales, module.biases, module.group_size, module.bits
        )
    return module.weight
