"""Greedy answers to many prompts, decoded together: what `woodcock distill` generates with.

Up to `batch` answers decode in one woodcock.runtime.batch SequenceBatch (every sequence from
position 0 of its own row); a finished answer leaves at once and the next prompts join,
shortest first, in groups prefilled together in a batch of their own (padded to the group's
longest, in the backend's chunks, woodcock.runtime.prefill; only the caches are computed, not
the prompt positions' logits) and then copied into free rows. Where the sizes say so (the
CPU's), a prompt that begins with another prompt's head (all but its last token: a later turn
of the same conversation) joins in the first group after that head's cache is made and is
prefilled from a copy of it, so only its own tokens past it are computed; a head's cache is kept
only until the prompts beginning with it have joined. A step feeds every row its newest token
and takes the argmax of the logits; nothing per row is computed but that argmax and whether
another token lies within rounding of it (no log-probabilities: their exp over the vocabulary
would cost about a tenth of a step on the CPU), and the host reads one step's tokens while the
device runs the next (a finished row costs one wasted position). Where rounding may tie, the
log-probabilities decide as in mlx-lm (woodcock.runtime.sampling.greedy_tokens); a row that was
fed another token takes that position back and is fed the right one."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from woodcock.runtime.batch import SequenceBatch
from woodcock.runtime.prefill import PrefillSizes, prefill_sizes
from woodcock.runtime.sampling import greedy_tokens, near_ties
from woodcock.runtime.target import MlxTarget

PADDING = 1.25  # most padded tokens per prompt token in a prefill group


@dataclass
class Answer:
    index: int  # the prompt's position in the list given
    tokens: list[int]  # what the target generated, the stop token included when it stopped
    finish_reason: str  # "stop" or "length"


@dataclass
class _Row:
    answer: Answer
    started: bool = False  # False: the row's newest token is its prompt's last, not an answer's


def greedy_answers(
    target: MlxTarget,
    prompts: Sequence[Sequence[int]],
    *,
    batch: int,
    max_tokens: int,
    stop_ids: Sequence[int],
    sizes: PrefillSizes | None = None,
) -> Iterator[Answer]:
    """Each prompt's greedy answer (at most `max_tokens` tokens, ending at the first of
    `stop_ids`), yielded as it finishes: the order is not the prompts'. sizes: how prompts are
    prefilled (default: the backend's)."""
    sizes = sizes or prefill_sizes()
    stop = set(stop_ids)
    if sizes.shared_heads:  # a head: what a prefill computes, all but the last token
        parent, children = _prefix_forest([tuple(p[:-1]) for p in prompts])
    else:
        parent, children = [None] * len(prompts), [[] for _ in prompts]
    new_tokens = [
        len(p) - (0 if parent[i] is None else len(prompts[parent[i]]) - 1)
        for i, p in enumerate(prompts)
    ]
    waiting = _joining_order(prompts, parent, children)[::-1]  # popped from the end
    # a prompt's head caches, kept while prompts beginning with it wait
    kept: dict[int, list[KVCache]] = {}
    children_waiting = [len(c) for c in children]
    rows = SequenceBatch(target, batch)
    decoding: list[_Row] = []  # row i's answer so far
    # [B] each row's newest token, fed in the next step (the argmax of the logits it came from),
    # whether rounding may make mlx-lm's greedy choice another token there (near_ties), and
    # that choice (lazy: computed only for a step with such a row)
    newest, unsure, exact = mx.zeros((0,), mx.int32), mx.zeros((0,), mx.bool_), None
    while waiting or decoding:
        if waiting and len(decoding) < batch:
            group = _take_group(new_tokens, parent, kept, waiting, batch - len(decoding), sizes)
            starts = [kept.get(parent[i]) for i in group]
            prefilled, head_caches = _prefill_into(rows, [prompts[i] for i in group], starts, sizes)
            for i, caches in zip(group, head_caches, strict=True):
                if children[i]:  # evaluated: a lazy copy would hold the group's whole buffers
                    mx.eval([(c.keys, c.values) for c in caches])
                    kept[i] = caches
                if parent[i] is not None:
                    children_waiting[parent[i]] -= 1
                    if not children_waiting[parent[i]]:
                        del kept[parent[i]]
            newest = mx.concatenate([newest, prefilled])
            unsure = mx.concatenate([unsure, mx.zeros(prefilled.shape, mx.bool_)])
            exact = prefilled if exact is None else mx.concatenate([exact, prefilled])
            decoding += [_Row(Answer(i, [], "")) for i in group]
        logits, _ = rows.forward_equal(newest[:, None])
        last = logits[:, -1]  # [B, V]
        following = mx.argmax(last, axis=-1).astype(mx.int32)  # [B]
        following_unsure = near_ties(last)
        mx.async_eval(following, following_unsure)
        tokens = newest.tolist()
        corrected = {}  # row -> mlx-lm's choice where this step fed another token
        if any(unsure.tolist()):
            corrected = {r: t for r, t in enumerate(exact.tolist()) if t != tokens[r]}
        finished = []
        for row, (state, token) in enumerate(zip(decoding, tokens, strict=True)):
            if row in corrected:
                # this step wrote the wrong token's keys and values: take them back, and feed
                # the right one at the same position in the next step
                rows.slots[row].rollback(1)
                continue
            if not state.started:
                state.started = True
                continue
            answer = state.answer
            answer.tokens.append(token)
            if token in stop or len(answer.tokens) == max_tokens:
                answer.finish_reason = "stop" if token in stop else "length"
                finished.append(row)
                yield answer
        newest, unsure = following, following_unsure
        exact = greedy_tokens(last).astype(mx.int32)
        if corrected:
            fixed, right = mx.array(list(corrected)), mx.array(list(corrected.values()), mx.int32)
            newest[fixed], exact[fixed], unsure[fixed] = right, right, False
        if finished:
            newest, unsure, exact = _drop_rows(rows, decoding, [newest, unsure, exact], finished)


def _prefix_forest(heads: list[tuple[int, ...]]) -> tuple[list[int | None], list[list[int]]]:
    """Each prompt's parent: the prompt with the longest non-empty head that begins its own head
    (None where none does), and each prompt's children. In lexicographic order every head follows
    its prefixes, and the heads beginning with one form a run right after it; so one pass keeps
    the chain of prefixes of the current head on a stack."""
    parent: list[int | None] = [None] * len(heads)
    children: list[list[int]] = [[] for _ in heads]
    chain: list[int] = []
    for i in sorted(range(len(heads)), key=heads.__getitem__):
        head = heads[i]
        while chain and head[: len(heads[chain[-1]])] != heads[chain[-1]]:
            chain.pop()
        if chain:
            parent[i] = chain[-1]
            children[chain[-1]].append(i)
        if head:
            chain.append(i)
    return parent, children


def _joining_order(prompts, parent: list[int | None], children: list[list[int]]) -> list[int]:
    """Shortest first (a group's prompts are then about as long as each other, so padding them to
    the longest costs little), each prompt followed at once by those beginning with it, depth
    first: a kept cache is dropped soon after it was made."""

    def longest_first(indices):  # ties in the prompts' order
        return sorted(indices, key=lambda i: (len(prompts[i]), i), reverse=True)

    stack = longest_first(i for i, p in enumerate(parent) if p is None)
    order = []
    while stack:
        i = stack.pop()
        order.append(i)
        stack += longest_first(children[i])
    return order


def _take_group(
    new_tokens: list[int],
    parent: list[int | None],
    prefilled: dict[int, list[KVCache]],
    waiting: list[int],
    room: int,
    sizes: PrefillSizes,
) -> list[int]:
    """The next waiting prompts to prefill together (always the first): at most `room`, as many as
    fit the sizes' group tokens in a first chunk, padded to no more than PADDING times their own
    new tokens (the rest join at the next step). A prompt whose parent's cache is not made yet
    (its parent is in this group, or waits itself) is passed over, at most `room` of them: it
    joins a later group, and the prompts after it may join this one."""
    group = [waiting.pop()]
    width = real = min(new_tokens[group[0]], sizes.chunk)
    joined, passed = [], 0  # joined: positions in `waiting`
    position = len(waiting)
    while position and len(group) < room and passed < room:
        position -= 1
        candidate = waiting[position]
        if parent[candidate] is not None and parent[candidate] not in prefilled:
            passed += 1
            continue
        length = min(new_tokens[candidate], sizes.chunk)
        wider = max(width, length)
        padded = (len(group) + 1) * wider
        if padded > sizes.group_tokens or padded > PADDING * (real + length):
            break
        group.append(candidate)
        joined.append(position)
        width, real = wider, real + length
    for position in joined:  # from the end: each deletion leaves the earlier positions valid
        del waiting[position]
    return group


def _prefill_into(
    rows: SequenceBatch,
    prompts: list[Sequence[int]],
    starts: list[list[KVCache] | None],
    sizes: PrefillSizes,
) -> tuple[mx.array, list[list[KVCache]]]:
    """Prefill all but the last token of `prompts` together, each after the head caches it starts
    from (None: from nothing), and add them to `rows`: their last tokens [G], which the next step
    feeds, and each prompt's head caches (one per layer). Only the caches are evaluated: the
    logits of the prompts' positions (a vocabulary-wide matmul per token) are never computed."""
    target = rows.target
    group = SequenceBatch(target, len(prompts))
    slots = [group.add(start or [KVCache() for _ in target.cache]) for start in starts]
    cached = [slot.offset for slot in slots]
    rests = [p[done:-1] for p, done in zip(prompts, cached, strict=True)]
    for start, end in sizes.spans(max(map(len, rests)), rows=len(rests), cached=max(cached)):
        group.forward([mx.array(list(r[start:end]), mx.int32) for r in rests])
        mx.eval([(layer.keys, layer.values) for layer in group.caches])
    head_caches = [
        [layer.read_row(slot.row, slot.offset) for layer in group.caches] for slot in slots
    ]
    for caches in head_caches:
        rows.add(caches)
    return mx.array([p[-1] for p in prompts], mx.int32), head_caches


def _drop_rows(
    rows: SequenceBatch, decoding: list, per_row: list[mx.array], finished: list[int]
) -> list[mx.array]:
    """Take the finished rows out of the batch (each leaving row's place goes to the batch's last
    row, as SequenceBatch.remove does) and out of `decoding`: the `per_row` arrays [B] in the new
    row order."""
    order = list(range(len(decoding)))
    for row in sorted(finished, reverse=True):
        rows.remove(rows.slots[row])
        last = order.pop()
        decoding[row] = decoding[-1]
        decoding.pop()
        if row < len(order):
            order[row] = last
    index = mx.array(order, mx.int32)
    return [x[index] if order else x[:0] for x in per_row]
