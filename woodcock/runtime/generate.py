"""Text in, text out: prompt encoding like `mlx_lm.generate`, streaming detokenisation, and the
stop rules of plain decoding (EOS, max tokens, stop strings) applied to the speculative stream."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from woodcock.runtime.decode import Stats, speculative_generate_step
from woodcock.runtime.sampling import LogitsProcessor, Sampling


def encode_prompt(
    tokenizer, prompt: str, *, chat: bool = True, system: str | None = None
) -> list[int]:
    """As mlx_lm.generate does: the chat template when asked for and present, then encode."""
    if chat and tokenizer.has_chat_template:
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": prompt})
        return encode_messages(tokenizer, messages)
    return list(tokenizer.encode(prompt, add_special_tokens=True))


def encode_messages(tokenizer, messages: Sequence[dict]) -> list[int]:
    """A conversation ({"role", "content"} dicts, oldest first) through the chat template, with
    the prompt for the assistant's next turn; the template writes any special tokens itself."""
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


@dataclass
class TokenLogprob:
    """One emitted token's log-probability under the target and the most likely tokens at its
    position (text is each token decoded alone)."""

    token: int
    text: str
    logprob: float
    top: list[tuple[int, str, float]]  # (token, text, logprob), most likely first


class LoggedText(str):
    """Streamed text with the log-probabilities of the tokens consumed since the last piece."""

    logprobs: list[TokenLogprob]

    def __new__(cls, text: str, logprobs: list[TokenLogprob]):
        piece = super().__new__(cls, text)
        piece.logprobs = logprobs
        return piece


def token_logprob(tokenizer, token: int, logprobs: mx.array, top: int) -> TokenLogprob:
    """The entry of `token` from the log-probabilities at its position [V], with the `top`
    most likely tokens."""
    best: list[tuple[int, str, float]] = []
    if top:
        ids = mx.argpartition(-logprobs, kth=top - 1)[:top]
        ranked = sorted(zip(ids.tolist(), logprobs[ids].tolist(), strict=True), key=lambda x: -x[1])
        best = [(i, tokenizer.decode([i]), value) for i, value in ranked]
    value = logprobs[token].item()
    return TokenLogprob(token, tokenizer.decode([token]), value, best)


@dataclass
class Generation:
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = "length"  # "stop" at EOS or a stop string
    stop_string: str | None = None  # the stop string the text was cut at
    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    generation_seconds: float = 0.0
    peak_memory_gb: float = 0.0
    stats: Stats | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token, when asked for

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds else 0.0

    @property
    def generation_tps(self) -> float:
        return len(self.tokens) / self.generation_seconds if self.generation_seconds else 0.0


def finish_text(
    tokens: Iterable[int],
    tokenizer,
    *,
    max_tokens: int,
    stop: Sequence[str] = (),
    on_text: Callable[[str], None] | None = None,
) -> Generation:
    """Consume a token stream with plain decoding's stop rules: end before an EOS token, after
    max_tokens, or where a stop string begins (the text is cut there). Text that could still
    become a stop string is held back from `on_text`."""
    result = Generation()
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    eos = set(tokenizer.eos_token_ids)
    hold = max((len(s) for s in stop), default=1) - 1
    shown, cut = 0, -1
    for token in tokens:
        if token in eos:
            result.finish_reason = "stop"
            break
        result.tokens.append(token)
        detokenizer.add_token(token)
        text = detokenizer.text
        cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
        if cut >= 0:
            result.text, result.finish_reason = text[:cut], "stop"
            result.stop_string = next(s for s in stop if text.find(s) == cut)
            break
        if on_text and len(text) - hold > shown:
            on_text(text[shown : len(text) - hold])
            shown = len(text) - hold
        if len(result.tokens) == max_tokens:
            break
    if cut < 0:
        detokenizer.finalize()
        result.text = detokenizer.text
    if on_text and len(result.text) > shown:
        on_text(result.text[shown:])
    return result


def generate(
    session,
    prompt_ids: Sequence[int],
    *,
    max_tokens: int,
    policy,
    sampling: Sampling,
    stop: Sequence[str] = (),
    on_text: Callable[[str], None] | None = None,
    cached: int = 0,
    cancelled: Callable[[], bool] | None = None,
    logits_processors: Sequence[LogitsProcessor] = (),
    logprobs: int | None = None,
) -> Generation:
    """cached, cancelled, logits_processors: as for `speculative_generate_step` (a cancelled
    generation ends with the text so far). logprobs: as for `timed_text`."""
    stats = Stats()
    steps = speculative_generate_step(
        prompt_ids,
        session.target,
        session.drafter,
        policy=policy,
        sampling=sampling,
        stats=stats,
        lookup=session.lookup,
        cached=cached,
        cancelled=cancelled,
        logits_processors=logits_processors,
        logprobs=logprobs is not None,
    )
    result = timed_text(
        ((step[0], step[2]) for step in steps) if logprobs is not None else (s[0] for s in steps),
        session.tokenizer,
        prompt_tokens=len(prompt_ids),
        max_tokens=max_tokens,
        stop=stop,
        on_text=on_text,
        logprobs=logprobs,
    )
    result.stats = stats
    return result


def timed_text(
    tokens: Iterable[int] | Iterable[tuple[int, mx.array]],
    tokenizer,
    *,
    prompt_tokens: int,
    max_tokens: int,
    stop: Sequence[str] = (),
    on_text: Callable[[str], None] | None = None,
    logprobs: int | None = None,
) -> Generation:
    """`finish_text` over a lazy token stream whose first token comes once the prompt has been
    processed, with the prompt's and the generation's times and the peak memory.

    logprobs: None, or the stream is of (token, the target's log-probabilities at its position
    [V]) and the result's `logprobs` has each token's entry with the `logprobs` most likely
    tokens; `on_text` then gets LoggedText pieces carrying the entries consumed since the last
    piece (a last empty piece carries those no text came with)."""
    mx.reset_peak_memory()
    start = time.perf_counter()
    first_token_at = [0.0]
    entries: list[TokenLogprob] = []
    eos = set(tokenizer.eos_token_ids)

    def timed():
        for i, item in enumerate(tokens):
            if i == 0:
                first_token_at[0] = time.perf_counter()
            if logprobs is None:
                yield item
                continue
            token, row = item
            if token not in eos:  # the stream ends before an EOS token
                entries.append(token_logprob(tokenizer, token, row, logprobs))
            yield token

    sent = 0

    def logged(text: str) -> None:
        nonlocal sent
        on_text(LoggedText(text, entries[sent:]))
        sent = len(entries)

    shown = logged if on_text is not None and logprobs is not None else on_text
    result = finish_text(timed(), tokenizer, max_tokens=max_tokens, stop=stop, on_text=shown)
    if logprobs is not None:
        result.logprobs = entries
        if on_text is not None and sent < len(entries):
            logged("")
    end = time.perf_counter()
    result.prompt_tokens = prompt_tokens
    if first_token_at[0]:
        result.prompt_seconds = first_token_at[0] - start
        result.generation_seconds = end - first_token_at[0]
    result.peak_memory_gb = mx.get_peak_memory() / 1e9
    return result
