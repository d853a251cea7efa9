"""The prefix pool: the generation state (target KV cache, drafter and prompt-lookup state) of
recent conversations with the tokens it holds, so that a request sharing a prefix with any of
them prefills only the rest.

An entry is detached from the live state: MLX arrays are values, but a KV cache writes its rows
with `array[...] = rows`, which rebinds that very array object to the new value. An entry
therefore holds cache objects, lists and dicts of its own, and slices of the live arrays (new
array objects sharing their memory until either side writes). Taking an entry over detaches it
again, so it stays as it was for the next request that shares its prefix. The same holds per
conversation when several generations run together: each takes its own detached state.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from mlx_lm.models.cache import KVCache as MlxLmKVCache

from woodcock.runtime.layers import KVCache

KV_CACHES = (KVCache, MlxLmKVCache)  # caches whose state is keys, values and offset
SCALARS = frozenset({int, float, bool, str, type(None)})


def shared_prefix(a, b) -> int:
    """The number of leading tokens two sequences share."""
    common = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        common += 1
    return common


def detached(value, sizes: list[int] | None = None):
    """A copy of generation state that a later generation may change without changing this one:
    KV caches get new cache objects over slices of their valid rows, lists, tuples and dicts are
    copied, anything else (arrays, numbers, weights, modules) is shared. sizes: receives the
    bytes of every cache's rows."""
    kind = type(value)
    if isinstance(value, KV_CACHES):
        copy = kind.__new__(kind)
        vars(copy).update(vars(value))
        if value.keys is not None:
            copy.keys = value.keys[..., : value.offset, :]
            copy.values = value.values[..., : value.offset, :]
            if sizes is not None:
                sizes.append(copy.keys.nbytes + copy.values.nbytes)
        return copy
    if kind is list or kind is tuple:
        return kind(item if type(item) in SCALARS else detached(item, sizes) for item in value)
    if kind is dict:
        # a prompt lookup's n-gram table has tens of thousands of entries: copied whole, then
        # only values that are not scalars are detached
        copy = dict(value)
        for key, item in value.items():
            if type(item) not in SCALARS:
                copy[key] = detached(item, sizes)
        return copy
    return value


def kv_caches_only(caches) -> bool:
    """Whether every cache of a list can be detached (other kinds hold state we cannot copy)."""
    return all(isinstance(cache, KV_CACHES) for cache in caches)


@dataclass
class Entry:
    tokens: tuple[int, ...]
    target: list  # the target's cache list
    parts: list[dict]  # each stateful part's attributes (the drafter's, the prompt lookup's)
    nbytes: int


def snapshot(tokens, target_cache: list, parts) -> Entry:
    """A detached entry of the live state, holding `tokens`."""
    sizes: list[int] = []
    cache = detached(target_cache, sizes)
    states = [detached(vars(part), sizes) for part in parts]
    return Entry(tuple(tokens), cache, states, sum(sizes))


def restore(entry: Entry, target, parts) -> None:
    """Make the live state (target, drafter, lookup) a detached copy of the entry's."""
    target.cache = detached(entry.target)
    for part, state in zip(parts, entry.parts, strict=True):
        vars(part).update(detached(state))


class PrefixPool:
    """Entries by their tokens, least recently used first, of at most `limit_bytes` bytes of KV
    rows in all (an entry larger than that alone is not kept)."""

    def __init__(self, limit_bytes: int):
        self.limit_bytes = limit_bytes
        self.entries: OrderedDict[tuple[int, ...], Entry] = OrderedDict()
        self.nbytes = 0
        self.evictions = 0

    def longest(self, tokens) -> tuple[Entry | None, int]:
        """The entry sharing the longest prefix with `tokens`, and that length (0: none)."""
        best, best_common = None, 0
        for entry in self.entries.values():
            common = shared_prefix(entry.tokens, tokens)
            if common > best_common:
                best, best_common = entry, common
        return best, best_common

    def touch(self, tokens) -> None:
        """A request used the entry holding these tokens (if kept): it is evicted last."""
        if tuple(tokens) in self.entries:
            self.entries.move_to_end(tuple(tokens))

    def put(self, entry: Entry) -> None:
        """Keep an entry; those whose tokens it extends go (it serves every prompt they serve,
        as well or better), then the least recently used while the pool is over its limit."""
        for tokens in [t for t in self.entries if t == entry.tokens[: len(t)]]:
            self._drop(tokens)
        self.entries[entry.tokens] = entry
        self.nbytes += entry.nbytes
        while self.nbytes > self.limit_bytes and self.entries:
            self._drop(next(iter(self.entries)))
            self.evictions += 1

    def _drop(self, tokens) -> None:
        self.nbytes -= self.entries.pop(tokens).nbytes
