"""Where a speculative run's greedy output first leaves plain decoding's, and whether the backend's
rounding can explain it.

Plain decoding computes each token's logits in a one-row forward; speculative decoding in the
verify forward of a round, several rows at once. Mathematically the same row; numerically a GEMM
of more rows may take another kernel or another reduction order (on CUDA with TF32 another
precision), so the two can differ in the last bits, and where the target's top two tokens are
that close the two paths may pick differently: a tie. A divergence that rounding cannot explain
is a real difference (a bug).

At the first divergence both paths' logits are replayed: plain decoding's with mlx-lm's own
`generate_step`, the verify forward's by replaying the speculative run's prefill and rounds with
their row counts. The rounding noise is measured on the same target, dtype and row count, over
the positions both runs agree on: max |one-row logits - the same rows' logits in one forward|.
A margin is the difference of two log-probabilities (what greedy decoding ranks: the logits
normalised in the target's dtype), each of which may move by the noise, so the pair's order is
rounding's to decide only while both margins are within twice the noise: a tie. Each path must
also have ranked its own token first (margins of at least 0): a verify forward that
ranks plain decoding's token above the one the run emitted shows that the run did not emit its
own verify path's choice, which no rounding explains.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import mlx.core as mx
from mlx_lm.generate import generate_step

from woodcock.runtime.decode import Stats
from woodcock.runtime.prefill import prefill_sizes
from woodcock.runtime.sampling import greedy_tokens, log_softmax, ulp
from woodcock.runtime.target import MlxTarget

NOISE_WINDOWS = 4  # verify-sized windows the noise is measured over


@dataclass(frozen=True)
class Divergence:
    position: int  # index of the first differing generated token
    plain_token: int  # plain decoding's token there (an EOS id where it stopped)
    woodcock_token: int  # the speculative run's
    one_row_margin: float  # plain's token over woodcock's, in plain decoding's log-probabilities
    verify_margin: float  # woodcock's token over plain's, in the verify forward's
    verify_rows: int  # rows of the forward that verified the position (the prefill's there)
    noise: float  # measured max |one-row - multi-row| logit difference, at least one ulp

    @property
    def tie(self) -> bool:
        bound = 2 * self.noise
        return 0 <= self.one_row_margin <= bound and 0 <= self.verify_margin <= bound

    def as_dict(self) -> dict:
        return {**asdict(self), "kind": "tie" if self.tie else "different"}


def first_divergence(expected: Sequence[int], ours: Sequence[int]) -> int | None:
    """The first index where the two differ, the shorter one's length where one is a prefix of
    the other (it stopped there), None where they are equal."""
    if list(expected) == list(ours):
        return None
    return next(
        (i for i, (a, b) in enumerate(zip(expected, ours, strict=False)) if a != b),
        min(len(expected), len(ours)),
    )


def classify(
    session, prompt: Sequence[int], expected: Sequence[int], tokens: Sequence[int], stats: Stats
) -> Divergence | None:
    """Compare plain decoding's tokens (`expected`) with a speculative run's (`tokens`, its
    rounds in `stats`) over `prompt` on the session's target; None where they are equal. Leaves
    the target's cache empty."""
    position = first_divergence(expected, tokens)
    if position is None:
        return None
    one_row = plain_logits(session.model, prompt, position)
    verify, rows = verify_logits(session.target, prompt, tokens, stats, position)
    plain_token = expected[position] if position < len(expected) else greedy_tokens(one_row).item()
    ours = tokens[position] if position < len(tokens) else greedy_tokens(verify).item()
    noise = rounding_noise(session.target, [*prompt, *expected[:position]], rows)
    floor = ulp(one_row.dtype, mx.abs(one_row).max().item())
    # both paths rank log-probabilities rounded in the target's dtype (greedy_tokens)
    one_row, verify = (log_softmax(x).astype(mx.float32) for x in (one_row, verify))
    session.target.reset()
    return Divergence(
        position=position,
        plain_token=plain_token,
        woodcock_token=ours,
        one_row_margin=(one_row[plain_token] - one_row[ours]).item(),
        verify_margin=(verify[ours] - verify[plain_token]).item(),
        verify_rows=rows,
        noise=max(noise, floor),
    )


def plain_logits(model, prompt: Sequence[int], position: int) -> mx.array:
    """The logits [V] plain greedy decoding computed for generated token `position`, replayed
    with mlx-lm's generate_step (what `stream_generate` runs), read before its log-softmax."""
    kept = []

    def keep(_, logits):
        kept.append(logits)
        return logits

    steps = generate_step(
        mx.array(prompt),
        model,
        max_tokens=position + 1,
        sampler=lambda logprobs: mx.argmax(logprobs, axis=-1),
        logits_processors=[keep],
    )
    for _ in steps:
        pass
    return kept[position][0]


def verify_logits(
    target: MlxTarget, prompt: Sequence[int], tokens: Sequence[int], stats: Stats, position: int
) -> tuple[mx.array, int]:
    """The logits [V] the speculative run's target computed for generated token `position`, and
    the rows of that forward: the prompt prefilled in the decoding loop's chunks (position 0 is
    its last row), then every round's verify forward with its own number of rows (the anchor and
    its drafts), the rejected rows rolled back. A row's result depends on how many rows the
    forward has, not on the later rows' tokens, so rows past the known tokens repeat the last."""
    target.reset()
    rows = mx.array(prompt, mx.int32)
    for start, end in prefill_sizes().spans(len(prompt)):
        logits, _ = target.forward(rows[start:end])
        mx.eval(logits)
    if position == 0:
        return logits[-1], logits.shape[0]
    start = 1  # the first token a round emits
    for drafted, accepted in zip(stats.drafted, stats.accepted, strict=True):
        verified = [tokens[start - 1], *tokens[start : start + drafted]]
        verified += verified[-1:] * (drafted + 1 - len(verified))
        logits, _ = target.forward(mx.array(verified, mx.int32))
        if position <= start + accepted:
            return logits[position - start], drafted + 1
        mx.eval(logits)
        target.rollback(drafted - accepted)
        start += accepted + 1
    raise ValueError(f"no round emitted token {position}")


def rounding_noise(target: MlxTarget, sequence: Sequence[int], rows: int) -> float:
    """max |one-row logits - the same rows' logits inside one forward of `rows` rows|, over up to
    NOISE_WINDOWS windows at the end of `sequence`, each from the same cache."""
    rows = min(rows, len(sequence) - 1)
    if rows < 2:
        return 0.0  # a forward of one row is the one-row path
    windows = min(NOISE_WINDOWS, (len(sequence) - 1) // rows)
    first = len(sequence) - windows * rows
    target.reset()
    mx.eval(target.forward(mx.array(sequence[:first], mx.int32))[0])
    worst = 0.0
    for start in range(first, len(sequence), rows):
        window = mx.array(sequence[start : start + rows], mx.int32)
        together, _ = target.forward(window)
        mx.eval(together)
        target.rollback(rows)
        alone = []
        for i in range(rows):
            logits, _ = target.forward(window[i : i + 1])
            mx.eval(logits)
            alone.append(logits[0])
        difference = mx.abs(together.astype(mx.float32) - mx.stack(alone).astype(mx.float32))
        worst = max(worst, difference.max().item())
    return worst
