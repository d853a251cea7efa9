"""The speculative decoding loop: draft K tokens, verify them in one target forward, keep the
longest acceptable prefix plus one target token, roll both caches back.

Invariant between rounds: the target's KV cache holds every emitted token except the last one
(the anchor); the anchor and the drafts are verified together, so the verified rows' hidden
states are exactly the drafter's next context. The same holds for each sequence of a batch
(`batched_round`), each with its own rows, drafter state and PRNG key.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import mlx.core as mx
import numpy as np

from woodcock.runtime import block, eagle3
from woodcock.runtime.batch import SequenceBatch
from woodcock.runtime.ngram import PromptLookup
from woodcock.runtime.prefill import PrefillSizes, prefill_sizes
from woodcock.runtime.sampling import (
    LogitsProcessor,
    Sampling,
    accept_drafts,
    greedy_tokens,
    log_softmax,
    near_ties,
    process_logits,
)
from woodcock.runtime.target import MlxTarget

DRAFTING_TOGETHER = (eagle3, block)  # modules whose drafters of a batch can draft together
MAX_PROPOSAL = 1 << 30  # no limit on a round's proposal but the policy's
GREEDY = Sampling()
NO_DRAFTS = (mx.zeros((0,), mx.int32), mx.zeros((0, 0)))  # tokens [0], logits [0, Vh]
# A lazy array belongs to the stream of the thread that made it: evaluated now, the constant
# can be used by a loop running in any thread (a server generates in a worker thread).
mx.eval(NO_DRAFTS)


class RuntimeDrafter(Protocol):
    """What the loop asks of a drafter (woodcock.runtime.eagle3, block, ngram)."""

    head_target_ids: mx.array  # [Vh] target id of each draft-head row
    num_drafts: int | None  # a block drafter's drafts per pass; None for chain drafters
    last_confidence: mx.array | None  # [d] the last proposal's confidence, where it has a head
    confidence_reads_drafts: bool  # that confidence is computed from the drafts before it

    def reset(self) -> None: ...

    def add_context(self, tokens: mx.array, taps: mx.array) -> None: ...

    def propose(self, k: int, sampler) -> tuple[mx.array, mx.array]: ...  # [k], [k, Vh]

    def trim(self, rows: int) -> None: ...  # keep the first `rows` context rows


class DraftPolicy(Protocol):
    """What the loop asks of a policy (woodcock.runtime.policy): how far to draft, copy and
    verify each round, and what came of it. A policy changes speed only, never the output."""

    needs_scores: bool  # verify_length wants the drafts' probabilities (and confidence)

    def draft_length(self, context: int) -> int: ...

    def verify_length(
        self, context: int, draft_probs: np.ndarray, confidence: np.ndarray | None
    ) -> int: ...

    def cut_reads_drafts(self, drafter: RuntimeDrafter) -> bool: ...  # then greedy only

    def copy_length(self, context: int, proposed: int) -> int: ...

    def extension_length(self, context: int, drafted: int, proposed: int) -> int: ...

    def observe(self, verified: int, accepted: int) -> None: ...

    def observe_copy(self, verified: int, accepted: int) -> None: ...

    def observe_extension(self, verified: int, accepted: int) -> None: ...


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
    # each round: drafts the drafter made, a policy's cut included (drafted less extended but
    # for the cut; 0 in rounds that copied)
    drafts_made: list[int] = field(default_factory=list)
    # proposing: building the drafts and, where the host reads them (the policy's scores, a
    # copy after them), computing them; verifying: the rest of a round until its verdict is
    # read, the drafts' computation included where nothing read them before
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0

    def record(
        self, proposal: Proposal, accepted: int, draft_seconds: float, verify_seconds: float
    ) -> None:
        self.drafted.append(proposal.tokens.shape[0])
        self.accepted.append(accepted)
        self.copied.append(proposal.copy_round)
        self.extended.append(0 if proposal.copy_round else len(proposal.copied))
        self.drafts_made.append(proposal.drafts_made)
        self.draft_seconds += draft_seconds
        self.verify_seconds += verify_seconds

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
        (0-based) was accepted, among those that drafted that far: not given the drafts before
        it were (that is the policies' and the hold-out's acceptance, `AcceptanceEstimate`);
        the drafter's drafts only, not the copies that extended them."""
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
    policy: DraftPolicy,
    sampling: Sampling = GREEDY,
    stats: Stats | None = None,
    lookup: PromptLookup | None = None,
    cached: int = 0,
    cancelled: Callable[[], bool] | None = None,
    logits_processors: Sequence[LogitsProcessor] = (),
    logprobs: bool = False,
    key: mx.array | None = None,
    max_tokens: int | None = None,
) -> Iterator[tuple[int, bool]] | Iterator[tuple[int, bool, mx.array]]:
    """Yields (token, from_draft) forever; the caller stops at EOS or a length limit. The policy
    (woodcock.runtime.policy) says how far to draft; lookup: rounds whose recent tokens repeat
    copy from the context instead, as far as the policy's `copy_length` says, and drafts that
    close a repeat are followed by a copy as far as its `extension_length` says.

    cached: the first `cached` prompt tokens are those an earlier call over the same target and
    drafter began its stream with, and their rows are still in both caches (the target's keys
    and values, the drafter's context rows, which read the token after each position): they
    are kept and only the rest of the prompt is prefilled (0: start from empty caches; a
    rotating cache that cannot drop the rest falls back to 0). cancelled: asked between prefill
    chunks and before every round; when it returns True the stream ends (cut short in the
    prefill, it leaves both caches empty).

    logits_processors: mlx-lm's `processor(tokens, logits)`, applied to the target's logits at
    every position with the tokens before it (the prompt and what was emitted, then the drafts
    before the row in a verification), so drafts are judged against the distribution plain
    decoding with them samples. logprobs: yield (token, from_draft, the target's log-probabilities
    at the token's position [V], as `mlx_lm.generate.generate_step` yields them). key: the PRNG
    key of this generation's draws (None: MLX's global random state). max_tokens: the tokens the
    caller will take at most; no round proposes more than the stream may still emit."""
    sequence = SpeculativeSequence(
        prompt,
        target,
        drafter,
        policy=policy,
        sampling=sampling,
        stats=stats,
        lookup=lookup,
        logits_processors=logits_processors,
        logprobs=logprobs,
        key=key,
        max_tokens=max_tokens,
    )
    first = sequence.start(cached, cancelled)
    if first is None:
        return
    yield from first
    while not (cancelled is not None and cancelled()):
        tokens = sequence.propose()  # [k+1]: the anchor, then the proposal
        start = time.perf_counter()
        sequence.judge(*target.forward(tokens))  # logits [k+1, V], taps [k+1, A*Ht]
        mx.eval(sequence.verdict)
        yield from sequence.commit(time.perf_counter() - start)


def batched_round(
    batch: SequenceBatch, sequences: list[SpeculativeSequence], longest: int | None = None
) -> list[list]:
    """One round of every sequence of a batch (each holding its rows in `batch`, in any order):
    each proposes (at most `longest` tokens), the target verifies all proposals in one forward,
    each keeps its own accepted prefix. Each sequence's steps, as `speculative_generate_step`
    yields them."""
    in_rows = sorted(sequences, key=lambda sequence: sequence.rows.row)
    tokens = propose_all(in_rows, longest)  # each [k_i + 1]
    start = time.perf_counter()
    for sequence, verified in zip(in_rows, batch.forward(tokens), strict=True):
        sequence.judge(*verified)
    mx.eval([array for sequence in in_rows for array in sequence.verdict])
    seconds = time.perf_counter() - start  # the round's forward, shared by all
    return [sequence.commit(seconds) for sequence in sequences]


def propose_all(sequences: Sequence[SpeculativeSequence], longest: int | None = None) -> list:
    """Each sequence's `propose(longest)`, the drafters of those that draft running together
    where their module can (`propose_together`: EAGLE-3, one forward a chain step; block
    drafters, one forward for all blocks; `benchmarks/batch_bench.py`, the default pair, 4
    requests at fixed:3, 2 vCPU: 16 ms of drafting a round, against 36 ms one after another).
    A sequence sampling with its own PRNG key drafts alone, so that its draws are those it
    draws alone. What the host reads of the drafts drafted together (`host_reads`) is
    evaluated in one wait for all of them."""
    start = time.perf_counter()
    lengths = [sequence.plan(longest) for sequence in sequences]
    together = [i for i, s in enumerate(sequences) if lengths[i] and not s.seeded]
    drafters = [sequences[i].drafter for i in together]
    drafted = {}
    for module in DRAFTING_TOGETHER if len(together) > 1 else ():
        if module.can_propose_together(drafters):
            proposals = module.propose_together(
                drafters, [lengths[i] for i in together], [sequences[i]._sample for i in together]
            )
            drafted = dict(zip(together, proposals, strict=True))
            break
    reads = {i: sequences[i].host_reads(*drafted[i]) for i in drafted}
    if any(reads.values()):
        mx.eval(list(reads.values()))
    tokens = []
    for i, (sequence, length) in enumerate(zip(sequences, lengths, strict=True)):
        if i in drafted:
            tokens.append(sequence.finish(*drafted[i], start, reads[i]))
            continue
        alone = time.perf_counter()
        drafts = sequence.drafter.propose(length, sequence._sample) if length else NO_DRAFTS
        tokens.append(sequence.finish(*drafts, alone))
    return tokens


class SpeculativeSequence:
    """One generation between rounds: it proposes the tokens to verify, judges the target's
    logits for them and keeps what it accepts. `speculative_generate_step` runs one alone on the
    target's own cache; woodcock.serve.batching verifies several in one forward, each sequence
    holding its rows in a woodcock.runtime.batch Slot (`rows`), its own drafter and lookup.
    Arguments as for `speculative_generate_step`."""

    def __init__(
        self,
        prompt: Sequence[int],
        target: MlxTarget,
        drafter: RuntimeDrafter,
        *,
        policy: DraftPolicy,
        sampling: Sampling = GREEDY,
        stats: Stats | None = None,
        lookup: PromptLookup | None = None,
        logits_processors: Sequence[LogitsProcessor] = (),
        logprobs: bool = False,
        key: mx.array | None = None,
        max_tokens: int | None = None,
    ):
        self.prompt, self.target, self.drafter, self.lookup = list(prompt), target, drafter, lookup
        # tokens the stream may still emit (None: no limit): a round proposes at most one
        # fewer, as mlx-lm's speculative loop caps its drafts, so none is verified in vain
        self._room = max_tokens
        self.policy, self.sampling, self.logprobs = policy, sampling, logprobs
        # whether the policy cuts the drafts by their scores (woodcock.runtime.policy: not
        # when sampling, where the scores depend on the drafts drawn)
        self._cuts = policy.needs_scores and (
            sampling.greedy or not policy.cut_reads_drafts(drafter)
        )
        self.stats = stats if stats is not None else Stats()
        self.rows = target  # what holds the target's rows of this sequence (offset, rollback)
        self._processors = list(logits_processors)
        # the tokens before the next position, for the processors
        self._history = list(prompt) if logits_processors else None
        self._key = None if sampling.greedy else key
        self._anchor: mx.array | None = None  # the last emitted token, not yet in the caches
        self._proposal: Proposal | None = None
        self._plan: tuple[int, int, int] = (0, 0, 0)  # plan's (context, most, copy) for finish
        self._draft_seconds = 0.0
        self.verdict: list[mx.array] = []  # judge's lazy (accepted, bonus, taps)
        self._logits: mx.array | None = None

    @property
    def seeded(self) -> bool:
        """Whether it samples with its own PRNG key (its draws then depend on how it drafts)."""
        return self._key is not None

    def _emit(self, tokens: int) -> None:
        if self._room is not None:
            self._room -= tokens

    def _next_key(self) -> mx.array | None:
        if self._key is None:
            return None
        self._key, key = mx.random.split(self._key)
        return key

    def _sample(self, logits: mx.array) -> mx.array:
        return self.sampling.sample(logits, key=self._next_key())

    def _process(self, proposed: list[int], logits: mx.array) -> mx.array:
        if not self._processors:
            return logits
        return process_logits(self._processors, self._history, proposed, logits)

    def _steps(self, tokens: list[int], accepted: int, logits: mx.array) -> list[tuple]:
        """What the stream yields for the emitted tokens (logits [len(tokens), V], row i the
        one token i was judged by)."""
        if self._history is not None:
            self._history.extend(tokens)
        if not self.logprobs:
            return [(token, i < accepted) for i, token in enumerate(tokens)]
        rows = log_softmax(logits)
        return [(token, i < accepted, rows[i]) for i, token in enumerate(tokens)]

    def start(
        self, cached: int = 0, cancelled: Callable[[], bool] | None = None
    ) -> list[tuple] | None:
        """Prefill what the caches do not hold yet on the target's own cache: the stream's first
        step, or None when cancelled during the prefill."""
        prompt, target, drafter, lookup = self.prompt, self.target, self.drafter, self.lookup
        if not 0 <= cached < len(prompt) or cached > target.offset:
            raise ValueError(
                f"cached = {cached}: expected fewer than the prompt's {len(prompt)} tokens and at"
                f" most the {target.offset} in the target's cache"
            )
        cached = cached if cached and target.truncate(cached) else 0
        for part in [drafter] if lookup is None else [drafter, lookup]:
            if cached:
                part.trim(cached)
            else:
                part.reset()
        if not cached:
            target.reset()
        start = time.perf_counter()
        prefilled = _prefill(target, mx.array(prompt[cached:]), cancelled)  # [V], [P - c, A*Ht]
        if prefilled is None:
            target.reset()
            drafter.reset()
            return None
        logits, taps = prefilled
        logits = self._process([], logits[None])  # [1, V]
        anchor = greedy_tokens(logits[0]) if self.sampling.greedy else self._sample(logits[0])
        context_tokens = mx.concatenate([mx.array(prompt[cached + 1 :], mx.int32), anchor[None]])
        drafter.add_context(context_tokens, taps)
        mx.eval(anchor)
        if lookup is not None:
            lookup.add_context(context_tokens)
        self.stats.prompt_tokens, self.stats.prompt_seconds = (
            len(prompt),
            time.perf_counter() - start,
        )
        self.stats.cached_tokens = cached
        self._anchor = anchor
        self._emit(1)
        return self._steps([anchor.item()], 0, logits)

    def propose(self, longest: int | None = None) -> mx.array:
        """This round's tokens to verify [k+1]: the anchor, then the drafts and copies (at most
        `longest` of them; 0: a plain decoding step, nothing drafted)."""
        start = time.perf_counter()
        length = self.plan(longest)
        drafts = self.drafter.propose(length, self._sample) if length else NO_DRAFTS
        return self.finish(*drafts, start)

    def plan(self, longest: int | None = None) -> int:
        """`propose` in parts: how many drafts to ask the drafter for (0: none, a copy or a
        plain step), then `finish` with what it drafted. A copy when the recent tokens repeat
        and the policy takes it, else the policy's draft length; at most `longest` tokens."""
        context = self.rows.offset + 1
        most = MAX_PROPOSAL if longest is None else longest
        if self._room is not None:
            most = min(most, max(self._room - 1, 0))
        lookup, policy = self.lookup, self.policy
        copy = lookup.copy_length() if lookup is not None and most else 0
        copy = min(policy.copy_length(context, copy), most) if copy else 0
        self._plan = (context, most, copy)
        if copy:
            return 0
        return min(policy.draft_length(context), most) if most else 0

    def host_reads(self, drafts: mx.array, draft_logits: mx.array) -> tuple[mx.array, ...]:
        """What `finish` reads on the host of the drafter's drafts [d] and logits [d, Vh], lazy:
        () where nothing (the drafts are then computed with the verify that reads them, in the
        round's one evaluation); else the drafts and, where the policy cuts them by their
        scores, each one's probability under the drafter [d] and its confidence [d] if it has
        a head. `propose_all` evaluates those of a batch's sequences together."""
        d, (_, most, copy) = drafts.shape[0], self._plan
        if copy or not d:
            return ()
        scores: tuple[mx.array, ...] = ()
        if self._cuts:
            chosen = self.drafter.head_target_ids[None, :] == drafts[:, None]  # [d, Vh]
            probs = (mx.softmax(draft_logits.astype(mx.float32), axis=-1) * chosen).sum(axis=-1)
            confidence = self.drafter.last_confidence
            scores = (probs,) if confidence is None else (probs, confidence)
        extends = self.lookup is not None and most > d  # a copy may follow the drafts
        return (drafts, *scores) if scores or extends else ()

    def finish(
        self,
        drafts: mx.array,
        draft_logits: mx.array,
        started: float,
        reads: tuple[mx.array, ...] | None = None,
    ) -> mx.array:
        """The drafter's drafts [d] and logits [d, Vh] for `plan`'s length (none: NO_DRAFTS) ->
        `propose`'s tokens [k+1]; the policy may cut the drafts by their scores, and drafts
        that close a repeat are extended by a copy as far as it says. started: perf_counter when
        this round's drafting began. reads: `host_reads` of these drafts, evaluated (None: this
        evaluates them)."""
        context, most, copy = self._plan
        lookup, policy = self.lookup, self.policy
        if copy:
            proposal = Proposal(*NO_DRAFTS, lookup.continuation(copy), copy_round=True)
        else:
            if reads is None and (reads := self.host_reads(drafts, draft_logits)):
                mx.eval(reads)
            copied: list[int] = []
            made = drafts.shape[0]
            if reads:
                drafted = reads[0].tolist()
                if self._cuts:
                    confidence = np.array(reads[2]) if len(reads) > 2 else None
                    keep = policy.verify_length(context, np.array(reads[1]), confidence)
                    drafts, draft_logits = drafts[:keep], draft_logits[:keep]
                    drafted = drafted[:keep]
                if (d := len(drafted)) and lookup is not None and most > d:
                    more = min(lookup.copy_length(drafted), most - d)
                    more = policy.extension_length(context, d, more) if more else 0
                    copied = lookup.continuation(more, drafted) if more else []
            proposal = Proposal(drafts, draft_logits, copied, copy_round=False, drafts_made=made)
        self._proposal = proposal
        self._draft_seconds = time.perf_counter() - started
        return mx.concatenate([self._anchor[None].astype(mx.int32), proposal.tokens])

    def judge(self, logits: mx.array, taps: mx.array) -> None:
        """The target's logits [k+1, V] and taps [k+1, A*Ht] for `propose`'s tokens -> `verdict`:
        lazy (accepted drafts m, the token after them, taps), to evaluate before `commit`."""
        proposal = self._proposal
        tokens = proposal.tokens
        k = tokens.shape[0]
        if self._processors:
            logits = self._process(tokens.tolist(), logits)
        unsure = []
        if self.sampling.greedy:
            # the argmax of the logits; `commit` takes mlx-lm's choice instead where rounding
            # may tie it with another token (near_ties): no exp over the vocabulary otherwise
            m, bonus = _greedy_verdict(tokens, mx.argmax(logits, axis=-1))
            unsure = [near_ties(logits)]  # [k+1]
        elif k == 0:
            m, bonus = mx.array(0), self._sample(logits[0])
        else:
            vocab, d = logits.shape[-1], proposal.drafts.shape[0]
            q = mx.zeros((d, vocab))  # [d, V]: the drafter's distributions; copies are one-hot
            if d:
                q[:, self.drafter.head_target_ids] = self.sampling.probabilities(
                    proposal.draft_logits
                )
            copies = mx.arange(vocab)[None, :] == mx.array(proposal.copied, mx.int32)[:, None]
            q = mx.concatenate([q, copies.astype(q.dtype)])  # [k, V]
            m, bonus = accept_drafts(
                tokens, q, self.sampling.probabilities(logits), key=self._next_key()
            )
        self._logits = logits
        self.verdict = [m, bonus, taps, *unsure]

    def commit(self, verify_seconds: float) -> list[tuple]:
        """Keep the judged round (its verdict evaluated): drop the rejected rows from the
        target's cache; the accepted tokens and the bonus join the drafter's (and prompt
        lookup's) context. The steps the stream yields for them."""
        m, bonus, taps, *unsure = self.verdict
        proposal, accepted = self._proposal, m.item()
        if unsure and any(unsure[0].tolist()[: accepted + 1]):
            m, bonus = _greedy_verdict(proposal.tokens, greedy_tokens(self._logits))
            accepted = m.item()
        # read from arrays the verdict's evaluation computed (but for a near tie, above)
        emitted = proposal.tokens.tolist()[:accepted] + [bonus.item()]
        self._emit(len(emitted))
        self.rows.rollback(proposal.tokens.shape[0] - accepted)
        kept = mx.concatenate([proposal.tokens[:accepted], bonus[None].astype(mx.int32)])
        self.drafter.add_context(kept, taps[: accepted + 1])
        if self.lookup is not None:
            self.lookup.add_context(emitted)
        proposal.observed_by(self.policy, accepted)
        self.stats.record(proposal, accepted, self._draft_seconds, verify_seconds)
        self._anchor, self.verdict = bonus, []
        return self._steps(emitted, accepted, self._logits)


@dataclass
class Proposal:
    """One round's drafts: the drafter's (with their logits), then prompt lookup's copies."""

    drafts: mx.array  # [d] target ids
    draft_logits: mx.array  # [d, Vh]
    copied: list[int]  # copies after the drafts (the whole proposal in a copy round)
    copy_round: bool  # prompt lookup proposed instead of the drafter
    drafts_made: int = 0  # what the drafter drafted, before the policy cut them to `drafts`
    tokens: mx.array = field(init=False)  # [k = d + copies]: what the target verifies

    def __post_init__(self) -> None:
        self.tokens = mx.concatenate(
            [self.drafts.astype(mx.int32), mx.array(self.copied, mx.int32)]
        )

    def observed_by(self, policy: DraftPolicy, accepted: int) -> None:
        if self.copy_round:
            policy.observe_copy(len(self.copied), accepted)
            return
        d = self.drafts.shape[0]
        policy.observe(d, min(accepted, d))
        if self.copied and accepted >= d:  # the extension was tried
            policy.observe_extension(len(self.copied), accepted - d)


def _prefill(
    target: MlxTarget,
    prompt: mx.array,
    cancelled: Callable[[], bool] | None = None,
    sizes: PrefillSizes | None = None,
) -> tuple[mx.array, mx.array] | None:
    """Run the prompt through the target in chunks (the backend's unless `sizes` says): (last
    logits [V], taps [P, A*Ht]), or None when `cancelled` says so before a chunk."""
    taps = []
    sizes = sizes or prefill_sizes()
    for start, end in sizes.spans(prompt.shape[0], cached=target.offset):
        if cancelled is not None and cancelled():
            return None
        logits, chunk_taps = target.prefill(prompt[start:end])
        mx.eval(logits, chunk_taps)
        taps.append(chunk_taps)
    return logits, mx.concatenate(taps, axis=0)


def _greedy_verdict(drafts: mx.array, choice: mx.array) -> tuple[mx.array, mx.array]:
    """drafts [k], the target's greedy choice at each verified row [k+1] -> (drafts accepted m:
    the leading run that equals the choice, the choice after them)."""
    m = mx.argmax(mx.concatenate([drafts != choice[: drafts.shape[0]], mx.array([True])]))
    return m, choice[m]
