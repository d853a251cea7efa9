"""The EAGLE-3 chain drafter on MLX: the torch reference's function (`TorchDrafter.eagle3_forward`
and `eagle3_draft`), shaped for a speculative decoding loop.

Row convention (EAGLE-3): after `reset()`, context row t (t = 1, 2, ...) is token x_t with the
fused target features g_{t-1} of the position before it, at position t. Every cached row sits at
position (row index + 1): context rows are contiguous, and a round's chain rows follow the last
one and are dropped before the next context rows arrive. A propose round runs all pending
context rows in one forward and takes only its last row's logits; every later step runs one
chain row. Nothing here synchronises: `propose` returns lazy arrays and the loop evaluates them
together with the target's work.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from woodcock.errors import DrafterError
from woodcock.ir import Drafter, DrafterSpec, Eagle3
from woodcock.runtime.batch import RowCache
from woodcock.runtime.layers import DecoderLayer, KVCache, RMSNorm, to_mx, transpose_linears
from woodcock.target_checkpoint import drafter_arrays


class Eagle3Model(nn.Module):
    """The drafter's modules under their canonical names. lm_head holds `head_rows` rows (all
    draft rows, or a truncated head's)."""

    def __init__(self, spec: DrafterSpec, head_rows: int):
        super().__init__()
        self.spec = spec
        self.algorithm: Eagle3 = spec.algorithm
        h, ht = spec.hidden_size, spec.target.hidden_size
        taps = len(spec.taps.layer_ids)
        eps = spec.layers[0].rms_norm_eps
        if spec.fusion.tap_norm == "per_tap":
            self.fc_norm = [RMSNorm(ht, eps) for _ in range(taps)]
        elif spec.fusion.tap_norm == "concat":
            self.input_norm = RMSNorm(taps * ht, eps)
        self.fc = nn.Linear(taps * ht, h, bias=spec.fusion.fc_bias)
        self.layers = [DecoderLayer(layer) for layer in spec.layers]
        self.norm = RMSNorm(h, eps)
        self.lm_head = nn.Linear(h, head_rows, bias=False)
        self.embed_tokens = nn.Embedding(spec.target.vocab_size, h)

    def fuse(self, taps: mx.array) -> mx.array:
        """taps [n, A*Ht] (ascending layer ids) -> fused features [n, H]."""
        x = taps.astype(self.norm.weight.dtype)
        if self.spec.fusion.tap_norm == "per_tap":
            chunks = mx.split(x, len(self.fc_norm), axis=-1)
            x = mx.concatenate([norm(c) for norm, c in zip(self.fc_norm, chunks, strict=True)], -1)
        elif self.spec.fusion.tap_norm == "concat":
            x = self.input_norm(x)
        return self.fc(x)

    def __call__(
        self,
        tokens: mx.array,
        hidden: mx.array,
        caches: list[KVCache],
        *,
        context_rows: int,
        chain: bool,
        out_rows: int | None = 1,
        collect: list[mx.array] | None = None,
    ) -> mx.array:
        """n new rows after the cached ones: tokens [n] target ids, hidden [n, H] (fused features
        or fed-back states) -> the last layer's output for the last `out_rows` rows [R, H] (None:
        all rows). context_rows: how many cached rows are context (the rest are chain rows);
        chain: these rows are chain rows (their window counts back from the last context row).
        collect: receives every layer's output."""
        rows, cached = hidden.shape[0], caches[0].offset
        embeds = self.embed_tokens(tokens)
        x = hidden
        last = len(self.layers) - 1
        keys: dict[tuple[int | None, int], tuple[int, str | mx.array | None]] = {}
        for i, layer in enumerate(self.layers):
            wanted = out_rows if i == last and out_rows is not None else rows
            window = layer.config.sliding_window
            if (window, wanted) not in keys:
                keys[window, wanted] = visible_keys(
                    window, cached, rows, context_rows, chain=chain, out_rows=wanted
                )
            key_start, mask = keys[window, wanted]
            x, _, _ = layer(
                x,
                cached + 1,
                mask,
                cache=caches[i],
                key_start=key_start,
                embeds=embeds if i == 0 else None,
                norm_before_residual=self.algorithm.norm_before_residual,
                out_rows=wanted,
            )
            if collect is not None:
                collect.append(x)
        return x

    def forward_rows(self, tokens: mx.array, hidden: mx.array, caches: list[RowCache]) -> mx.array:
        """Several sequences at once, each in its row of `caches` (their shared `lengths`: each
        sequence's cached rows): tokens [B, T], hidden [B, T, H] -> the last layer's output
        [B, T, H]. The caches take the rows at each sequence's next positions; moving the
        lengths on is the caller's (a padding row is not its sequence's). No sliding window:
        every row sees all its sequence's earlier rows, as `__call__` does without one."""
        offset = mx.array(caches[0].lengths) + 1  # row index r is position r + 1
        mask = caches[0].make_mask(tokens.shape[1])  # [B, 1, T, S]
        embeds = self.embed_tokens(tokens)
        x = hidden
        for i, layer in enumerate(self.layers):
            x, _, _ = layer(
                x,
                offset,
                mask,
                cache=caches[i],
                embeds=embeds if i == 0 else None,
                norm_before_residual=self.algorithm.norm_before_residual,
            )
        return x

    def head(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """x [R, H] -> (logits [R, Vh], fed-back state [R, H])."""
        normed = self.norm(x)
        # norm_output (EAGLE-3.1) recurs on the normalised state, classic EAGLE-3 on the raw one.
        return self.lm_head(normed), normed if self.algorithm.norm_output else x


def visible_keys(
    window: int | None, cached: int, rows: int, context: int, *, chain: bool, out_rows: int
) -> tuple[int, str | mx.array | None]:
    """(first key index read, mask) for the last `out_rows` of `rows` new rows after `cached`
    rows of which the first `context` are context rows; row index i is position i + 1.

    The reference's rule (`TorchDrafter._eagle3_visible`): causal in row order; a window W hides
    context keys at positions <= query position - W for context rows, and <= (last context
    position) - W for chain rows, whose chain keys are all visible. Both cut a prefix of the
    keys for a single query row, so a chain step or the last context row reads a slice with no
    mask; only several windowed context rows need a band mask."""
    first_query = cached + rows - out_rows
    if window is None:
        start = 0
    elif chain:
        start = max(0, context - window)
    else:
        start = max(0, first_query - window + 1)
    if out_rows == 1:
        return start, None
    if window is None or chain:
        # Lower-right-aligned causal: query r sees keys up to first_query + r, all from start on.
        return start, "causal"
    query = np.arange(first_query, cached + rows)[:, None]
    key = np.arange(start, cached + rows)[None, :]
    return start, mx.array((key <= query) & (key > query - window))


Sampler = Callable[[mx.array], mx.array]


class Eagle3Drafter:
    """An EAGLE-3 drafter with its own KV cache, driven by `add_context` and `propose`.

    target_tensors: {"embed_tokens.weight": [V, H], "lm_head.weight": [V, H]} of the target
    (`woodcock.target_checkpoint.load_target_tensors`), needed when the spec's head shares either.
    head_ids: sorted draft-row indices the lm_head keeps (a truncated head: fewer rows, cheaper
    steps); None keeps all rows.
    """

    num_drafts = None  # a chain: any length
    last_confidence = None  # no confidence head
    confidence_reads_drafts = False

    def __init__(
        self,
        drafter: Drafter,
        target_tensors: Mapping[str, np.ndarray] | None = None,
        *,
        dtype: mx.Dtype = mx.float32,
        head_ids: np.ndarray | None = None,
    ):
        spec = drafter.spec
        if not isinstance(spec.algorithm, Eagle3):
            raise DrafterError(f"algorithm = {spec.algorithm.name!r}: expected 'eagle3'")
        self.spec = spec
        self.dtype = dtype
        draft_to_target = drafter.vocab.target_ids(spec)
        rows = _head_rows(head_ids, spec.draft_vocab_size)
        arrays = drafter_arrays(drafter, target_tensors, rows)
        kept = draft_to_target if rows is None else draft_to_target[rows]
        self.model = Eagle3Model(spec, len(kept))
        self.model.load_weights([(name, to_mx(a, dtype)) for name, a in arrays.items()])
        if mx.default_device().type == mx.cpu:
            transpose_linears(self.model)
        self.model.eval()
        mx.eval(self.model.parameters())
        self.head_target_ids = mx.array(kept.astype(np.int32))  # [Vh]
        self._taps_width = len(spec.taps.layer_ids) * spec.target.hidden_size
        self._caches = [KVCache() for _ in spec.layers]
        self.reset()

    # -- state ------------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget all context: the next add_context starts at position 1."""
        for cache in self._caches:
            cache.trim(0)
        self._context = 0  # context rows in the caches
        self._pending: list[tuple[mx.array, mx.array]] = []
        self._first: tuple[mx.array, mx.array] | None = None  # last context row: logits, state

    def _drop_chain(self) -> None:
        for cache in self._caches:
            cache.trim(self._context)

    def trim(self, rows: int) -> None:
        """Keep the first `rows` context rows (those a new prompt shares with the tokens added
        since `reset()`), as if only they had been added; the next add_context follows them."""
        pending = [t.shape[0] for t, _ in self._pending]
        if not 0 <= rows <= self._context + sum(pending):
            raise DrafterError(
                f"trim: rows = {rows}: expected at most the {self._context + sum(pending)}"
                " context rows added"
            )
        if rows <= self._context:
            self._context, self._pending = rows, []
        elif self._pending:  # rows not run yet: keep the first of them pending
            keep = rows - self._context
            tokens = mx.concatenate([t for t, _ in self._pending])[:keep]
            taps = mx.concatenate([g for _, g in self._pending])[:keep]
            self._pending = [(tokens, taps)]
        self._drop_chain()
        self._first = None

    def add_context(self, tokens: Sequence[int] | mx.array, taps: mx.array) -> None:
        """n context rows at the next positions: row i is token tokens[i] (a target id) with
        hidden fuse(taps[i]); taps [n, A*Ht]. Drops the previous proposal's chain rows; the
        rows are run at the next propose."""
        tokens = tokens if isinstance(tokens, mx.array) else mx.array(list(tokens), mx.int32)
        taps = taps if isinstance(taps, mx.array) else to_mx(np.asarray(taps), self.dtype)
        if tokens.ndim != 1 or taps.shape != (tokens.shape[0], self._taps_width):
            raise DrafterError(
                f"add_context: tokens.shape = {list(tokens.shape)}, taps.shape ="
                f" {list(taps.shape)}: expected [n] and [n, {self._taps_width}]"
                f" ({len(self.spec.taps.layer_ids)} taps of {self.spec.target.hidden_size})"
            )
        self._drop_chain()
        if tokens.shape[0]:
            self._pending.append((tokens, taps))
            self._first = None

    # -- drafting ---------------------------------------------------------------------------

    def _run_context(self) -> None:
        tokens = mx.concatenate([t for t, _ in self._pending])
        taps = mx.concatenate([g for _, g in self._pending])
        self._pending = []
        x = self.model(
            tokens, self.model.fuse(taps), self._caches, context_rows=self._context, chain=False
        )
        self._context = self._caches[0].offset
        logits, state = self.model.head(x)
        self._first = (logits[0], state)

    def propose(self, k: int, sampler: Sampler) -> tuple[mx.array, mx.array]:
        """k chain steps -> (draft tokens [k] int32 target ids, logits [k, Vh]), lazy.

        sampler(logits [Vh]) -> a scalar index into the kept head rows. Step 1 samples from the
        last context row (running the pending rows first); step j >= 2 runs one chain row
        (previous draft, previous fed-back state, next position). Proposing again without new
        context starts over from the same last context row."""
        if k < 1:
            raise DrafterError(f"propose: k = {k}: expected at least one step")
        if self._pending:
            self._run_context()
        elif self._first is None:
            raise DrafterError("propose: no context rows; call add_context first")
        else:
            self._drop_chain()
        logits, state = self._first
        all_logits, drafted = [logits], [self.head_target_ids[sampler(logits)]]
        for _ in range(1, k):
            x = self.model(
                drafted[-1].reshape(1),
                state,
                self._caches,
                context_rows=self._context,
                chain=True,
            )
            step_logits, state = self.model.head(x)
            all_logits.append(step_logits[0])
            drafted.append(self.head_target_ids[sampler(step_logits[0])])
        return mx.stack(drafted), mx.stack(all_logits)


def can_propose_together(drafters: Sequence[object]) -> bool:
    """Whether `propose_together` takes these drafters: EAGLE-3 drafters over one model (a
    session's, each with its own state) whose layers have no sliding window."""
    first = drafters[0]
    return (
        isinstance(first, Eagle3Drafter)
        and all(isinstance(d, Eagle3Drafter) and d.model is first.model for d in drafters)
        and all(layer.sliding_window is None for layer in first.spec.layers)
    )


def propose_together(
    drafters: Sequence[Eagle3Drafter], lengths: Sequence[int], samplers: Sequence[Sampler]
) -> list[tuple[mx.array, mx.array]]:
    """`drafters[i].propose(lengths[i], samplers[i])` for every i (`can_propose_together`), in
    one forward a step instead of one per drafter: on a few CPU cores a drafter step costs about
    the same for one sequence's rows as for four (its weights are read once), and on a GPU each
    forward is launches. Each drafter's state ends as its own `propose` leaves it (pending
    context rows run and cached, the last one's logits kept), except that the chain rows are
    not cached (the next add_context or propose drops them anyway). The drafts may differ from
    `propose`'s only where rounding over more rows flips a near tie."""
    model, count = drafters[0].model, len(drafters)
    pending, starts = [], []
    for drafter in drafters:
        if not drafter._pending and drafter._first is None:
            raise DrafterError("propose: no context rows; call add_context first")
        drafter._drop_chain()
        rows = None
        if drafter._pending:
            rows = (
                mx.concatenate([t for t, _ in drafter._pending]),
                mx.concatenate([g for _, g in drafter._pending]),
            )
        pending.append(rows)
        starts.append(drafter._context)
    cached = list(starts)  # each sequence's rows in the batch caches
    caches = [RowCache(cached, count) for _ in model.layers]
    for layer, cache in enumerate(caches):
        for row, drafter in enumerate(drafters):
            cache.write_row(row, drafter._caches[layer])

    firsts = [drafter._first for drafter in drafters]
    width = max((rows[0].shape[0] for rows in pending if rows is not None), default=0)
    if width:
        taps_width = drafters[0]._taps_width
        tokens, taps = [], []
        for rows in pending:
            n = 0 if rows is None else rows[0].shape[0]
            tokens.append(
                mx.zeros((width,), mx.int32) if rows is None else mx.pad(rows[0], (0, width - n))
            )
            taps.append(
                mx.zeros((width, taps_width), drafters[0].dtype)
                if rows is None
                else mx.pad(rows[1], [(0, width - n), (0, 0)])
            )
        tokens, taps = mx.stack(tokens), mx.stack(taps)  # [B, W], [B, W, A*Ht]
        x = model.forward_rows(tokens, model.fuse(taps), caches)  # [B, W, H]
        last = [0 if rows is None else rows[0].shape[0] - 1 for rows in pending]
        logits, state = model.head(x[mx.arange(count), mx.array(last)])  # [B, Vh], [B, H]
        for row, (drafter, rows) in enumerate(zip(drafters, pending, strict=True)):
            if rows is None:
                continue
            n = rows[0].shape[0]
            cached[row] += n
            firsts[row] = (logits[row], state[row : row + 1])
            for layer, cache in enumerate(caches):
                drafter._caches[layer].update_and_fetch(
                    cache.keys[row : row + 1, :, starts[row] : starts[row] + n],
                    cache.values[row : row + 1, :, starts[row] : starts[row] + n],
                )
            drafter._context, drafter._first, drafter._pending = cached[row], firsts[row], []

    head_ids = drafters[0].head_target_ids

    def draw(step: int, logits: mx.array) -> mx.array:  # [B, Vh] -> target ids [B]
        # a drafter past its own length is not asked (its sampler may draw random numbers)
        return head_ids[
            mx.stack(
                [
                    samplers[row](logits[row]) if step < lengths[row] else mx.argmax(logits[row])
                    for row in range(count)
                ]
            )
        ]

    logits = mx.stack([first[0] for first in firsts])  # [B, Vh]
    state = mx.concatenate([first[1] for first in firsts])  # [B, H]
    all_logits, drafted = [logits], [draw(0, logits)]
    for step in range(1, max(lengths)):
        x = model.forward_rows(drafted[-1][:, None], state[:, None], caches)  # [B, 1, H]
        cached[:] = [length + 1 for length in cached]
        logits, state = model.head(x[:, 0])
        all_logits.append(logits)
        drafted.append(draw(step, logits))
    drafted, all_logits = mx.stack(drafted), mx.stack(all_logits)  # [K, B], [K, B, Vh]
    return [(drafted[:k, row], all_logits[:k, row]) for row, k in enumerate(lengths)]


def _head_rows(head_ids: np.ndarray | None, draft_vocab: int) -> np.ndarray | None:
    if head_ids is None:
        return None
    ids = np.asarray(head_ids)
    if ids.ndim != 1 or ids.size == 0 or ids.dtype.kind not in "iu":
        raise DrafterError(
            f"head_ids: shape {list(ids.shape)}, dtype {ids.dtype}: expected a non-empty 1-D"
            " integer array of draft-row indices"
        )
    if ids.min() < 0 or ids.max() >= draft_vocab:
        bad = int(ids[(ids < 0) | (ids >= draft_vocab)][0])
        raise DrafterError(f"head_ids: {bad}: expected draft-row indices in [0, {draft_vocab})")
    if np.any(np.diff(ids) <= 0):
        raise DrafterError("head_ids: expected strictly ascending draft-row indices")
    return ids.astype(np.int64)
