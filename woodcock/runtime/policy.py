"""How many tokens to draft and to verify each round. A policy only changes speed: the loop's
acceptance rule keeps the output exact whatever it chooses.

fixed:K              draft and verify K
confidence:FILE      block drafters with a confidence head: draft a block, verify the prefix
                     that maximises expected tokens per second from the cumulative product of
                     the per-slot confidences and the measured verification cost
auto:FILE            choose K before each round from acceptance by position, drawn from what
                     verification has shown so far, and the latency curve; then verify only as
                     far as the drafter's own probabilities say is worth it

Both adaptive policies may choose 0: a plain decoding step, when the profile says that no draft
(or no verified prefix) is expected to be faster than decoding one token.

When sampling, a cut by scores that depend on the drafts themselves is not made: the acceptance
rule yields the target's distribution only where whether a draft is verified is settled before
it is drawn, and a cut chosen from the drafts' own probabilities (auto), or from confidences
computed from the drafts (a DSpark confidence head reading the Markov features), verifies the
likely drafts more often than the unlikely ones. A sampled round of auto verifies every draft
its draft length asked for; confidence keeps its cut where the head reads the hidden states
alone (`cut_reads_drafts`).

Rounds that copy from the context (prompt lookup, `woodcock.runtime.ngram.PromptLookup`) ask
`copy_length` how many of the proposed copy to verify (0: draft instead) and report back through
`observe_copy`; a copy proposed after the drafter's drafts asks `extension_length` and reports
through `observe_extension` when every draft was accepted (else the copy was never tried).
fixed:K fixes the drafter's length only and verifies whole copies (with copies capped at K,
fixed:2 made the default pair 1.52x instead of 1.92x, 3 prompts per domain); confidence copies
at most a block; auto keeps separate estimates of how often copies are accepted and verifies the
prefix the profile says pays, so a machine where verifying is expensive does not verify long
copies.

FILE is a `woodcock latency` profile; the woodcock command measures one and keeps it in the user
cache when `auto` or `confidence` comes without one (`latency.cached_profile`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from woodcock.errors import DrafterError
from woodcock.runtime.latency import MAX_VERIFY, LatencyProfile
from woodcock.runtime.ngram import MAX_COPY


@dataclass
class FixedPolicy:
    length: int
    name: str = "fixed"

    def draft_length(self, context: int) -> int:
        return self.length

    def verify_length(
        self, context: int, draft_probs: np.ndarray, confidence: np.ndarray | None
    ) -> int:
        return len(draft_probs)

    def cut_reads_drafts(self, drafter) -> bool:
        return False

    def observe(self, verified: int, accepted: int) -> None:
        pass

    def copy_length(self, context: int, proposed: int) -> int:
        return proposed

    def observe_copy(self, verified: int, accepted: int) -> None:
        pass

    def extension_length(self, context: int, drafted: int, proposed: int) -> int:
        return proposed

    def observe_extension(self, verified: int, accepted: int) -> None:
        pass

    needs_scores = False


@dataclass
class ConfidencePolicy:
    profile: LatencyProfile
    block: int
    name: str = "confidence"
    needs_scores = True

    def draft_length(self, context: int) -> int:
        return self.block

    def verify_length(
        self, context: int, draft_probs: np.ndarray, confidence: np.ndarray | None
    ) -> int:
        if confidence is None:
            raise DrafterError("--policy confidence: the drafter has no confidence head")
        return self.profile.best_length(list(confidence), context, verify_only=True)

    def cut_reads_drafts(self, drafter) -> bool:
        return drafter.confidence_reads_drafts

    def observe(self, verified: int, accepted: int) -> None:
        pass

    def copy_length(self, context: int, proposed: int) -> int:
        return min(proposed, self.block)

    def observe_copy(self, verified: int, accepted: int) -> None:
        pass

    def extension_length(self, context: int, drafted: int, proposed: int) -> int:
        return min(proposed, self.block)

    def observe_extension(self, verified: int, accepted: int) -> None:
        pass


PRIOR_FLOOR = 0.01


@dataclass
class AcceptanceEstimate:
    """Acceptance at position j (given j-1 accepted) as (accepted + a) / (tried + a + b): a Beta
    prior centred on prior[j] (0.6 past its end) worth `strength` observations. tied: one rate
    for every position from all the tokens tried (copies: a repeat goes on or breaks off
    wherever it is; by position, the rates past the furthest position verified so far stay at
    the prior, and copies of 31 accepted whole every round were verified whole only after about
    100 rounds, with rows at a twentieth of a step)."""

    length: int
    prior: list[float] = field(default_factory=list)
    strength: float = 4.0
    tied: bool = False

    def __post_init__(self) -> None:
        self.tried = np.zeros(self.length)
        self.accepted = np.zeros(self.length)

    def rates(self) -> list[float]:
        a, b = self._prior_counts()
        if self.tied:
            return list((self.accepted.sum() + a) / (self.tried.sum() + a + b))
        return list((self.accepted + a) / (self.tried + a + b))

    def draw(self, rng: np.random.Generator) -> list[float]:
        """One plausible acceptance by position: a draw from each position's Beta posterior
        (untied)."""
        a, b = self._prior_counts()
        return list(rng.beta(self.accepted + a, self.tried - self.accepted + b))

    def _prior_counts(self) -> tuple[np.ndarray, np.ndarray]:
        prior = np.array(
            [self.prior[j] if j < len(self.prior) else 0.6 for j in range(self.length)]
        )
        # a recorded hold-out of exactly 1 (or 0), as a drafter of a tiny target can reach,
        # would leave a Beta without a parameter: nothing is certain before it is verified
        prior = np.clip(prior, PRIOR_FLOOR, 1 - PRIOR_FLOOR)
        return prior * self.strength, (1 - prior) * self.strength

    def observe(self, verified: int, accepted: int) -> None:
        # position j was tried when all before it were accepted
        tried = min(accepted + 1, verified)
        self.tried[:tried] += 1
        self.accepted[:accepted] += 1


@dataclass
class AutoPolicy:
    """Acceptance is an AcceptanceEstimate: for drafts by position, with the drafter's recorded
    hold-out agreement as the prior when it ships one (else 0.6); for copies a tied one per
    proposed copy length, since the lookup proposes longer copies after longer matches and those
    are accepted far more often (on the default pair's 40 greedy benchmark answers: 0.52 of
    first copied tokens after a two-token match, 0.96 after eight or more), with `copy_prior`
    (0.83 there over all matches, rounded down).

    The draft length is chosen each round from a draw of the drafts' acceptance (Thompson
    sampling), not from its mean: a drafter whose prior sits just below break-even would
    otherwise never draft, so never be verified, and never show whether it pays (the shipped
    DSpark drafter, at a hold-out 0.39 for its first slot, decoded plainly in every round that
    way). The draws narrow as rounds are verified, so a drafter that does not pay is soon tried
    only rarely. `seed` makes the draws, and so the speed, repeatable; the output never depends
    on them. Copies keep the mean: their prior sits far above break-even, so they are tried."""

    profile: LatencyProfile
    max_length: int = MAX_VERIFY - 1
    prior: list[float] = field(default_factory=list)
    strength: float = 4.0
    head: str | None = None
    copy_prior: float = 0.8
    seed: int = 0
    name: str = "auto"
    needs_scores = True

    def __post_init__(self) -> None:
        self.drafts = AcceptanceEstimate(self.max_length, self.prior, self.strength)
        self.copies: dict[int, AcceptanceEstimate] = {}  # by proposed copy length
        self._proposed = 0  # the current round's proposed copy length
        self._rng = np.random.default_rng(self.seed)
        self._drawn: list[float] | None = None  # the acceptance the current round drafts for

    def acceptance(self) -> list[float]:
        return self.drafts.rates()

    def draft_length(self, context: int) -> int:
        self._drawn = self.drafts.draw(self._rng)
        return self.profile.best_length(self._drawn, context, head=self.head)

    def verify_length(
        self, context: int, draft_probs: np.ndarray, confidence: np.ndarray | None
    ) -> int:
        # the drafter's own probability of each token, tempered by the acceptance the round
        # was drafted for
        drawn = self.acceptance() if self._drawn is None else self._drawn
        estimate = np.sqrt(np.array(drawn[: len(draft_probs)]) * draft_probs)
        return self.profile.best_length(list(estimate), context, verify_only=True)

    def cut_reads_drafts(self, drafter) -> bool:
        return True

    def observe(self, verified: int, accepted: int) -> None:
        self.drafts.observe(verified, accepted)

    def copy_length(self, context: int, proposed: int) -> int:
        self._proposed = proposed
        # copying costs no drafting: only the verification has to pay for itself
        rates = self._copies(proposed).rates()[:proposed]
        return self.profile.best_length(rates, context, verify_only=True)

    def observe_copy(self, verified: int, accepted: int) -> None:
        self._copies(self._proposed).observe(verified, accepted)

    def extension_length(self, context: int, drafted: int, proposed: int) -> int:
        """How many of the copied tokens proposed after `drafted` drafts to verify: those whose
        expected tokens (they count only once every draft is accepted) pay for their rows."""
        self._proposed = proposed
        survive = np.cumprod(self.acceptance()[:drafted])
        expected = 1 + float(survive.sum())
        reach = float(survive[-1])
        drafting = self.profile.draft_cost(drafted, self.head)
        best, best_rate = 0, expected / self.profile.round_cost(drafted, context, self.head)
        for length, rate in enumerate(self._copies(proposed).rates()[:proposed], start=1):
            reach *= rate
            expected += reach
            cost = drafting + self.profile.verify_cost(drafted + 1 + length, context)
            if expected / cost > best_rate:
                best, best_rate = length, expected / cost
        return best

    def observe_extension(self, verified: int, accepted: int) -> None:
        self._copies(self._proposed).observe(verified, accepted)

    def _copies(self, proposed: int) -> AcceptanceEstimate:
        if proposed not in self.copies:
            prior = [self.copy_prior] * MAX_COPY
            estimate = AcceptanceEstimate(MAX_COPY, prior, self.strength, tied=True)
            self.copies[proposed] = estimate
        return self.copies[proposed]


def parse_policy(text: str, drafter, *, prior: list[float] | None = None, head: str | None = None):
    if not isinstance(text, str):
        raise DrafterError(
            f"--policy {text!r}: expected text: fixed:K, confidence:FILE or auto:FILE"
        )
    kind, _, value = text.partition(":")
    block = drafter.num_drafts if drafter is not None else None
    if kind == "fixed":
        if not (value.isascii() and value.isdigit() and int(value) >= 1):
            raise DrafterError(f"--policy {text!r}: expected fixed:K with K >= 1")
        if block is not None and int(value) > block:
            raise DrafterError(
                f"--policy {text!r}: the drafter drafts blocks of {block}; expected K <= {block}"
            )
        return FixedPolicy(int(value))
    if kind in ("confidence", "auto"):
        if drafter is None:
            raise DrafterError(f"--policy {kind}: chooses draft lengths, and there is no drafter")
        if not value:
            raise DrafterError(
                f"--policy {kind}: needs a latency file ({kind}:latency.json, made by `woodcock"
                " latency`)"
            )
        if kind == "confidence":
            if block is None:
                raise DrafterError("--policy confidence is for block drafters (DFlash, DSpark)")
            if not getattr(drafter.algorithm, "confidence_head", False):
                raise DrafterError(
                    "--policy confidence: the drafter has no confidence head (DSpark's); use"
                    f" auto:{value} or fixed:K"
                )
            return ConfidencePolicy(LatencyProfile.load(value), block)
        profile = LatencyProfile.load(value)
        longest = block or min(MAX_VERIFY, profile.max_verify) - 1
        return AutoPolicy(profile, max_length=max(1, longest), prior=prior or [], head=head)
    raise DrafterError(f"--policy {text!r}: expected fixed:K, confidence:FILE or auto:FILE")
