"""Prompt-lookup (n-gram) drafting: no weights, the drafts are copied from the context.

The history is every token the loop has handed to `add_context` since `reset()`. A proposal
takes the longest suffix of the history, from `max_ngram` tokens down to `min_ngram`, that also
occurred earlier, and copies the tokens that followed its most recent earlier occurrence. The
copy runs on past the end of the history into the tokens it has just proposed (an overlapping
copy, as in LZ77), so a repeating pattern is continued for all k drafts. When no suffix matches,
the last token is proposed k times.

The speculative loop's first `add_context` after `reset()` holds prompt[1:] plus the first
generated token: the prompt's first token never reaches the drafter (the protocol has no place
for it). The history therefore misses one token, which can only lose a match on an n-gram that
starts at the very first prompt token.

Sampling: a copy is deterministic, so the draft distribution q is one-hot. `propose` returns
logits with 0 for the proposed token and -1e9 elsewhere, and the drafts are what `sampler`
returns for them (the proposed ids, for a greedy or a categorical sampler alike). With q one-hot
the loop's rejection rule accepts draft d with probability p(d), exactly as it should.

Unlike the model drafters this one works on the host: `add_context` reads the new tokens back
(`tolist`). It keeps a table from each n-gram to the position after its latest occurrence whose
follower is known, updated as tokens arrive, so `add_context` costs O(new tokens x n-gram
lengths) and `propose` O(max_ngram + k) lookups plus one [k, V] logits array.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import mlx.core as mx

from woodcock.errors import DrafterError
from woodcock.runtime.latency import MAX_VERIFY

NO_MASS = -1e9  # the logit of every token that is not the proposed one


class NgramDrafter:
    """Weight-free drafter: vocab_size is the target's (logits rows are [V])."""

    def __init__(self, vocab_size: int, *, max_ngram: int = 3, min_ngram: int = 1):
        if vocab_size < 1:
            raise DrafterError(f"NgramDrafter: vocab_size = {vocab_size}: expected at least 1")
        if not 1 <= min_ngram <= max_ngram:
            raise DrafterError(
                f"NgramDrafter: min_ngram = {min_ngram}, max_ngram = {max_ngram}: expected"
                " 1 <= min_ngram <= max_ngram"
            )
        self.vocab_size = vocab_size
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.head_target_ids = mx.arange(vocab_size, dtype=mx.int32)
        self._ids = mx.arange(vocab_size, dtype=mx.int32)[None, :]
        self.reset()

    def reset(self) -> None:
        """Forget the history."""
        self.history: list[int] = []
        # n-gram (a tuple of 1..max_ngram tokens) -> index of the token that followed its latest
        # occurrence. An n-gram enters only once its follower is known, so the history's own
        # suffix is never found as its own earlier occurrence.
        self._follower: dict[tuple[int, ...], int] = {}
        self.last_match = 0  # length of the n-gram the last proposal copied after (0: none)

    def add_context(self, tokens: mx.array | Sequence[int], taps: mx.array | None = None) -> None:
        """Append accepted tokens [n] to the history; taps (the target's hidden states) are
        ignored and may be None."""
        if isinstance(tokens, mx.array):
            if tokens.ndim != 1:
                raise DrafterError(
                    f"add_context: tokens.shape = {list(tokens.shape)}: expected [n]"
                )
            tokens = tokens.tolist()
        history, follower = self.history, self._follower
        lengths = range(self.min_ngram, self.max_ngram + 1)
        for token in tokens:
            end = len(history)  # the index `token` gets: it follows the n-grams ending at end-1
            for n in lengths:
                if n > end:
                    break
                follower[tuple(history[end - n : end])] = end
            history.append(int(token))

    def continuation(self, k: int) -> list[int]:
        """The k tokens `propose` drafts, as plain ints (sets `last_match`)."""
        if k < 1:
            raise DrafterError(f"propose: k = {k}: expected at least one token")
        history = self.history
        if not history:
            raise DrafterError("propose: no context; call add_context first")
        size = len(history)
        self.last_match, start = self._longest_match()
        if not self.last_match:
            return [history[-1]] * k
        copied = history[start : start + k]
        # overlapping copy: position start + j is in history or among the drafts
        while len(copied) < k:
            copied.append(copied[len(copied) - (size - start)])
        return copied[:k]

    def match_length(self) -> int:
        """Length of the longest suffix of the history (min_ngram..max_ngram tokens) seen
        before; 0 when there is none. What a proposal would copy after."""
        return self._longest_match()[0]

    def _longest_match(self) -> tuple[int, int]:
        """(n, index of the token that followed the suffix's latest earlier occurrence)."""
        history, size = self.history, len(self.history)
        for n in range(min(self.max_ngram, size), self.min_ngram - 1, -1):
            start = self._follower.get(tuple(history[size - n :]))
            if start is not None:
                return n, start
        return 0, 0

    def propose(self, k: int, sampler: Callable[[mx.array], mx.array]) -> tuple[mx.array, mx.array]:
        """-> (draft tokens [k] int32, logits [k, V] putting all mass on them).

        sampler(logits [..., V]) -> token ids [...] (e.g. `Sampling.sample`); it is called once
        on the [k, V] logits, and with them any greedy or categorical sampler returns the
        copied tokens."""
        proposed = mx.array(self.continuation(k), dtype=mx.int32)
        logits = mx.where(self._ids == proposed[:, None], 0.0, NO_MASS).astype(mx.float32)
        drafts = sampler(logits)
        if drafts.shape != (k,):
            raise DrafterError(
                f"propose: the sampler returned shape {list(drafts.shape)} for logits"
                f" [{k}, {self.vocab_size}]: expected [{k}] (one token per row)"
            )
        return drafts.astype(mx.int32), logits


class PromptLookup(NgramDrafter):
    """Copying next to a model drafter: a round copies from the context instead of asking the
    drafter when the last `min_match`..`max_match` tokens occurred before, and copies
    `extra` tokens more than the match is long (at most `max_copy`). Small targets loop and
    quote: in 20 of the default target's 40 greedy benchmark answers more than a quarter of the
    tokens continue an earlier repeat of eight or more tokens, and there a copy is accepted far
    more often than a drafter's guess; elsewhere two repeated tokens are rare enough that the
    drafter keeps most rounds. `woodcock bench` on the default pair, auto, 10 prompts per
    domain: 1.25x without, 1.96x with."""

    def __init__(
        self,
        vocab_size: int,
        *,
        min_match: int = 2,
        max_match: int = 16,
        extra: int = 2,
        max_copy: int = MAX_VERIFY - 1,
    ):
        super().__init__(vocab_size, max_ngram=max_match, min_ngram=min_match)
        if extra < 0 or max_copy < 1:
            raise DrafterError(
                f"PromptLookup: extra = {extra}, max_copy = {max_copy}: expected extra >= 0 and"
                " max_copy >= 1"
            )
        self.extra, self.max_copy = extra, max_copy

    def copy_length(self) -> int:
        """How many tokens this round should copy; 0: let the drafter draft."""
        matched = self.match_length()
        return min(matched + self.extra, self.max_copy) if matched else 0
