"""The torch reference forward of every drafter the IR describes: EAGLE-3 chains, DFlash blocks,
DSpark blocks with Markov and confidence heads.

It is the oracle other runtimes are checked against, so it is written for exactness and
readability, not speed: one unbatched sequence, explicit boolean masks, one Markov slot at a
time. Semantics: speculators 0.9.0's model classes (the PyPI release:
speculators/models/eagle3/core.py, dflash/core.py, dspark/core.py and their model_definitions.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import torch
from torch import nn

from woodcock.errors import DrafterError
from woodcock.ir import DecoderLayer as LayerSpec
from woodcock.ir import DFlash, Drafter, DSpark, Eagle3
from woodcock.reference.layers import DecoderLayer, RMSNorm
from woodcock.target_checkpoint import drafter_arrays

Tensor = torch.Tensor


@dataclass
class DraftOutput:
    logits: Tensor  # [T, Vd]
    hidden: Tensor  # [T, H]


@dataclass
class DraftResult:
    tokens: Tensor  # [n] target ids
    logits: Tensor  # [n, Vd] (for DSpark: with the Markov bias)
    confidence: Tensor | None  # [n] probabilities, DSpark with a confidence head only


@dataclass
class KVCache:
    """EAGLE-3 rows already run: per layer keys (after k_norm and RoPE) and values, each
    [nkv, S, hd], and the position of each of the S rows (the same for every layer). Row order is
    the causal order: a row sees every row stored before it. The first `context` rows carry
    target features; the rest are chain rows of the current drafting round."""

    keys: list[Tensor]
    values: list[Tensor]
    positions: Tensor  # [S] int64
    context: int = 0

    def __len__(self) -> int:
        return int(self.positions.shape[0])

    def truncate(self, length: int) -> None:
        """Keep the first `length` rows: drop rejected chain rows before appending accepted ones."""
        self.keys = [k[:, :length] for k in self.keys]
        self.values = [v[:, :length] for v in self.values]
        self.positions = self.positions[:length]
        self.context = min(self.context, length)


def to_torch(array: np.ndarray, dtype: torch.dtype) -> Tensor:
    """A float numpy array (maybe bfloat16/float8 from ml_dtypes, maybe a read-only memory map)
    as a new torch tensor of `dtype`; the source is only read."""
    if array.dtype == ml_dtypes.bfloat16:
        # Same bits, no rounding on the way: bf16 -> torch.bfloat16 through a uint16 view.
        bits = np.ascontiguousarray(array).view(np.uint16).copy()
        tensor = torch.from_numpy(bits).view(torch.bfloat16)
    elif array.dtype in (np.float16, np.float32, np.float64):
        tensor = torch.from_numpy(np.array(array, copy=True))
    else:
        # float8 kinds: exact in fp32.
        tensor = torch.from_numpy(np.asarray(array, dtype=np.float32))
    return tensor.to(dtype)


class _MarkovHead(nn.Module):
    def __init__(self, algorithm: DSpark, hidden: int, vocab: int, draft_vocab: int):
        super().__init__()
        rank = algorithm.markov_rank
        self.kind = algorithm.markov_head_type
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab, bias=False)
        if self.kind == "gated":
            self.gate_proj = nn.Linear(hidden + rank, rank)
        elif self.kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden, 3 * rank)


class _ConfidenceHead(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(width, 1)


class TorchDrafter(nn.Module):
    """A `Drafter` as a torch module whose state_dict keys are the canonical tensor names.

    target_tensors: {"embed_tokens.weight": [V, H], "lm_head.weight": [V, H]} of the target
    (`woodcock.target_checkpoint.load_target_tensors`), needed when the spec's head shares either.
    """

    def __init__(
        self,
        drafter: Drafter,
        target_tensors: Mapping[str, np.ndarray] | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        spec = drafter.spec
        self.spec = spec
        self.dtype = dtype
        self.draft_to_target = torch.from_numpy(drafter.vocab.target_ids(spec).copy()).long()
        arrays = drafter_arrays(drafter, target_tensors)
        state = {name: to_torch(np.asarray(array), dtype) for name, array in arrays.items()}
        # Built on the meta device and filled by assignment: a real vocabulary's embedding is
        # never randomly initialised or held twice.
        with torch.device("meta"):
            self._build()
        self.load_state_dict(state, strict=True, assign=True)
        # An inference oracle: no autograd graph, and tensors convert straight to numpy.
        self.requires_grad_(False)
        self.eval()

    # -- construction ----------------------------------------------------------------------

    def _build(self) -> None:
        spec = self.spec
        h, ht = spec.hidden_size, spec.target.hidden_size
        taps = len(spec.taps.layer_ids)
        eps = spec.layers[0].rms_norm_eps
        fusion = spec.fusion
        if fusion.tap_norm == "per_tap":
            self.fc_norm = nn.ModuleList(RMSNorm(ht, eps) for _ in range(taps))
        elif fusion.tap_norm == "concat":
            self.input_norm = RMSNorm(taps * ht, eps)
        self.fc = nn.Linear(taps * ht, h, bias=fusion.fc_bias)
        if fusion.hidden_norm:
            self.hidden_norm = RMSNorm(h, eps)
        self.layers = nn.ModuleList(DecoderLayer(layer) for layer in spec.layers)
        self.norm = RMSNorm(h, eps)
        self.lm_head = nn.Linear(h, spec.draft_vocab_size, bias=False)
        self.embed_tokens = nn.Embedding(spec.target.vocab_size, h)
        algorithm = spec.algorithm
        if isinstance(algorithm, DSpark):
            if algorithm.markov_rank:
                self.markov_head = _MarkovHead(
                    algorithm, h, spec.target.vocab_size, spec.draft_vocab_size
                )
            if algorithm.confidence_head:
                with_markov = algorithm.confidence_head_with_markov
                self.confidence_head = _ConfidenceHead(
                    h + algorithm.markov_rank if with_markov else h
                )

    # -- shared pieces ---------------------------------------------------------------------

    def _check(self, name: str, tensor: Tensor, shape: tuple) -> None:
        """shape: ints, or None for any size along that axis."""
        ok = tensor.dim() == len(shape) and all(
            want is None or got == want for got, want in zip(tensor.shape, shape, strict=True)
        )
        if not ok:
            expected = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise DrafterError(f"{name}.shape = {list(tensor.shape)}: expected {expected}")

    def _to_target(self, draft_ids: Tensor) -> Tensor:
        return self.draft_to_target[draft_ids]

    @torch.no_grad()
    def fuse(self, taps: Tensor) -> Tensor:
        """taps [T, A*Ht] (ascending layer ids) -> fused features [T, H]."""
        spec = self.spec
        width = len(spec.taps.layer_ids) * spec.target.hidden_size
        self._check("taps", taps, (None, width))
        x = taps.to(self.dtype)
        if spec.fusion.tap_norm == "per_tap":
            chunks = x.split(spec.target.hidden_size, dim=-1)
            x = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks, strict=True)], dim=-1)
        elif spec.fusion.tap_norm == "concat":
            x = self.input_norm(x)
        x = self.fc(x)
        if spec.fusion.hidden_norm:
            x = self.hidden_norm(x)
        return x

    # -- EAGLE-3 ---------------------------------------------------------------------------

    def _eagle3(self) -> Eagle3:
        if not isinstance(self.spec.algorithm, Eagle3):
            raise DrafterError(f"algorithm = {self.spec.algorithm.name!r}: expected 'eagle3'")
        return self.spec.algorithm

    def new_cache(self) -> KVCache:
        empty = [
            torch.empty(layer.num_key_value_heads, 0, layer.head_dim, dtype=self.dtype)
            for layer in self.spec.layers
        ]
        return KVCache(
            keys=list(empty), values=list(empty), positions=torch.empty(0, dtype=torch.long)
        )

    @staticmethod
    def _eagle3_visible(
        layer: LayerSpec, cache: KVCache, key_pos: Tensor, pos: Tensor, chain: bool
    ) -> Tensor:
        """[T, S+T]: causal in row order. A sliding window limits context keys only, counted back
        from the query's position for context rows, and from the last context row's position
        for chain rows (speculators' training mask: a chain step sees the same context window
        as the row that started the chain, and every chain row before it)."""
        rows, keys = pos.shape[0], key_pos.shape[0]
        visible = torch.arange(keys)[None, :] <= (len(cache) + torch.arange(rows))[:, None]
        if layer.sliding_window is None:
            return visible
        if not chain:
            return visible & (key_pos[None, :] > pos[:, None] - layer.sliding_window)
        is_context = torch.arange(keys) < cache.context
        start = cache.positions[cache.context - 1] - layer.sliding_window
        return visible & (~is_context | (key_pos > start))[None, :]

    @torch.no_grad()
    def eagle3_forward(
        self,
        input_ids: Tensor,
        hidden: Tensor,
        positions: Tensor,
        cache: KVCache,
        *,
        chain: bool = False,
    ) -> DraftOutput:
        """T new rows after the cached ones: token ids [T] (target ids), hidden [T, H] (fused
        features or fed-back states), positions [T]. Their K/V are appended to `cache`.
        chain=False: context rows (target features), only after other context rows;
        chain=True: drafting-round rows after the context."""
        algorithm = self._eagle3()
        rows = input_ids.shape[0]
        self._check("input_ids", input_ids, (None,))
        self._check("hidden", hidden, (rows, self.spec.hidden_size))
        self._check("positions", positions, (rows,))
        if chain and cache.context == 0:
            raise DrafterError("eagle3_forward(chain=True): the cache holds no context rows")
        if not chain and cache.context != len(cache):
            raise DrafterError(
                "eagle3_forward: context rows after chain rows; truncate the chain rows first"
            )
        positions = positions.long()
        key_pos = torch.cat((cache.positions, positions))
        embeds = self.embed_tokens(input_ids.long())
        x = hidden.to(self.dtype)
        visible_by_window = {}
        for i, layer in enumerate(self.layers):
            window = layer.config.sliding_window
            if window not in visible_by_window:
                visible_by_window[window] = self._eagle3_visible(
                    layer.config, cache, key_pos, positions, chain
                )
            cos, sin = layer.rope(positions, self.dtype)
            x, k, v = layer(
                x,
                cos,
                sin,
                visible_by_window[window],
                prefix=(cache.keys[i], cache.values[i]),
                embeds=embeds if i == 0 else None,
                norm_before_residual=algorithm.norm_before_residual,
            )
            cache.keys[i] = torch.cat((cache.keys[i], k), dim=1)
            cache.values[i] = torch.cat((cache.values[i], v), dim=1)
        cache.positions = key_pos
        if not chain:
            cache.context = len(cache)
        normed = self.norm(x)
        # EAGLE-3.1 (norm_output) feeds the post-norm state back; classic EAGLE-3 the pre-norm.
        fed_back = normed if algorithm.norm_output else x
        return DraftOutput(logits=self.lm_head(normed), hidden=fed_back)

    @torch.no_grad()
    def eagle3_draft(self, taps: Tensor, tokens: Tensor, num_steps: int) -> DraftResult:
        """Greedy chain. taps [P, A*Ht] = g_0..g_{P-1}; tokens [P+1] = x_0..x_P (x_P the bonus
        token). Step 1 runs rows t = 1..P (token x_t, hidden fuse(g_{t-1}), position t); step
        j >= 2 one row (previous draft, previous fed-back state, position P + j - 1)."""
        self._eagle3()
        prompt = taps.shape[0]
        if prompt < 1 or num_steps < 1:
            raise DrafterError(
                f"eagle3_draft: {prompt} context rows, {num_steps} steps: expected at least one"
            )
        self._check("tokens", tokens, (prompt + 1,))
        cache = self.new_cache()
        out = self.eagle3_forward(tokens[1:], self.fuse(taps), torch.arange(1, prompt + 1), cache)
        logits, drafted = [out.logits[-1]], [self._to_target(out.logits[-1].argmax())]
        for step in range(2, num_steps + 1):
            position = torch.tensor([prompt + step - 1])
            out = self.eagle3_forward(
                drafted[-1][None], out.hidden[-1:], position, cache, chain=True
            )
            logits.append(out.logits[-1])
            drafted.append(self._to_target(out.logits[-1].argmax()))
        return DraftResult(torch.stack(drafted), torch.stack(logits), None)

    # -- DFlash / DSpark -------------------------------------------------------------------

    def _block(self) -> DFlash:
        if not isinstance(self.spec.algorithm, DFlash):
            raise DrafterError(
                f"algorithm = {self.spec.algorithm.name!r}: expected 'dflash' or 'dspark'"
            )
        return self.spec.algorithm

    @staticmethod
    def _block_visible(layer: LayerSpec, context_pos: Tensor, anchor: Tensor, size: int) -> Tensor:
        """[B, p + B]: context keys before the anchor (and inside the window counted back from
        the anchor, the same for every slot); block keys all, or up to the slot itself."""
        context = context_pos < anchor
        if layer.sliding_window is not None:
            context = context & (context_pos >= anchor - layer.sliding_window)
        block = torch.ones(size, size, dtype=torch.bool)
        if layer.attention == "block_causal":
            block = block.tril()
        return torch.cat((context[None, :].expand(size, -1), block), dim=1)

    @torch.no_grad()
    def block_forward(
        self,
        context: Tensor,
        context_positions: Tensor,
        block_ids: Tensor,
        block_positions: Tensor,
    ) -> DraftOutput:
        """One block pass. context [p, H] (fused, `fuse(taps)`), context_positions [p],
        block_ids [B] target ids, block_positions [B] (the first is the anchor's position).
        Returns the backbone logits [B, Vd] (no Markov bias) and the post-norm states [B, H]."""
        self._block()
        size = block_ids.shape[0]
        self._check("context", context, (None, self.spec.hidden_size))
        self._check("context_positions", context_positions, (context.shape[0],))
        self._check("block_ids", block_ids, (None,))
        self._check("block_positions", block_positions, (size,))
        context_positions, block_positions = context_positions.long(), block_positions.long()
        c = context.to(self.dtype)
        x = self.embed_tokens(block_ids.long())
        anchor = block_positions[0]
        for layer in self.layers:
            visible = self._block_visible(layer.config, context_positions, anchor, size)
            # The same normalised context feeds every layer as extra keys/values (no
            # input_layernorm, never updated); k_norm applies to its keys too.
            context_kv = layer.self_attn.keys_values(c, *layer.rope(context_positions, self.dtype))
            cos, sin = layer.rope(block_positions, self.dtype)
            x, _, _ = layer(x, cos, sin, visible, prefix=context_kv)
        hidden = self.norm(x)
        return DraftOutput(logits=self.lm_head(hidden), hidden=hidden)

    def _markov_slot(
        self, hidden: Tensor, logits: Tensor, prev: Tensor, state: Tensor | None
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """One slot: hidden [1, H], logits [1, Vd], prev [1] target id, rnn state [1, r] ->
        (logits with the bias [1, Vd], confidence [1] or None, next rnn state)."""
        algorithm = self.spec.algorithm
        if not isinstance(algorithm, DSpark):
            return logits, None, state
        prev_emb = None
        if algorithm.markov_rank:
            head = self.markov_head
            prev_emb = head.markov_w1(prev.long())  # [1, r], indexed by TARGET id
            if head.kind == "vanilla":
                bias = head.markov_w2(prev_emb)
            elif head.kind == "gated":
                gate = torch.sigmoid(head.gate_proj(torch.cat((hidden, prev_emb), dim=-1)))
                bias = head.markov_w2(gate * prev_emb)
            else:
                joint = head.joint_proj(torch.cat((state, prev_emb, hidden), dim=-1))
                gate_raw, candidate, out = joint.chunk(3, dim=-1)
                gate = torch.sigmoid(gate_raw)
                # The bias reads the state before this slot's update.
                state = gate * state + (1.0 - gate) * torch.tanh(candidate)
                bias = head.markov_w2(torch.tanh(out))
            logits = logits + bias
        confidence = None
        if algorithm.confidence_head:
            features = hidden
            if algorithm.confidence_head_with_markov:
                features = torch.cat((hidden, prev_emb), dim=-1)
            confidence = torch.sigmoid(self.confidence_head.proj(features)).squeeze(-1)
        return logits, confidence, state

    def _initial_state(self) -> Tensor | None:
        algorithm = self.spec.algorithm
        if isinstance(algorithm, DSpark) and algorithm.markov_head_type == "rnn":
            return torch.zeros(1, algorithm.markov_rank, dtype=self.dtype)
        return None

    @torch.no_grad()
    def markov_heads(
        self, hidden: Tensor, logits: Tensor, prev_ids: Tensor
    ) -> tuple[Tensor, Tensor | None]:
        """Teacher-forced DSpark heads over one block: hidden [B, H] (post-norm), logits [B, Vd]
        (backbone), prev_ids [B] target ids of the token before each slot's prediction ->
        (logits + Markov bias [B, Vd], confidence [B] or None). The rnn state runs over the slots
        in order. DFlash (no heads): the logits unchanged and None."""
        self._block()
        size = hidden.shape[0]
        self._check("hidden", hidden, (size, self.spec.hidden_size))
        self._check("logits", logits, (size, self.spec.draft_vocab_size))
        self._check("prev_ids", prev_ids, (size,))
        hidden, logits = hidden.to(self.dtype), logits.to(self.dtype)
        state = self._initial_state()
        out, confidence = [], []
        for k in range(size):
            row, conf, state = self._markov_slot(
                hidden[k : k + 1], logits[k : k + 1], prev_ids[k : k + 1], state
            )
            out.append(row)
            confidence.append(conf)
        if confidence[0] is None:
            return torch.cat(out), None
        return torch.cat(out), torch.cat(confidence)

    @torch.no_grad()
    def block_draft(self, taps: Tensor, anchor_id: int | Tensor) -> DraftResult:
        """Greedy block drafting. taps [p, A*Ht] are the context at positions 0..p-1; the anchor
        (the verifier's bonus token, a target id) sits at position p, followed by B-1 MASK
        tokens. sample_from_anchor: slots 0..B-1 are drafts for p+1..p+B; otherwise slots
        1..B-1 are drafts for p+1..p+B-1 and slot 0 is only run. The Markov head conditions each
        slot on the token before the one it predicts (the anchor, then the drafts so far)."""
        algorithm = self._block()
        context = self.fuse(taps)
        prompt, size = context.shape[0], algorithm.block_size
        anchor = torch.as_tensor(anchor_id, dtype=torch.long).reshape(1)
        block_ids = torch.cat((anchor, torch.full((size - 1,), algorithm.mask_token_id)))
        out = self.block_forward(
            context, torch.arange(prompt), block_ids, torch.arange(prompt, prompt + size)
        )
        first = 0 if algorithm.sample_from_anchor else 1
        prev, state = anchor, self._initial_state()
        tokens, logits, confidence = [], [], []
        for k in range(size):
            row, conf, state = self._markov_slot(
                out.hidden[k : k + 1], out.logits[k : k + 1], prev, state
            )
            token = self._to_target(row[0].argmax()).reshape(1)
            if k >= first:
                tokens.append(token)
                logits.append(row)
                confidence.append(conf)
                # Slot 0 without sample_from_anchor predicts the anchor itself: its guess is not
                # the previous token of slot 1, the anchor is.
                prev = token
        confidence_out = None if confidence[0] is None else torch.cat(confidence)
        return DraftResult(torch.cat(tokens), torch.cat(logits), confidence_out)
