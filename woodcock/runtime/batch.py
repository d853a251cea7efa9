"""Several sequences' target KV caches side by side, verified in one batched forward, each rolled
back on its own.

mlx-lm's `BatchKVCache` aligns its sequences on the right (left padding) and writes all of them
at one shared index, so it can only drop the same number of tokens from every sequence; after a
speculative round each sequence drops its own rejected drafts. Here every sequence starts at
position 0 of its row and has its own length: a round's new tokens of sequence i are written at
its length, attention masks each row to its own keys, and rolling back is lowering one length.
What lies past a row's length (rejected rows, the padding of a shorter proposal) is never seen:
a query at position p sees keys at positions <= p, and the next forward overwrites them.

The model runs unchanged: mlx-lm's attention takes RoPE offsets (one per row), writes through
`update_and_fetch` and gets its mask from `make_mask`, as with its own batch caches.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from woodcock.errors import DrafterError
from woodcock.runtime.target import MlxTarget

STEP = 256  # rows by which the buffers grow, as mlx-lm's caches do


class RowCache:
    """One layer's keys and values [rows, kv heads, capacity, head dim] for the sequences of a
    batch (row i: sequence i from position 0), with the lengths all layers share."""

    def __init__(self, lengths: list[int], rows: int):
        self.lengths, self.rows = lengths, rows  # lengths: the SequenceBatch's own list
        self.keys: mx.array | None = None
        self.values: mx.array | None = None

    @property
    def offset(self) -> mx.array:
        """[B] each active row's first new position: RoPE's offsets."""
        return mx.array(self.lengths)

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def reserve(self, end: int, like_keys: mx.array, like_values: mx.array) -> None:
        """Make room for positions [0, end) in every row."""
        if end <= self.capacity:
            return
        grown = -(-end // STEP) * STEP
        heads, width, value_width = like_keys.shape[1], like_keys.shape[3], like_values.shape[3]
        keys = mx.zeros((self.rows, heads, grown, width), like_keys.dtype)
        values = mx.zeros((self.rows, heads, grown, value_width), like_values.dtype)
        if self.keys is not None:
            keys[..., : self.capacity, :] = self.keys
            values[..., : self.capacity, :] = self.values
        self.keys, self.values = keys, values

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """keys, values [B, Hk, T, D]: row i's T new positions from its length on -> every active
        row's keys and values [B, Hk, max length + T, D]."""
        batch, new = keys.shape[0], keys.shape[2]
        end = max(self.lengths) + new
        self.reserve(end, keys, values)
        # one scatter per array, not a write per row: on a GPU each write is a kernel launch
        rows = mx.arange(batch)[:, None]  # [B, 1]
        positions = mx.array(self.lengths)[:, None] + mx.arange(new)[None, :]  # [B, T]
        self.keys[rows, :, positions] = keys.transpose(0, 2, 1, 3)  # [B, T, Hk, D]
        self.values[rows, :, positions] = values.transpose(0, 2, 1, 3)
        return self.keys[:batch, :, :end], self.values[:batch, :, :end]

    def make_mask(self, queries: int, return_array: bool = False, window_size=None) -> mx.array:
        """[B, 1, T, S]: query t of row i (position length_i + t) sees keys at positions up to its
        own (and, for a sliding-window layer, within the window)."""
        starts = mx.array(self.lengths)[:, None, None, None]
        positions = starts + mx.arange(queries)[None, None, :, None]  # [B, 1, T, 1]
        keys = mx.arange(max(self.lengths) + queries)[None, None, None, :]
        mask = keys <= positions
        if window_size is not None:
            mask = mask & (keys > positions - window_size)
        return mask

    def move_row(self, source: int, destination: int) -> None:
        if self.keys is not None:
            self.keys[destination] = self.keys[source]
            self.values[destination] = self.values[source]

    def write_row(self, row: int, cache: KVCache) -> None:
        """Row `row` := a lone sequence's cache (its first `cache.offset` positions)."""
        if cache.keys is None or not cache.offset:
            return
        keys, values = cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :]
        self.reserve(cache.offset, keys, values)
        self.keys[row : row + 1, :, : cache.offset] = keys
        self.values[row : row + 1, :, : cache.offset] = values

    def read_row(self, row: int, length: int) -> KVCache:
        """A lone sequence's cache holding row `row`'s first `length` positions (a copy)."""
        cache = KVCache()
        if length:
            cache.keys = mx.array(self.keys[row : row + 1, :, :length])
            cache.values = mx.array(self.values[row : row + 1, :, :length])
            cache.offset = length
        return cache


class Slot:
    """A sequence's place in a SequenceBatch: what the speculative loop asks of its target's
    cache (its length, rolling back its rejected rows)."""

    def __init__(self, batch: SequenceBatch, row: int):
        self.batch, self.row = batch, row

    @property
    def offset(self) -> int:
        """Tokens in this sequence's rows."""
        return self.batch.lengths[self.row]

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self.offset:
            raise DrafterError(f"cannot drop {num_tokens} of a sequence's {self.offset} rows")
        self.batch.lengths[self.row] -= num_tokens


class SequenceBatch:
    """Up to `max_rows` sequences of one target, each with its own length. A sequence joins with
    the cache of its prefilled prompt (`add`) and leaves between forwards (`remove`: the last
    row moves into its place, so the active rows are always the first ones)."""

    def __init__(self, target: MlxTarget, max_rows: int):
        kinds = {type(cache) for cache in target.cache}
        if kinds != {KVCache}:
            names = ", ".join(sorted(kind.__name__ for kind in kinds))
            raise DrafterError(
                f"{target.name}: batching several requests needs a plain KV cache in every"
                f" layer; this model's caches are {names}"
            )
        self.target, self.max_rows = target, max_rows
        self.lengths: list[int] = []
        self.slots: list[Slot] = []
        self.caches = [RowCache(self.lengths, max_rows) for _ in target.cache]

    def __len__(self) -> int:
        return len(self.slots)

    def add(self, caches: list[KVCache]) -> Slot:
        """A new sequence whose rows are those of a lone sequence's caches (one per layer)."""
        if len(self.slots) == self.max_rows:
            raise DrafterError(f"the batch is full ({self.max_rows} sequences)")
        slot = Slot(self, len(self.slots))
        for layer, cache in zip(self.caches, caches, strict=True):
            layer.write_row(slot.row, cache)
        self.slots.append(slot)
        self.lengths.append(caches[0].offset)
        return slot

    def remove(self, slot: Slot) -> list[KVCache]:
        """Take a sequence out; its caches as a lone sequence's (for a prefix pool)."""
        caches = [layer.read_row(slot.row, slot.offset) for layer in self.caches]
        last = self.slots.pop()
        length = self.lengths.pop()
        if last is not slot:
            for layer in self.caches:
                layer.move_row(last.row, slot.row)
            last.row = slot.row
            self.slots[slot.row] = last
            self.lengths[slot.row] = length
        slot.row = -1
        return caches

    def forward(self, tokens: list[mx.array]) -> list[tuple[mx.array, mx.array]]:
        """tokens: each active sequence's new tokens [T_i], in row order -> each one's (logits
        [T_i, V], taps [T_i, A*Ht]); their rows join the caches. Lazy."""
        if len(tokens) != len(self.slots):
            raise DrafterError(f"{len(tokens)} token rows for {len(self.slots)} sequences")
        width = max(t.shape[0] for t in tokens)
        padded = mx.stack(
            [mx.pad(t.astype(mx.int32), (0, width - t.shape[0])) for t in tokens]
        )  # [B, T]
        logits, taps = self.forward_equal(padded)  # [B, T, V], [B, T, A*Ht]
        for i, t in enumerate(tokens):
            self.lengths[i] -= width - t.shape[0]  # a padding row is not the sequence's
        return [(logits[i, : t.shape[0]], taps[i, : t.shape[0]]) for i, t in enumerate(tokens)]

    def forward_equal(self, tokens: mx.array) -> tuple[mx.array, mx.array]:
        """tokens [B, T]: T new tokens of every active sequence, in row order -> (logits
        [B, T, V], taps [B, T, A*Ht]); their rows join the caches. Lazy."""
        if tokens.shape[0] != len(self.slots):
            raise DrafterError(f"{tokens.shape[0]} token rows for {len(self.slots)} sequences")
        out = self.target.forward_rows(tokens, self.caches)
        self.lengths[:] = [length + tokens.shape[1] for length in self.lengths]
        return out
