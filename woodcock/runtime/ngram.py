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

NO_MASS = -1e9  # the logit of every token that is not the proposed one
# most drafts a round of prompt lookup verifies: verifying 32 rows costs 2.6 times one row on
# the default pair (2 CPU threads), and a loop copied whole saves a round per token beyond it
MAX_COPY = 31


class NgramDrafter:
    """Weight-free drafter: vocab_size is the target's (logits rows are [V])."""

    num_drafts = None  # a chain: any length
    last_confidence = None  # no confidence head
    confidence_reads_drafts = False

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

    def trim(self, rows: int) -> None:
        """Keep the first `rows` tokens of the history, as if only they had been added."""
        if not 0 <= rows <= len(self.history):
            raise DrafterError(
                f"trim: rows = {rows}: expected at most the {len(self.history)} tokens added"
            )
        kept = self.history[:rows]
        self.reset()
        self.add_context(kept)

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

    def continuation(self, k: int, after: Sequence[int] = ()) -> list[int]:
        """The k tokens `propose` drafts, as plain ints (sets `last_match`). after: tokens taken
        to follow the history (drafts not verified yet); the match is a suffix of history +
        after and the copy may run on into them."""
        if k < 1:
            raise DrafterError(f"propose: k = {k}: expected at least one token")
        history = self.history
        if not history:
            raise DrafterError("propose: no context; call add_context first")
        self.last_match, start = self._longest_match(after)
        if not self.last_match:
            return [(list(after) or history)[-1]] * k
        size = len(history) + len(after)
        copied: list[int] = []
        for j in range(k):
            i = start + j
            if i < len(history):
                copied.append(history[i])
            elif i < size:
                copied.append(after[i - len(history)])
            else:  # overlapping copy: position i repeats i - (size - start), already copied
                copied.append(copied[j - (size - start)])
        return copied

    def match_length(self, after: Sequence[int] = ()) -> int:
        """Length of the longest suffix of history + after (min_ngram..max_ngram tokens) seen
        in the history before; 0 when there is none. What a proposal would copy after."""
        return self._longest_match(after)[0]

    def _longest_match(self, after: Sequence[int] = ()) -> tuple[int, int]:
        """(n, index of the token that followed the suffix's latest earlier occurrence)."""
        tail = self.history[-self.max_ngram :] + list(after)
        size = len(self.history) + len(after)
        for n in range(min(self.max_ngram, size), self.min_ngram - 1, -1):
            start = self._follower.get(tuple(tail[len(tail) - n :]))
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
    """Copying next to a model drafter. A round copies from the context instead of asking the
    drafter when the last `min_match`..`max_match` tokens occurred before; a drafter's round
    whose drafts close such a repeat is extended by a copy after them. Either copy is as long
    again as the match (at most `max_copy` drafts a round in all): the longer a repeat has run,
    the longer it tends to go on. Small targets loop and quote: in 20 of the default target's
    40 greedy benchmark answers more than a quarter of the tokens continue an earlier repeat of
    eight or more tokens, and there a copy is accepted far more often than a drafter's guess;
    elsewhere two repeated tokens are rare enough that the drafter keeps most rounds.
    `woodcock bench` on the default pair, auto, 10 prompts per domain: 1.25x and 1.99 tokens
    per round without lookup; 1.96x and 2.84 with copies of the match + 2 tokens (at most 15,
    no extensions); 1.95x and 1.98x in two runs, 3.05, as here (on a day the baseline ran 8 %
    slower)."""

    def __init__(
        self,
        vocab_size: int,
        *,
        min_match: int = 2,
        max_match: int = 16,
        max_copy: int = MAX_COPY,
    ):
        super().__init__(vocab_size, max_ngram=max_match, min_ngram=min_match)
        if max_copy < 1:
            raise DrafterError(f"PromptLookup: max_copy = {max_copy}: expected at least 1")
        self.max_copy = max_copy

    def copy_length(self, after: Sequence[int] = ()) -> int:
        """How many tokens to copy after history + after (the drafts of this round): 0 when
        nothing repeats, which in a round of its own lets the drafter draft."""
        matched = self.match_length(after)
        return max(0, min(2 * matched, self.max_copy - len(after))) if matched else 0
