"""DFlash and DSpark block drafters on MLX: the torch reference's function
(`TorchDrafter.fuse`, `block_forward`, `markov_heads`, `block_draft`), shaped for the speculative
decoding loop (`woodcock.runtime.decode.RuntimeDrafter`).

State between rounds: a per-layer cache of the context's keys and values (after k_norm and
RoPE), one row per verified position 0..p-1, and the anchor (the token at position p, not yet
run through the target). `add_context` fuses the new rows' tapped states once and appends their
keys/values to every layer's cache; the rows are never recomputed. `propose` runs one block
[anchor, MASK x (B-1)] at positions p..p+B-1 through all layers, reading the cached context
keys (a sliding window reads only the last W of them), then samples the draft slots in order:
for DSpark each slot's logits get the Markov bias of the token before the one it predicts. The
block's own keys are written to the cache rows after the context as scratch and dropped, so a
proposal leaves the cache as it found it. Nothing here synchronises: every result is lazy and
the loop evaluates it together with the target's work.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from woodcock.errors import DrafterError
from woodcock.ir import DFlash, Drafter, DrafterSpec, DSpark
from woodcock.runtime.batch import RowCache
from woodcock.runtime.layers import (
    DecoderLayer,
    KVCache,
    RMSNorm,
    TransposedLinear,
    rms_norm,
    to_mx,
    transpose_linears,
)
from woodcock.target_checkpoint import drafter_arrays

Sampler = Callable[[mx.array], mx.array]


class MarkovHead(nn.Module):
    """DSpark's low-rank bias from the previous token (canonical names under markov_head.)."""

    def __init__(self, algorithm: DSpark, hidden: int, vocab: int, draft_vocab: int):
        super().__init__()
        rank = algorithm.markov_rank
        self.kind = algorithm.markov_head_type
        self.markov_w1 = nn.Embedding(vocab, rank)  # indexed by TARGET id
        self.markov_w2 = nn.Linear(rank, draft_vocab, bias=False)
        if self.kind == "gated":
            self.gate_proj = nn.Linear(hidden + rank, rank)
        elif self.kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden, 3 * rank)


class ConfidenceHead(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(width, 1)


class BlockModel(nn.Module):
    """The drafter's modules under their canonical names, so `load_weights` needs no renames."""

    def __init__(self, spec: DrafterSpec):
        super().__init__()
        h, ht = spec.hidden_size, spec.target.hidden_size
        taps = len(spec.taps.layer_ids)
        eps = spec.layers[0].rms_norm_eps
        fusion = spec.fusion
        if fusion.tap_norm == "per_tap":
            self.fc_norm = [RMSNorm(ht, eps) for _ in range(taps)]
        elif fusion.tap_norm == "concat":
            self.input_norm = RMSNorm(taps * ht, eps)
        self.fc = nn.Linear(taps * ht, h, bias=fusion.fc_bias)
        if fusion.hidden_norm:
            self.hidden_norm = RMSNorm(h, eps)
        self.layers = [DecoderLayer(layer) for layer in spec.layers]
        self.norm = RMSNorm(h, eps)
        self.lm_head = nn.Linear(h, spec.draft_vocab_size, bias=False)
        self.embed_tokens = nn.Embedding(spec.target.vocab_size, h)
        algorithm = spec.algorithm
        if isinstance(algorithm, DSpark):
            if algorithm.markov_rank:
                self.markov_head = MarkovHead(
                    algorithm, h, spec.target.vocab_size, spec.draft_vocab_size
                )
            if algorithm.confidence_head:
                with_markov = algorithm.confidence_head_with_markov
                self.confidence_head = ConfidenceHead(
                    h + algorithm.markov_rank if with_markov else h
                )


class BlockDrafter:
    """A DFlash or DSpark drafter with a persistent per-layer context cache, driven by
    `add_context` and `propose` (the loop's `Drafter` protocol).

    target_tensors: {"embed_tokens.weight": [V, H], "lm_head.weight": [V, H]} of the target
    (`woodcock.target_checkpoint.load_target_tensors`), needed when the spec's head shares either;
    a shared head keeps the target's rows of the draft vocabulary (`drafter.vocab`).
    """

    def __init__(
        self,
        drafter: Drafter,
        target_tensors: Mapping[str, np.ndarray] | None = None,
        *,
        dtype: mx.Dtype = mx.float32,
    ):
        spec = drafter.spec
        if not isinstance(spec.algorithm, DFlash):
            raise DrafterError(
                f"algorithm = {spec.algorithm.name!r}: expected 'dflash' or 'dspark'"
            )
        self.spec = spec
        self.algorithm: DFlash = spec.algorithm
        self.dtype = dtype
        draft_to_target = drafter.vocab.target_ids(spec)
        arrays = drafter_arrays(drafter, target_tensors)
        self.model = BlockModel(spec)
        self.model.load_weights([(name, to_mx(a, dtype)) for name, a in arrays.items()])
        self.model.eval()
        self._prepare()
        mx.eval(self.model.parameters(), self._fast)
        self.head_target_ids = mx.array(draft_to_target.astype(np.int32))  # [Vd]
        self.num_drafts = self.algorithm.num_drafts
        self._taps_width = len(spec.taps.layer_ids) * spec.target.hidden_size
        self._caches = [KVCache() for _ in spec.layers]
        self.reset()

    def _prepare(self) -> None:
        """Arrays laid out for the proposal's fast paths (`self._fast`); the modules they were
        taken from are dropped, so no weight is held twice. On the CPU backend the projections
        are transposed (x @ W runs about twice as fast as x @ W.T for a block's few rows:
        measured 4.6 vs 11.2 ms for 16 rows through a 576 -> 1536 projection). The heads'
        concatenated inputs are split by weight columns, so their hidden-state part runs once
        for the whole block and only the previous token's part runs slot by slot."""
        model, spec, algorithm = self.model, self.spec, self.algorithm
        h = spec.hidden_size
        fast: dict[str, mx.array] = {}
        # The largest matmul of a proposal.
        fast.update(_head_layout(model.lm_head.weight))
        del model.lm_head
        if spec.fusion.tap_norm == "per_tap":
            fast["tap_norm"] = mx.stack([norm.weight for norm in model.fc_norm])  # [A, Ht]
            fast["ones"] = mx.ones((spec.target.hidden_size,), self.dtype)
        if algorithm.block_size > 1:
            mask = mx.full((algorithm.block_size - 1,), algorithm.mask_token_id, mx.int32)
            fast["mask_rows"] = model.embed_tokens(mask)  # [B - 1, H]
        if isinstance(algorithm, DSpark) and algorithm.markov_rank:
            head, rank = model.markov_head, algorithm.markov_rank
            fast["w1"] = head.markov_w1.weight  # [V, r], indexed by target id
            fast["w2_t"] = mx.contiguous(head.markov_w2.weight.T)  # [r, Vd]
            if head.kind == "gated":
                weight = head.gate_proj.weight  # [r, H + r]: input [hidden ; e]
                fast["gate_h_t"] = mx.contiguous(weight[:, :h].T)
                fast["gate_e_t"] = mx.contiguous(weight[:, h:].T)
                fast["gate_b"] = head.gate_proj.bias
            elif head.kind == "rnn":
                weight = head.joint_proj.weight  # [3r, 2r + H]: input [state ; e ; hidden]
                fast["joint_se_t"] = mx.contiguous(weight[:, : 2 * rank].T)
                fast["joint_h_t"] = mx.contiguous(weight[:, 2 * rank :].T)
                fast["joint_b"] = head.joint_proj.bias
            del model.markov_head
        if isinstance(algorithm, DSpark) and algorithm.confidence_head:
            proj = model.confidence_head.proj  # [1, H (+ r)]: input [hidden ; e]
            fast["conf_h"] = mx.contiguous(proj.weight[0, :h])
            if algorithm.confidence_head_with_markov:
                fast["conf_e"] = mx.contiguous(proj.weight[0, h:])
            fast["conf_b"] = proj.bias
            del model.confidence_head
        # slot j's confidence reads draft j-1's Markov embedding
        self.confidence_reads_drafts = "conf_e" in fast
        if mx.default_device().type == mx.cpu:
            model.fc = TransposedLinear(model.fc)
            for layer in model.layers:
                transpose_linears(layer)
        self._fast = fast

    # -- state ------------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget all context: the next add_context starts at position 0."""
        for cache in self._caches:
            cache.trim(0)
        self._length = 0  # context rows cached = the anchor's position p
        self._anchor: mx.array | None = None
        self.last_confidence: mx.array | None = None

    def trim(self, rows: int) -> None:
        """Keep the first `rows` cached context rows (those a new prompt shares with the
        positions added since `reset()`); the next add_context brings the anchor."""
        if not 0 <= rows <= self._length:
            raise DrafterError(
                f"trim: rows = {rows}: expected at most the {self._length} context rows cached"
            )
        for cache in self._caches:
            cache.trim(rows)
        self._length = rows
        self._anchor = None
        self.last_confidence = None

    @property
    def context_length(self) -> int:
        """p: the number of cached context rows, the position of the anchor."""
        return self._length

    def fuse(self, taps: mx.array) -> mx.array:
        """taps [n, A*Ht] (ascending layer ids) -> fused features [n, H]."""
        model, fusion = self.model, self.spec.fusion
        x = taps.astype(self.dtype)
        if fusion.tap_norm == "per_tap":
            # Every tap normalised on its own: one norm over a [n, A, Ht] view, then the
            # stacked weights (weight * normalised value, the reference's order).
            rows, taps_count = x.shape[0], self._fast["tap_norm"].shape[0]
            x = x.reshape(rows, taps_count, -1)
            x = rms_norm(x, self._fast["ones"], model.fc_norm[0].eps) * self._fast["tap_norm"]
            x = x.reshape(rows, -1)
        elif fusion.tap_norm == "concat":
            x = model.input_norm(x)
        x = model.fc(x)
        if fusion.hidden_norm:
            x = model.hidden_norm(x)
        return x

    def add_context(self, tokens: Sequence[int] | mx.array, taps: mx.array) -> None:
        """n verified positions: taps[i] [A*Ht] are the target's tapped states at positions
        p..p+n-1 (p = rows already cached), and tokens[-1] (a target id) is the new anchor, at
        position p+n. Only the anchor is read from tokens. The rows' keys/values are appended
        to every layer's cache (lazily)."""
        if not isinstance(tokens, mx.array):
            tokens = mx.array(list(tokens), mx.int32)
        if not isinstance(taps, mx.array):
            taps = mx.array(np.asarray(taps, dtype=np.float32))
        if tokens.ndim != 1 or taps.shape != (tokens.shape[0], self._taps_width):
            raise DrafterError(
                f"add_context: tokens.shape = {list(tokens.shape)}, taps.shape ="
                f" {list(taps.shape)}: expected [n] and [n, {self._taps_width}]"
                f" ({len(self.spec.taps.layer_ids)} taps of {self.spec.target.hidden_size})"
            )
        rows = tokens.shape[0]
        if not rows:
            return
        context = self.fuse(taps)
        for layer, cache in zip(self.model.layers, self._caches, strict=True):
            # The fused context feeds every layer as is (no input_layernorm); k_norm and RoPE
            # at the rows' true positions apply to its keys.
            cache.update_and_fetch(*layer.self_attn.keys_values(context, self._length))
        self._length += rows
        self._anchor = tokens[-1].astype(mx.int32)

    # -- drafting ---------------------------------------------------------------------------

    def block_hidden(self, collect: list[mx.array] | None = None) -> mx.array:
        """The backbone over [anchor, MASK x (B-1)] at positions p..p+B-1 after the cached
        context: the post-final-norm states [B, H] (lazy). collect: receives every layer's
        output [B, H]."""
        if self._anchor is None:
            raise DrafterError("propose: no context rows; call add_context first")
        p = self._length
        x = self.model.embed_tokens(self._anchor[None])
        if "mask_rows" in self._fast:
            x = mx.concatenate([x, self._fast["mask_rows"]])
        for layer, cache in zip(self.model.layers, self._caches, strict=True):
            config = layer.config
            window = config.sliding_window
            # Every context key is before the anchor; a window keeps those at >= p - W.
            key_start = 0 if window is None else max(0, p - window)
            # Lower-right-aligned causal over [context ; block] = every context key and the
            # block up to the slot itself.
            mask = "causal" if config.attention == "block_causal" else None
            # The block's keys go to the cache rows after the context (scratch) and are
            # dropped right after: the cached context is read in place, never copied.
            x, _, _ = layer(x, p, mask, cache=cache, key_start=key_start)
            cache.trim(p)
            if collect is not None:
                collect.append(x)
        return self.model.norm(x)

    def logits(self, hidden: mx.array) -> mx.array:
        """Backbone logits over the draft vocabulary: hidden [R, H] -> [R, Vd]."""
        if "head_t" in self._fast:
            return hidden @ self._fast["head_t"]
        blocks = self._fast["head_blocks"]  # [n, H, c]
        rows, vocab = hidden.shape[0], self.spec.draft_vocab_size
        out = (hidden[None] @ blocks).transpose(1, 0, 2).reshape(rows, -1)
        return out if out.shape[1] == vocab else out[:, :vocab]

    def propose(self, k: int, sampler: Sampler) -> tuple[mx.array, mx.array]:
        """One block forward, then the first k draft slots in order -> (draft tokens [k] int32
        target ids, logits [k, Vd] each draft was sampled from, Markov bias included), lazy.

        sampler(logits [Vd]) -> a scalar draft-row index. With sample_from_anchor every slot
        is a draft (slot j predicts position p+j+1); otherwise slot 0 is only run and slot j
        >= 1 predicts position p+j. DSpark's Markov head reads the target id of the token
        before the one a slot predicts: the anchor, then the previous draft. `last_confidence`
        is then the confidence head's estimate [k] for each draft (DSpark), else None."""
        self._check_drafts(k)
        hidden = self.block_hidden()
        first = 0 if self.algorithm.sample_from_anchor else 1
        rows = hidden[first : first + k]
        base = self.logits(rows)  # [k, Vd]
        tokens, logits, confidence = self.draft_slots(hidden, base, k, sampler)
        self.last_confidence = confidence
        return tokens, logits

    def _check_drafts(self, k: int) -> None:
        if not 1 <= k <= self.num_drafts:
            raise DrafterError(
                f"propose: k = {k}: expected 1 to {self.num_drafts} drafts"
                f" (block_size {self.algorithm.block_size},"
                f" sample_from_anchor {self.algorithm.sample_from_anchor})"
            )

    def draft_slots(
        self,
        hidden: mx.array,
        base: mx.array,
        k: int,
        sampler: Sampler,
    ) -> tuple[mx.array, mx.array, mx.array | None]:
        """The draft slots of one block: hidden [B, H] post-norm states, base [k, Vd] the
        backbone logits of the first k draft slots -> (tokens [k], logits [k, Vd], confidence
        [k] or None)."""
        algorithm = self.algorithm
        first = 0 if algorithm.sample_from_anchor else 1
        ids = self.head_target_ids
        if not isinstance(algorithm, DSpark) or not (
            algorithm.markov_rank or algorithm.confidence_head
        ):
            drafted = [ids[sampler(base[j])] for j in range(k)]
            return mx.stack(drafted).astype(mx.int32), base, None
        fast, rank = self._fast, algorithm.markov_rank
        kind = algorithm.markov_head_type if rank else None
        rows = hidden[first : first + k]
        prev = self._anchor.reshape(1)
        w1 = fast.get("w1")
        if kind == "gated":
            gate_hidden = mx.addmm(fast["gate_b"], rows, fast["gate_h_t"])
        elif kind == "rnn":
            joint_hidden = mx.addmm(fast["joint_b"], hidden[: first + k], fast["joint_h_t"])
            state = mx.zeros((1, rank), self.dtype)
            if first:
                # Slot 0 is not a draft, but it steps the state (prev = the anchor).
                state = self._rnn_step(state, w1[prev], joint_hidden[0])[0]
        drafted, all_logits, prev_embeds = [], [], []
        for j in range(k):
            row = base[j : j + 1]
            if rank:
                e = w1[prev]  # [1, r]
                prev_embeds.append(e)
                if kind == "vanilla":
                    row = mx.addmm(row, e, fast["w2_t"])
                elif kind == "gated":
                    gate = mx.sigmoid(gate_hidden[j] + e @ fast["gate_e_t"])
                    row = mx.addmm(row, gate * e, fast["w2_t"])
                else:
                    state, out = self._rnn_step(state, e, joint_hidden[first + j])
                    row = mx.addmm(row, mx.tanh(out), fast["w2_t"])
            all_logits.append(row)
            token = ids[sampler(row[0])].reshape(1)
            drafted.append(token)
            prev = token
        tokens = mx.concatenate(drafted).astype(mx.int32)
        logits = mx.concatenate(all_logits) if rank else base
        confidence = None
        if algorithm.confidence_head:
            conf_logit = rows @ fast["conf_h"] + fast["conf_b"]
            if algorithm.confidence_head_with_markov:
                conf_logit = conf_logit + mx.concatenate(prev_embeds) @ fast["conf_e"]
            confidence = mx.sigmoid(conf_logit)
        return tokens, logits, confidence

    def _rnn_step(
        self, state: mx.array, e: mx.array, joint_hidden: mx.array
    ) -> tuple[mx.array, mx.array]:
        """rnn Markov head, one slot: state [1, r], e [1, r], joint_hidden [3r] (the hidden
        state's part of joint_proj, bias included) -> (next state, the output chunk [1, r])."""
        joint = joint_hidden + mx.concatenate([state, e], axis=-1) @ self._fast["joint_se_t"]
        gate_raw, candidate, out = mx.split(joint, 3, axis=-1)
        gate = mx.sigmoid(gate_raw)
        # The bias reads `out`, computed from the state before this slot's update.
        return gate * state + (1.0 - gate) * mx.tanh(candidate), out


def can_propose_together(drafters: Sequence[object]) -> bool:
    """Whether `propose_together` takes these drafters: block drafters over one model (a
    session's, each with its own context)."""
    first = drafters[0]
    return isinstance(first, BlockDrafter) and all(
        isinstance(d, BlockDrafter) and d.model is first.model for d in drafters
    )


def propose_together(
    drafters: Sequence[BlockDrafter], lengths: Sequence[int], samplers: Sequence[Sampler]
) -> list[tuple[mx.array, mx.array]]:
    """`drafters[i].propose(lengths[i], samplers[i])` for every i (`can_propose_together`): one
    backbone forward and one head matmul for all the blocks, each block at its own positions
    after its own context (each drafter's cached rows gathered into the rows of one batch
    cache; the blocks' keys there are scratch, so no drafter's state changes but its
    `last_confidence`); the draft slots (Markov head, sampling) then run drafter by drafter.
    The drafts may differ from `propose`'s only where rounding over more rows flips a near
    tie."""
    first_drafter, count = drafters[0], len(drafters)
    model, algorithm = first_drafter.model, first_drafter.algorithm
    for drafter, k in zip(drafters, lengths, strict=True):
        drafter._check_drafts(k)
        if drafter._anchor is None:
            raise DrafterError("propose: no context rows; call add_context first")
    contexts = [drafter._length for drafter in drafters]  # never moved: the blocks are scratch
    caches = [RowCache(contexts, count) for _ in model.layers]
    for layer, cache in enumerate(caches):
        for row, drafter in enumerate(drafters):
            cache.write_row(row, drafter._caches[layer])
    x = model.embed_tokens(mx.stack([drafter._anchor for drafter in drafters]))[:, None]
    if "mask_rows" in first_drafter._fast:
        masks = first_drafter._fast["mask_rows"]  # [B - 1, H]
        x = mx.concatenate([x, mx.broadcast_to(masks[None], (count, *masks.shape))], axis=1)
    block = x.shape[1]  # x [N, B, H]: each drafter's [anchor, MASK x (B-1)]
    starts = mx.array(contexts)  # [N] each block's first position
    first_keys = starts[:, None, None, None]
    keys = mx.arange(max(contexts) + block)[None, None, None, :]  # [1, 1, 1, S]
    for layer, cache in zip(model.layers, caches, strict=True):
        config = layer.config
        # as `block_hidden`: every context key, then the block (causal: up to the slot itself),
        # a window keeping the context keys at >= p - W
        if config.attention == "block_causal":
            visible = keys <= first_keys + mx.arange(block)[None, None, :, None]
        else:
            visible = keys < first_keys + block
        if config.sliding_window is not None:
            visible = visible & (keys >= first_keys - config.sliding_window)
        mask = mx.broadcast_to(visible, (count, 1, block, keys.shape[-1]))
        x, _, _ = layer(x, starts, mask, cache=cache)
    hidden = model.norm(x)  # [N, B, H]
    first, most = (0 if algorithm.sample_from_anchor else 1), max(lengths)
    rows = hidden[:, first : first + most]  # [N, K, H]
    base = first_drafter.logits(rows.reshape(-1, rows.shape[-1])).reshape(count, most, -1)
    proposals = []
    for i, (drafter, k, sampler) in enumerate(zip(drafters, lengths, samplers, strict=True)):
        tokens, logits, confidence = drafter.draft_slots(hidden[i], base[i, :k], k, sampler)
        drafter.last_confidence = confidence
        proposals.append((tokens, logits))
    return proposals


HEAD_BLOCK = 256


def _head_layout(weight: mx.array) -> dict[str, mx.array]:
    """The head [Vd, H] as the logits matmul reads it fastest: on the CPU backend, blocks of
    HEAD_BLOCK draft rows, transposed, [n, H, HEAD_BLOCK] (the last block zero-padded). One
    batched matmul over cache-sized blocks beats one over the whole transposed head for any
    number of rows (measured for a 49152 x 576 head with the bundled BLAS: 9.5 ms per row, vs
    13.3 against a contiguous [H, Vd] copy and 22 against W.T); each logit is the same dot
    product in the same order, so the values are identical. Elsewhere (and for heads too small
    to block), the transposed head [H, Vd]."""
    vocab, hidden = weight.shape
    if mx.default_device().type != mx.cpu or vocab < 4 * HEAD_BLOCK:
        return {"head_t": mx.contiguous(weight.T)}
    blocks = -(-vocab // HEAD_BLOCK)
    padded = mx.pad(weight, [(0, blocks * HEAD_BLOCK - vocab), (0, 0)])
    layout = padded.reshape(blocks, HEAD_BLOCK, hidden).transpose(0, 2, 1)
    return {"head_blocks": mx.contiguous(layout)}
