"""The speculative decoding loop: draft K tokens, verify them in one target forward, keep the
longest acceptable prefix plus one target token, roll both caches back.

Invariant between rounds: the target's KV cache holds every emitted token except the last one
(the anchor); the anchor and the drafts are verified together, so the verified rows' hidden
states are exactly the drafter's next context.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import mlx.core as mx
import numpy as np

from woodcock.runtime.ngram import PromptLookup
from woodcock.runtime.policy import FixedPolicy
from woodcock.runtime.sampling import Sampling, accept_drafts
from woodcock.runtime.target import MlxTarget

PREFILL_CHUNK = 512
GREEDY = Sampling()
NO_DRAFTS = (mx.zeros((0,), mx.int32), mx.zeros((0, 0)))  # tokens [0], logits [0, Vh]
# A lazy array belongs to the stream of the thread that made it: evaluated now, the constant
# can be used by a loop running in any thread (a server generates in a worker thread).
mx.eval(NO_DRAFTS)


class RuntimeDrafter(Protocol):
    head_target_ids: mx.array  # [Vh] target id of each draft-head row

    def reset(self) -> None: ...

    def add_context(self, tokens: mx.array, taps: mx.array) -> None: ...

    def propose(self, k: int, sampler) -> tuple[mx.array, mx.array]: ...

    def trim(self, rows: int) -> None: ...  # keep the first `rows` context rows


@dataclass
class Stats:
    """Per-round counts and timings of one generation."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose rows an earlier generation left in the caches
    prompt_seconds: float = 0.0
    drafted: list[int] = field(default_factory=list)  # K of each round
    accepted: list[int] = field(default_factory=list)  # accepted drafts of each round
    copied: list[bool] = field(default_factory=list)  # each round: copied by prompt lookup
    # each round: drafts prompt lookup copied after the drafter's (0 in rounds that copied)
    extended: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0

    @property
    def rounds(self) -> int:
        return len(self.accepted)

    @property
    def average_draft_length(self) -> float:
        return sum(self.drafted) / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_round(self) -> float:
        return (sum(self.accepted) + self.rounds) / self.rounds if self.rounds else 0.0

    def acceptance_by_position(self) -> list[float]:
        """Share of the drafter's rounds (not those that copied) whose draft at position i
        (0-based) was accepted, among those that drafted that far; the drafter's drafts only,
        not the copies that extended them."""
        rounds = [
            (k - e, min(m, k - e))
            for k, m, c, e in zip(
                self.drafted, self.accepted, self.copied, self.extended, strict=True
            )
            if not c
        ]
        rates = []
        for i in range(max((k for k, _ in rounds), default=0)):
            tried = sum(1 for k, _ in rounds if k > i)
            rates.append(sum(1 for _, m in rounds if m > i) / tried)
        return rates

    @property
    def copied_rounds(self) -> int:
        return sum(self.copied)

    @property
    def copied_tokens_per_round(self) -> float:
        """Tokens a prompt-lookup round emitted on average (its accepted copies + one)."""
        kept = [m + 1 for m, c in zip(self.accepted, self.copied, strict=True) if c]
        return sum(kept) / len(kept) if kept else 0.0

    @property
    def extended_rounds(self) -> int:
        """The drafter's rounds that prompt lookup extended with a copy after the drafts."""
        return sum(1 for e in self.extended if e)


def speculative_generate_step(
    prompt: Sequence[int],
    target: MlxTarget,
    drafter: RuntimeDrafter,
    *,
    num_draft: int | None = None,
    policy=None,
    sampling: Sampling = GREEDY,
    stats: Stats | None = None,
    lookup: PromptLookup | None = None,
    cached: int = 0,
    cancelled: Callable[[], bool] | None = None,
) -> Iterator[tuple[int, bool]]:
    """Yields (token, from_draft) forever; the caller stops at EOS or a length limit. Draft
    length: num_draft (fixed), or a policy from woodcock.runtime.policy. lookup: rounds whose
    recent tokens repeat copy from the context instead, as far as the policy's `copy_length`
    says, and drafts that close a repeat are followed by a copy as far as its
    `extension_length` says.

    cached: the first `cached` prompt tokens are those an earlier call over the same target and
    drafter began its stream with, and their rows are still in both caches (the target's keys
    and values, the drafter's context rows, which read the token after each position): they
    are kept and only the rest of the prompt is prefilled (0: start from empty caches; a
    rotating cache that cannot drop the rest falls back to 0). cancelled: asked between prefill
    chunks and before every round; when it returns True the stream ends (cut short in the
    prefill, it leaves both caches empty)."""
    if (num_draft is None) == (policy is None):
        raise ValueError("give exactly one of num_draft and policy")
    if not 0 <= cached < len(prompt) or cached > target.offset:
        raise ValueError(
            f"cached = {cached}: expected fewer than the prompt's {len(prompt)} tokens and at"
            f" most the {target.offset} in the target's cache"
        )
    policy = policy or FixedPolicy(num_draft)
    stats = stats if stats is not None else Stats()
    cached = cached if cached and target.truncate(cached) else 0
    if cached:
        drafter.trim(cached)
    else:
        target.reset()
        drafter.reset()
    start = time.perf_counter()
    prefilled = _prefill(target, mx.array(prompt[cached:]), cancelled)  # [V], [P - c, A*Ht]
    if prefilled is None:
        target.reset()
        drafter.reset()
        return
    logits, taps = prefilled
    anchor = sampling.sample(logits)
    context_tokens = mx.concatenate([mx.array(prompt[cached + 1 :], mx.int32), anchor[None]])
    drafter.add_context(context_tokens, taps)
    mx.eval(anchor)
    if lookup is not None:
        if cached:
            lookup.trim(cached)
        else:
            lookup.reset()
        lookup.add_context(context_tokens)
    stats.prompt_tokens, stats.prompt_seconds = len(prompt), time.perf_counter() - start
    stats.cached_tokens = cached
    yield anchor.item(), False
    while True:
        if cancelled is not None and cancelled():
            return
        context = target.offset + 1
        start = time.perf_counter()
        drafts, draft_logits = NO_DRAFTS  # a plain decoding step unless the policy drafts
        copied: list[int] = []  # prompt lookup's drafts, after the drafter's if any
        copy = lookup.copy_length() if lookup is not None else 0
        copy = policy.copy_length(context, copy) if copy else 0
        if copy:
            copied = lookup.continuation(copy)
        elif length := policy.draft_length(context):
            drafts, draft_logits = drafter.propose(length, sampling.sample)
            if policy.needs_scores:
                drafts, draft_logits = _verified_prefix(
                    policy, context, drafter, drafts, draft_logits
                )
        mx.eval(drafts, draft_logits)  # [d], [d, Vh]
        d = drafts.shape[0]
        if d and lookup is not None:  # drafts that close a repeat: copy on after them
            drafted = drafts.tolist()
            more = lookup.copy_length(drafted)
            more = policy.extension_length(context, d, more) if more else 0
            copied = lookup.continuation(more, drafted) if more else []
        tokens = mx.concatenate([drafts.astype(mx.int32), mx.array(copied, mx.int32)])  # [k]
        k = tokens.shape[0]
        drafted_at = time.perf_counter()
        logits, taps = target.forward(mx.concatenate([anchor[None].astype(mx.int32), tokens]))
        if k == 0:  # logits [k+1, V]
            m, bonus = mx.array(0), sampling.sample(logits[0])
        elif sampling.greedy:
            choice = mx.argmax(logits, axis=-1)
            m = mx.argmax(mx.concatenate([tokens != choice[:k], mx.array([True])]))
            bonus = choice[m]
        else:
            vocab = logits.shape[-1]
            q = mx.zeros((d, vocab))  # [k, V]: the drafter's distributions, copies one-hot
            if d:
                q[:, drafter.head_target_ids] = sampling.probabilities(draft_logits)
            copies = mx.arange(vocab)[None, :] == mx.array(copied, mx.int32)[:, None]
            q = mx.concatenate([q, copies.astype(q.dtype)])
            m, bonus = accept_drafts(tokens, q, sampling.probabilities(logits))
        mx.eval(m, bonus, taps)
        m = m.item()
        target.rollback(k - m)
        accepted = mx.concatenate([tokens[:m], bonus[None].astype(mx.int32)])
        drafter.add_context(accepted, taps[: m + 1])
        if lookup is not None:
            lookup.add_context(accepted)
        if copy:
            policy.observe_copy(k, m)
        else:
            policy.observe(d, min(m, d))
            if copied and m >= d:  # the extension was tried
                policy.observe_extension(len(copied), m - d)
        stats.drafted.append(k)
        stats.accepted.append(m)
        stats.copied.append(bool(copy))
        stats.extended.append(0 if copy else len(copied))
        stats.draft_seconds += drafted_at - start
        stats.verify_seconds += time.perf_counter() - drafted_at
        for token in tokens[:m].tolist():
            yield token, True
        anchor = bonus
        yield bonus.item(), False


def _verified_prefix(
    policy, context: int, drafter: RuntimeDrafter, drafts: mx.array, logits: mx.array
):
    """Let the policy cut the drafts short from the drafter's own scores: the probability of
    each drafted token under its logits and, for block drafters, the confidence head."""
    chosen = drafter.head_target_ids[None, :] == drafts[:, None]  # [k, Vh]
    probs = (mx.softmax(logits.astype(mx.float32), axis=-1) * chosen).sum(axis=-1)
    confidence = getattr(drafter, "last_confidence", None)
    mx.eval(probs, *(() if confidence is None else (confidence,)))
    keep = policy.verify_length(
        context, np.array(probs), None if confidence is None else np.array(confidence)
    )
    return drafts[:keep], logits[:keep]


def _prefill(
    target: MlxTarget, prompt: mx.array, cancelled: Callable[[], bool] | None = None
) -> tuple[mx.array, mx.array] | None:
    """Run the prompt through the target in chunks: (last logits [V], taps [P, A*Ht]), or None
    when `cancelled` says so before a chunk."""
    taps = []
    for start in range(0, prompt.shape[0], PREFILL_CHUNK):
        if cancelled is not None and cancelled():
            return None
        logits, chunk_taps = target.forward(prompt[start : start + PREFILL_CHUNK])
        mx.eval(logits, chunk_taps)
        taps.append(chunk_taps)
    return logits[-1], mx.concatenate(taps, axis=0)


def generate_tokens(
    prompt: Sequence[int],
    target: MlxTarget,
    drafter: RuntimeDrafter,
    *,
    max_tokens: int,
    num_draft: int | None = None,
    policy=None,
    sampling: Sampling = GREEDY,
    eos_ids: Sequence[int] = (),
    stats: Stats | None = None,
    lookup: PromptLookup | None = None,
) -> list[int]:
    """Tokens as plain decoding would emit them: stop before an EOS token or at max_tokens."""
    out: list[int] = []
    steps = speculative_generate_step(
        prompt,
        target,
        drafter,
        num_draft=num_draft,
        policy=policy,
        sampling=sampling,
        stats=stats,
        lookup=lookup,
    )
    for token, _ in steps:
        if token in eos_ids or len(out) == max_tokens:
            break
        out.append(token)
    return out
