"""Token distributions with mlx-lm's sampler semantics, and the speculative acceptance rule.

mlx-lm samples from softmax(filtered log-probs / temperature), the filters (top-p, min-p, top-k)
applied in that order to the log-probs before the temperature. Its own filter functions are used
here, so a woodcock distribution is exactly the one `mlx_lm.sample_utils.make_sampler` samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from woodcock.errors import DrafterError


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 0.0  # off unless in (0, 1)
    top_k: int = 0  # off unless > 0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise DrafterError(f"--temp {self.temperature}: expected 0 (greedy) or more")
        if not 0 <= self.top_p <= 1 or not 0 <= self.min_p <= 1 or self.top_k < 0:
            raise DrafterError(
                f"top_p {self.top_p}, min_p {self.min_p}, top_k {self.top_k}: expected"
                " top_p and min_p in [0, 1] and top_k >= 0"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probabilities(self, logits: mx.array) -> mx.array:
        """logits [..., V] -> the distribution mlx-lm would sample from [..., V] (fp32)."""
        logprobs = logits.astype(mx.float32)
        logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
        if 0 < self.top_p < 1:
            logprobs = apply_top_p(logprobs, self.top_p)
        if self.min_p:
            logprobs = apply_min_p(logprobs, self.min_p)
        if self.top_k and self.top_k < logits.shape[-1]:
            logprobs = apply_top_k(logprobs, self.top_k)
        return mx.softmax(logprobs * (1 / self.temperature), axis=-1)

    def sample(self, logits: mx.array) -> mx.array:
        """One token per row of logits [..., V] (argmax when greedy)."""
        if self.greedy:
            return mx.argmax(logits, axis=-1)
        return mx.random.categorical(mx.log(self.probabilities(logits)), axis=-1)


def accept_drafts(drafts: mx.array, q: mx.array, p: mx.array) -> tuple[mx.array, mx.array]:
    """Speculative sampling (Leviathan et al. 2023, Chen et al. 2023): drafts [k] were sampled
    from q [k, V]; p [k+1, V] is the target's distribution at each draft and after the last.
    Accept draft i with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection sample
    from normalise(max(p_i - q_i, 0)); if all are accepted, sample the bonus from p_k. The
    emitted tokens are then distributed exactly as the target samples alone.
    Returns (number accepted m [scalar], the token after them [scalar])."""
    k = drafts.shape[0]
    rows = mx.arange(k)
    p_draft = p[rows, drafts]
    q_draft = q[rows, drafts]
    accepted = mx.random.uniform(shape=(k,)) * q_draft < p_draft  # u < p/q, without dividing
    # index of the first rejection, k when none
    m = mx.argmin(mx.concatenate([accepted, mx.array([False])]).astype(mx.int32))
    residual = mx.maximum(p[:k] - q, 0.0)
    residual = mx.concatenate([residual, p[k:]], axis=0)  # the bonus row samples from p itself
    chosen = residual[m]
    # p == q at a rejected row cannot happen (rejection needs p(d) < q(d)), but rounding can
    # leave no mass: fall back to p there.
    chosen = mx.where(chosen.sum() > 0, chosen, p[m])
    token = mx.random.categorical(mx.log(chosen))
    return m, token
