"""Continuous batching with speculation: up to `max_batch` requests decode together.

A request joins between rounds: its prompt is prefilled alone on the target's own cache (from
the prefix pool's longest shared prefix, as one request at a time does), its first token
streams at once, and its rows move into a woodcock.runtime.batch SequenceBatch. Each round
every running request proposes on its own (its own drafter and prompt-lookup state, its draft
length from the server's policy), the target verifies all proposals in one batched forward, and
each request accepts its own prefix and rolls back its own rows. A request that finishes, is
cancelled or times out leaves before the next round, and its state goes into the prefix pool.

Greedy output is each request's own: a row of the batch attends to its own keys only, so it
differs from the request served alone only by the rounding of matmuls over more rows (the
margin `woodcock bench` calls a tie). Sampling stays exact per request, each drawing from its
own PRNG key when it has a seed (the same draws as alone: a batch holding such a request
drafts every round as the policy says, as the request does alone).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import mlx.core as mx

from woodcock.runtime.batch import SequenceBatch
from woodcock.runtime.decode import SpeculativeSequence, batched_round
from woodcock.runtime.generate import Generation, TextStream
from woodcock.runtime.policy import FixedPolicy
from woodcock.runtime.sampling import Sampling, make_logits_processors
from woodcock.serve.engine import Engine, kept_prefix
from woodcock.serve.prefix import detached, restore, snapshot

# A batched forward pads every request's rows to the longest proposal, so one long prompt-lookup
# copy makes every row pay for it: with several requests, proposals are cut at this many tokens
# (copies first). Default pair, 4 requests, fixed:3, 2 vCPU: 4 requests' rounds were as many
# with a cut at 3, 5 or none, and the cut rounds a few per cent faster.
LONGEST_BATCHED_PROPOSAL = 5


class DraftingChoice:
    """Whether a round of several requests drafts, from what rounds of as many requests took:
    tokens a second with drafting (as the policy says, proposals cut at
    LONGEST_BATCHED_PROPOSAL) and without (plain batched steps), each a moving average. The
    slower way is tried again every `explore`-th round, so that a change (longer contexts, a
    drafter that pays more) is seen. Where verifying extra rows is nearly free (a GPU) drafting
    wins; on a few CPU cores a batch's rows cost what one request's many rows cost, and plain
    steps may win (default pair, 4 requests, 2 vCPU: 44.6 tokens/s plain, 36-38 drafting). A
    request alone drafts as the policy says, and so does a batch holding a sampled request with
    a seed, uncut (speculative and plain steps, and drafts of other lengths, draw different
    random numbers)."""

    def __init__(self, explore: int = 10, weight: float = 0.2):
        self.explore, self.weight = explore, weight
        self.rates: dict[tuple[int, bool], float] = {}  # (requests, drafted) -> tokens/s
        self.rounds = 0

    def drafts(self, requests: int) -> bool:
        if requests == 1:
            return True
        drafting, plain = self.rates.get((requests, True)), self.rates.get((requests, False))
        if drafting is None or plain is None:
            return drafting is None  # each way once first
        self.rounds += 1
        faster = drafting >= plain
        return faster != (self.rounds % self.explore == 0)

    def observe(self, requests: int, drafted: bool, tokens: int, seconds: float) -> None:
        key, rate = (requests, drafted), tokens / seconds
        old = self.rates.get(key)
        self.rates[key] = rate if old is None else (1 - self.weight) * old + self.weight * rate


def own_state(part):
    """A copy of a stateful part (drafter, prompt lookup) whose state is its own and whose
    weights are shared."""
    twin = copy.copy(part)
    vars(twin).update(detached(vars(part)))
    return twin


@dataclass
class Running:
    """A request in the batch: its job (woodcock.serve.worker.Job), sequence and text."""

    job: object
    sequence: SpeculativeSequence
    text: TextStream
    parts: list  # its own drafter (and prompt lookup), for the prefix pool
    started: float  # perf_counter at admission
    first_token_at: float = 0.0


class Batcher:
    """The batch of one engine's session: `admit` a request, run `rounds` while any runs."""

    def __init__(self, engine: Engine, max_batch: int):
        self.engine, self.session = engine, engine.session
        self.batch = SequenceBatch(self.session.target, max_batch)
        self.running: list[Running] = []
        self.lookup = self.session.lookup if engine.policy is not None else None
        self.drafting = DraftingChoice()

    @property
    def full(self) -> bool:
        return len(self.running) == self.batch.max_rows

    def admit(self, job) -> Generation | None:
        """Prefill a request alone and stream its first token; it joins the batch, or its
        result is returned when it is complete already (or cancelled during the prefill)."""
        request, session, engine = job.request, self.session, self.engine
        target = session.target
        engine.cached_tokens = []  # the target's own cache now serves prefills only
        started = time.perf_counter()
        parts = [own_state(session.drafter)] + ([own_state(self.lookup)] if self.lookup else [])
        ids, cached = request.prompt_ids, 0
        if engine.pool is not None:
            entry, common = engine.pool.longest(ids)
            if entry is not None and kept_prefix(common, len(ids)):
                restore(entry, target, parts)
                engine.pool.touch(entry.tokens)
                cached = kept_prefix(common, len(ids))
        if request.stream:
            job.emit("start", cached)
        sampling = Sampling(request.temperature, request.top_p, request.top_k, request.min_p)
        sequence = SpeculativeSequence(
            ids,
            target,
            parts[0],
            # plain decoding (no drafter) batches too: a sequence that never drafts
            policy=engine.policy_for(request) or FixedPolicy(0),
            sampling=sampling,
            lookup=parts[1] if len(parts) > 1 else None,
            logits_processors=make_logits_processors(
                request.logit_bias,
                repetition_penalty=request.repetition_penalty,
                presence_penalty=request.presence_penalty,
                frequency_penalty=request.frequency_penalty,
            ),
            logprobs=request.logprobs is not None,
            key=None if request.seed is None else mx.random.key(request.seed),
            max_tokens=request.max_tokens,
        )
        on_text = (lambda text: job.emit("text", text)) if request.stream else None
        text = TextStream(
            session.tokenizer,
            max_tokens=request.max_tokens,
            stop=request.stop,
            on_text=on_text,
            logprobs=request.logprobs,
            continues=ids if request.endpoint == "completions" else (),
        )
        running = Running(job, sequence, text, parts, started)
        first = sequence.start(cached, job.cancelled.is_set)
        if first is None:
            return self._result(running)
        running.first_token_at = time.perf_counter()
        if self._add(running, first) or job.cancelled.is_set():
            result = self._result(running)
            self._keep(running, result, target.cache, target.offset)
            return result
        sequence.rows = self.batch.add(target.cache)
        self.running.append(running)
        return None

    def round(self) -> list[tuple[object, Generation]]:
        """One speculative round of every running request (one batched forward); the jobs that
        finished (or were cancelled) with their results, out of the batch."""
        sequences = [r.sequence for r in self.running]
        size = len(sequences)
        # a request with a seed draws alone what it draws in a batch only if both draft alike
        seeded = any(sequence.seeded for sequence in sequences)
        drafts = seeded or self.drafting.drafts(size)
        longest = None if size == 1 or seeded else LONGEST_BATCHED_PROPOSAL if drafts else 0
        start = time.perf_counter()
        rounds = batched_round(self.batch, sequences, longest)
        seconds = time.perf_counter() - start
        self.drafting.observe(size, drafts, sum(len(steps) for steps in rounds), seconds)
        for r, steps in zip(self.running, rounds, strict=True):
            self._add(r, steps)
        done = [r for r in self.running if r.text.done or r.job.cancelled.is_set()]
        return [(r.job, self._leave(r)) for r in done]

    def drop_all(self) -> list:
        """After a failed round: every running request's job, the batch emptied (its state is
        not trusted, so nothing goes into the prefix pool)."""
        jobs = [r.job for r in self.running]
        self.running = []
        self.batch = SequenceBatch(self.session.target, self.batch.max_rows)
        return jobs

    def _add(self, running: Running, steps: list[tuple]) -> bool:
        """Give the text stream a round's tokens; True once it is complete."""
        for step in steps:
            logprobs = step[2] if len(step) > 2 else None
            if running.text.add(step[0], logprobs):
                return True
        return False

    def _leave(self, running: Running) -> Generation:
        self.running.remove(running)
        slot = running.sequence.rows
        offset = slot.offset
        caches = self.batch.remove(slot)
        result = self._result(running)
        self._keep(running, result, caches, offset)
        return result

    def _keep(self, running: Running, result: Generation, caches: list, offset: int) -> None:
        """Put a finished request's state (its target rows `caches`, holding `offset` tokens of
        its prompt and stream, and its parts) into the prefix pool."""
        tokens = (running.sequence.prompt + result.tokens)[:offset]
        if self.engine.pool is not None and len(tokens) > 1:
            self.engine.pool.put(snapshot(tokens, caches, running.parts))

    def _result(self, running: Running) -> Generation:
        result = running.text.close()
        end = time.perf_counter()
        result.prompt_tokens = len(running.sequence.prompt)
        result.stats = running.sequence.stats
        if running.first_token_at:
            result.prompt_seconds = running.first_token_at - running.started
            result.generation_seconds = end - running.first_token_at
        return result
