"""The engine: generations on one session, one at a time, with a prefix cache.

The target's KV cache and the drafter's context rows are kept after a request, with the tokens
they hold, and a detached copy of them goes into a bounded pool of recent conversations
(`prefix`). The next prompt takes over the live state or the pool entry that shares its longest
token prefix, keeps the rows of that prefix (less one token: an EAGLE-3 context row reads the
token after its position, and at least one prompt token must run for the first logits) and
prefills only the rest, as mlx_lm.server does for the target. Greedy output is the same with
and without it.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

from woodcock.runtime.decode import Stats
from woodcock.runtime.generate import generate, timed_text
from woodcock.runtime.policy import parse_policy
from woodcock.runtime.sampling import Sampling, make_logits_processors
from woodcock.serve.prefix import PrefixPool, kv_caches_only, restore, shared_prefix, snapshot
from woodcock.serve.request import DEFAULT_MAX_TOKENS, GenerationRequest, ModelFacts

DEFAULT_PREFIX_CACHE_GB = 1.0


class _PrefillCancelled(Exception):
    pass


def kept_prefix(common: int, prompt_length: int) -> int:
    """Rows of a cached prefix of `common` tokens a prompt keeps: all but the last (the
    drafter's row for it reads the token after it), never the whole prompt."""
    return max(0, min(common - 1, prompt_length - 1))


class Engine:
    """Runs generations on a session, one at a time, in the thread that opened the session, and
    remembers which tokens its caches hold for the next prompt."""

    def __init__(
        self,
        session,
        policy: str | None,
        *,
        prefix_cache: bool = True,
        prefix_cache_gb: float = DEFAULT_PREFIX_CACHE_GB,
    ):
        """policy: as `woodcock generate --policy` takes it, with a latency file where the
        policy needs one; None decodes plainly with mlx-lm (the session's drafter is unused).
        prefix_cache_gb: the pool's limit (KV rows of the target and the drafter); the live
        state is reused whatever the limit, and caches that cannot be detached are not pooled."""
        self.session, self.policy, self.prefix_cache = session, policy, prefix_cache
        self.cached_tokens: list[int] = []  # the tokens whose rows both caches hold, in order
        self.pool = None
        if prefix_cache and kv_caches_only(session.target.cache):
            self.pool = PrefixPool(int(prefix_cache_gb * 2**30))
        # the objects besides the target whose state follows the tokens: a pool entry holds it
        self._parts = [p for p in (session.drafter, session.lookup) if p is not None]
        # one policy object for the server's life, as `woodcock bench` keeps one across its
        # prompts: an adaptive policy's acceptance estimates go on learning from every request
        # (a fresh one would start from the prior at every request)
        self.draft_policy = None
        if policy is not None:
            self.draft_policy = self._new_policy()

    def _new_policy(self):
        session = self.session
        return parse_policy(
            self.policy, session.drafter, prior=session.holdout_agreement, head=session.head_label
        )

    def policy_for(self, request: GenerationRequest):
        """The server's policy, or a fresh one for a sampled request with a seed: its answer
        depends on the draft lengths (each draft draws from the request's key), so they must
        depend on the request alone, not on what the policy learned from the requests before."""
        if request.seed is None or request.temperature == 0 or self.draft_policy is None:
            return self.draft_policy
        return self._new_policy()

    def facts(self, model_id: str, default_max_tokens: int = DEFAULT_MAX_TOKENS) -> ModelFacts:
        return ModelFacts(
            model_id,
            self.session.tokenizer,
            self.session.target.vocab_size,
            self.session.target.context_length,
            default_max_tokens,
        )

    def _source(self, prompt_ids: list[int]):
        """(None for the live state or the pool entry to take over, the prefix it shares with
        the prompt): the longest, the live state where no entry beats it (it costs no copy)."""
        live = shared_prefix(self.cached_tokens, prompt_ids)
        if self.pool is not None:
            entry, common = self.pool.longest(prompt_ids)
            if common > live:
                return entry, common
        return None, live

    def reusable(self, prompt_ids: list[int]) -> int:
        """Prompt tokens whose cached rows the next generation keeps: the longest prefix shared
        with the cached tokens (live or pooled), less one (the drafter's row for the last of
        them reads the token after it), and never the whole prompt (its last token must run for
        the first logits)."""
        if not self.prefix_cache:
            return 0
        return kept_prefix(self._source(prompt_ids)[1], len(prompt_ids))

    def _take_prefix(self, prompt_ids: list[int]) -> int:
        """Make the live state the one sharing the longest prefix; `reusable` tokens."""
        if not self.prefix_cache:
            return 0
        entry, common = self._source(prompt_ids)
        if entry is not None:
            restore(entry, self.session.target, self._parts)
            self.cached_tokens = list(entry.tokens)
        if self.pool is not None:
            self.pool.touch(self.cached_tokens)
        return kept_prefix(common, len(prompt_ids))

    def _keep(self) -> None:
        """Put a detached copy of the live state into the pool."""
        if self.pool is not None and len(self.cached_tokens) > 1:
            target = self.session.target
            self.pool.put(snapshot(self.cached_tokens, target.cache, self._parts))

    def run(
        self,
        request: GenerationRequest,
        *,
        on_start: Callable[[int], None] | None = None,
        on_text: Callable[[str], None] | None = None,
        cancelled: Callable[[], bool] | None = None,
    ):
        """on_start: given the prompt tokens whose cached rows are reused, before the prefill."""
        ids, cached = request.prompt_ids, self._take_prefix(request.prompt_ids)
        if on_start is not None:
            on_start(cached)
        self.cached_tokens = []  # until this generation says what the caches hold
        processors = make_logits_processors(
            request.logit_bias,
            repetition_penalty=request.repetition_penalty,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
        )
        if self.policy is None:
            if request.seed is not None:
                mx.random.seed(request.seed)
            result = self._run_plain(request, cached, on_text, cancelled, processors)
        else:
            sampling = Sampling(request.temperature, request.top_p, request.top_k, request.min_p)
            result = generate(
                self.session,
                ids,
                max_tokens=request.max_tokens,
                policy=self.policy_for(request),
                sampling=sampling,
                stop=request.stop,
                on_text=on_text,
                cached=cached,
                cancelled=cancelled,
                logits_processors=processors,
                logprobs=request.logprobs,
                key=None if request.seed is None else mx.random.key(request.seed),
                continues=ids if request.endpoint == "completions" else (),
            )
        # the caches hold the first `offset` tokens of the prompt and the stream; the stream
        # may have run past what was kept (a round's drafts after a stop), hence the minimum
        self.cached_tokens = (ids + result.tokens)[: self.session.target.offset]
        self._keep()
        return result

    def _run_plain(self, request, cached, on_text, cancelled, processors):
        """mlx-lm's own decoding loop on the target's cache: the baseline the drafter is
        measured against, with the same prompt cache, stop rules, cancellation and logits
        processors (which see the whole prompt, the cached part too)."""
        target, ids = self.session.target, request.prompt_ids
        if not (cached and target.truncate(cached)):
            cached = 0
            target.reset()

        if cached and processors:
            prefix = mx.array(ids[:cached])

            def with_cached(processor):
                return lambda tokens, logits: processor(mx.concatenate([prefix, tokens]), logits)

            processors = [with_cached(p) for p in processors]

        def check(processed: int, total: int) -> None:
            if cancelled is not None and cancelled():
                raise _PrefillCancelled

        steps = generate_step(
            mx.array(ids[cached:]),
            self.session.model,
            max_tokens=request.max_tokens,
            sampler=make_sampler(
                request.temperature, request.top_p, request.min_p, top_k=request.top_k
            ),
            logits_processors=processors,
            prompt_cache=target.cache,
            prompt_progress_callback=check,
        )

        def tokens():
            try:
                for token, logprobs in steps:
                    yield token if request.logprobs is None else (token, logprobs)
                    if cancelled is not None and cancelled():
                        return
            except _PrefillCancelled:
                target.reset()

        result = timed_text(
            tokens(),
            self.session.tokenizer,
            prompt_tokens=len(ids),
            max_tokens=request.max_tokens,
            stop=request.stop,
            on_text=on_text,
            logprobs=request.logprobs,
            continues=ids if request.endpoint == "completions" else (),
        )
        result.stats = Stats(prompt_tokens=len(ids), cached_tokens=cached)
        return result
