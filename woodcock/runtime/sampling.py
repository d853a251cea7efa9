"""Token distributions with mlx-lm's sampler semantics, and the speculative acceptance rule.

mlx-lm samples from softmax(filtered log-probs / temperature), the filters (top-p, min-p, top-k)
applied in that order to the log-probs before the temperature, all in the logits' dtype; greedy
decoding takes the argmax of the log-probs. Its own filter functions are used here, in the same
dtype, so a woodcock distribution is exactly the one `mlx_lm.sample_utils.make_sampler` samples,
and a greedy token the one it picks, ties of bf16 rounding included.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from woodcock.errors import DrafterError


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 0.0  # off unless in (0, 1)
    top_k: int = 0  # off unless > 0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.temperature < math.inf:
            raise DrafterError(f"--temp {self.temperature}: expected 0 (greedy) or a finite number")
        if not 0 <= self.top_p <= 1 or not 0 <= self.min_p <= 1 or self.top_k < 0:
            raise DrafterError(
                f"top_p {self.top_p}, min_p {self.min_p}, top_k {self.top_k}: expected"
                " top_p and min_p in [0, 1] and top_k >= 0"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probabilities(self, logits: mx.array) -> mx.array:
        """logits [..., V] -> the distribution mlx-lm would sample from [..., V] (fp32): the
        filters and the temperature applied in the logits' dtype, as its sampler applies them,
        then normalised in fp32."""
        logprobs = log_softmax(logits)
        if 0 < self.top_p < 1:
            logprobs = apply_top_p(logprobs, self.top_p)
        if self.min_p:
            logprobs = apply_min_p(logprobs, self.min_p)
        if self.top_k and self.top_k < logits.shape[-1]:
            logprobs = apply_top_k(logprobs, self.top_k)
        return mx.softmax((logprobs * (1 / self.temperature)).astype(mx.float32), axis=-1)

    def sample(self, logits: mx.array, key: mx.array | None = None) -> mx.array:
        """One token per row of logits [..., V] (argmax when greedy: a drafter's choice, which
        no exactness depends on; the target's greedy choice is `greedy_tokens`). key: a PRNG key
        to draw with (None: MLX's global random state)."""
        if self.greedy:
            return mx.argmax(logits, axis=-1)
        return mx.random.categorical(mx.log(self.probabilities(logits)), axis=-1, key=key)


def accept_drafts(
    drafts: mx.array, q: mx.array, p: mx.array, key: mx.array | None = None
) -> tuple[mx.array, mx.array]:
    """Speculative sampling (Leviathan et al. 2023, Chen et al. 2023): drafts [k] were sampled
    from q [k, V]; p [k+1, V] is the target's distribution at each draft and after the last.
    Accept draft i with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection sample
    from normalise(max(p_i - q_i, 0)); if all are accepted, sample the bonus from p_k. The
    emitted tokens are then distributed exactly as the target samples alone.
    key: a PRNG key to draw with (None: MLX's global random state).
    Returns (number accepted m [scalar], the token after them [scalar])."""
    k = drafts.shape[0]
    uniform_key, residual_key = (None, None) if key is None else mx.random.split(key)
    rows = mx.arange(k)
    p_draft = p[rows, drafts]
    q_draft = q[rows, drafts]
    # u < p/q, without dividing
    accepted = mx.random.uniform(shape=(k,), key=uniform_key) * q_draft < p_draft
    # index of the first rejection, k when none
    m = mx.argmin(mx.concatenate([accepted, mx.array([False])]).astype(mx.int32))
    residual = mx.maximum(p[:k] - q, 0.0)
    residual = mx.concatenate([residual, p[k:]], axis=0)  # the bonus row samples from p itself
    chosen = residual[m]
    # p == q at a rejected row cannot happen (rejection needs p(d) < q(d)), but rounding can
    # leave no mass: fall back to p there.
    chosen = mx.where(chosen.sum() > 0, chosen, p[m])
    token = mx.random.categorical(mx.log(chosen), key=residual_key)
    return m, token


# mlx-lm's logits processor signature: (tokens so far [n], logits [1, V]) -> logits [1, V]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


class LogitBias:
    """mlx-lm's logit bias: add a fixed value to some tokens' logits, at every position."""

    def __init__(self, bias: dict[int, float]):
        self.indices = mx.array(list(bias.keys()))
        self.values = mx.array(list(bias.values()))

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        return logits.at[:, self.indices].add(self.values)

    def rows(self, history: list[int], proposed: list[int], logits: mx.array) -> mx.array:
        return self(None, logits)  # the same bias at every row, whatever came before


class HistoryPenalty:
    """mlx-lm's repetition, presence and frequency penalties (`mlx_lm.sample_utils`): the same
    arithmetic on the same tokens (the last `context_size` of the history), for one position as
    mlx-lm calls it or for every row of a verification at once."""

    KINDS = ("repetition", "presence", "frequency")

    def __init__(self, kind: str, penalty: float, context_size: int = 20):
        if kind not in self.KINDS:
            raise ValueError(f"penalty kind {kind!r}: expected one of {', '.join(self.KINDS)}")
        if kind == "repetition" and penalty < 0:
            raise ValueError(f"penalty must be a non-negative float, got {penalty}")
        if context_size < 0:
            raise ValueError(f"context_size must be at least 0, got {context_size}")
        self.kind, self.penalty, self.context_size = kind, penalty, context_size

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if len(tokens) == 0:
            return logits
        columns = tokens[-self.context_size :]
        return self._apply(logits, mx.zeros(columns.shape, mx.int32), columns)

    def rows(self, history: list[int], proposed: list[int], logits: mx.array) -> mx.array:
        """logits [k+1, V], row i at the position after history + proposed[:i]."""
        recent = history[-self.context_size :]  # 0: all of it, as mlx-lm slices
        tokens = np.array(recent + proposed, np.int32)
        ends = len(recent) + np.arange(len(proposed) + 1)
        starts = np.maximum(ends - self.context_size, 0) if self.context_size else 0 * ends
        rows = np.repeat(np.arange(len(ends), dtype=np.int32), ends - starts)
        columns = np.concatenate([tokens[s:e] for s, e in zip(starts, ends, strict=True)])
        if not len(columns):
            return logits
        return self._apply(logits, mx.array(rows), mx.array(columns))

    def _apply(self, logits: mx.array, rows: mx.array, columns: mx.array) -> mx.array:
        if self.kind == "frequency":
            return logits.at[rows, columns].subtract(self.penalty)  # once per occurrence
        seen = mx.zeros(logits.shape, mx.bool_)  # once per token, however often it came
        seen[rows, columns] = True
        if self.kind == "repetition":
            penalised = mx.where(logits < 0, logits * self.penalty, logits / self.penalty)
        else:
            penalised = logits - self.penalty
        return mx.where(seen, penalised, logits)


def make_logits_processors(
    logit_bias: dict[int, float] | None = None,
    repetition_penalty: float | None = None,
    repetition_context_size: int = 20,
    presence_penalty: float | None = None,
    presence_context_size: int = 20,
    frequency_penalty: float | None = None,
    frequency_context_size: int = 20,
) -> list[LogitsProcessor]:
    """`mlx_lm.sample_utils.make_logits_processors`, with processors the speculative loop
    applies to all the verified rows at once (the same order, the same values)."""
    processors: list[LogitsProcessor] = [LogitBias(logit_bias)] if logit_bias else []
    for kind, penalty, context_size in (
        ("repetition", repetition_penalty, repetition_context_size),
        ("presence", presence_penalty, presence_context_size),
        ("frequency", frequency_penalty, frequency_context_size),
    ):
        if penalty is not None and penalty != 0:
            processors.append(HistoryPenalty(kind, penalty, context_size))
    return processors


def process_logits(
    processors: Sequence[LogitsProcessor],
    history: list[int],
    proposed: list[int],
    logits: mx.array,
) -> mx.array:
    """logits [k+1, V] of a verification, row i at the position after history + proposed[:i]
    -> the processed logits: each processor sees the tokens before the row's position, as
    plain decoding would have given them. Processors with a `rows` method take every row at
    once; any other `processor(tokens, logits)` is called row by row."""
    for processor in processors:
        rows = getattr(processor, "rows", None)
        if rows is not None:
            logits = rows(history, proposed, logits)
            continue
        logits = mx.concatenate(
            [
                processor(mx.array(history + proposed[:i], mx.int32), logits[i : i + 1])
                for i in range(len(proposed) + 1)
            ]
        )
    return logits


def log_softmax(logits: mx.array) -> mx.array:
    """The processed logits [..., V] normalised in their own dtype, before the temperature and
    the filters: what mlx-lm's `generate_step` reports and hands its sampler. In bf16 this
    rounding can tie two tokens whose logits differ by a bf16 step."""
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def greedy_tokens(logits: mx.array) -> mx.array:
    """mlx-lm's greedy choice per row of logits [..., V]: the argmax of `log_softmax`, the lowest
    id among the tokens its rounding ties (the argmax of the logits themselves can be another
    token of the tie)."""
    return mx.argmax(log_softmax(logits), axis=-1)


def near_ties(logits: mx.array) -> mx.array:
    """logits [..., V] -> [...] bool: rows where `greedy_tokens` may differ from the argmax of
    the logits, because another token lies within the rounding step of `log_softmax` below the
    largest. Elsewhere the argmax is the greedy token, and costs no exp over the vocabulary
    (on MLX's CPU backend about 16 ns an element).

    Rounding to nearest keeps the order of two values, and merges them only where they are at
    most a step apart at their magnitude; a largest token's log-probability lies within
    log(V) of 0 (plus the rounding of the logsumexp), so twice that bounds the magnitude."""
    window = ulp(logits.dtype, 2 * (math.log(logits.shape[-1]) + 1))
    top = mx.max(logits, axis=-1, keepdims=True)
    return (logits >= top - window).sum(axis=-1) > 1


def ulp(dtype, magnitude: float) -> float:
    """The spacing of `dtype`'s values at `magnitude`."""
    if magnitude <= 0 or not math.isfinite(magnitude):
        return 0.0
    return mx.finfo(dtype).eps * 2.0 ** math.floor(math.log2(magnitude))
