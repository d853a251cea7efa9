"""How many tokens to draft and to verify each round. A policy only changes speed: the loop's
acceptance rule keeps the output exact whatever it chooses.

fixed:K              draft and verify K
confidence:FILE      block drafters with a confidence head: draft a block, verify the prefix
                     that maximises expected tokens per second from the cumulative product of
                     the per-slot confidences and the measured verification cost
auto:FILE            chain drafters: choose K before each round from a running estimate of
                     acceptance by position and the latency curve; then verify only as far as
                     the drafter's own probabilities say is worth it

Both adaptive policies may choose 0: a plain decoding step, when the profile says that no draft
(or no verified prefix) is expected to be faster than decoding one token.

FILE is a `woodcock latency` profile; the woodcock command measures one and keeps it in the user
cache when `auto` or `confidence` comes without one (`latency.cached_profile`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from woodcock.errors import DrafterError
from woodcock.runtime.latency import MAX_VERIFY, LatencyProfile


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

    def observe(self, verified: int, accepted: int) -> None:
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

    def observe(self, verified: int, accepted: int) -> None:
        pass


@dataclass
class AutoPolicy:
    """Acceptance at position j (given j-1 accepted) is estimated as (accepted + a) / (tried + a
    + b), a Beta prior centred on `prior` (the drafter's recorded hold-out agreement when it
    ships one, else 0.6) worth `strength` rounds."""

    profile: LatencyProfile
    max_length: int = MAX_VERIFY - 1
    prior: list[float] = field(default_factory=list)
    strength: float = 4.0
    head: str | None = None
    name: str = "auto"
    needs_scores = True

    def __post_init__(self) -> None:
        self.tried = np.zeros(self.max_length)
        self.accepted = np.zeros(self.max_length)

    def acceptance(self) -> list[float]:
        prior = np.array(
            [self.prior[j] if j < len(self.prior) else 0.6 for j in range(self.max_length)]
        )
        a, b = prior * self.strength, (1 - prior) * self.strength
        return list((self.accepted + a) / (self.tried + a + b))

    def draft_length(self, context: int) -> int:
        return self.profile.best_length(self.acceptance(), context, head=self.head)

    def verify_length(
        self, context: int, draft_probs: np.ndarray, confidence: np.ndarray | None
    ) -> int:
        # the drafter's own probability of each token, tempered by what verification has shown
        estimate = np.sqrt(np.array(self.acceptance()[: len(draft_probs)]) * draft_probs)
        return self.profile.best_length(list(estimate), context, verify_only=True)

    def observe(self, verified: int, accepted: int) -> None:
        # position j was tried when all before it were accepted
        tried = min(accepted + 1, verified)
        self.tried[:tried] += 1
        self.accepted[:accepted] += 1


def parse_policy(text: str, drafter, *, prior: list[float] | None = None, head: str | None = None):
    kind, _, value = text.partition(":")
    if kind == "fixed":
        if value.isdigit() and int(value) >= 1:
            return FixedPolicy(int(value))
        raise DrafterError(f"--policy {text!r}: expected fixed:K with K >= 1")
    if kind in ("confidence", "auto"):
        block = getattr(drafter, "num_drafts", None)
        if not value:
            raise DrafterError(
                f"--policy {kind}: needs a latency file ({kind}:latency.json, made by `woodcock"
                " latency`)"
            )
        profile = LatencyProfile.load(value)
        if kind == "confidence":
            if block is None:
                raise DrafterError("--policy confidence is for block drafters (DFlash, DSpark)")
            return ConfidencePolicy(profile, block)
        longest = block or min(MAX_VERIFY, profile.max_verify) - 1
        return AutoPolicy(profile, max_length=max(1, longest), prior=prior or [], head=head)
    raise DrafterError(f"--policy {text!r}: expected fixed:K, confidence:FILE or auto:FILE")
