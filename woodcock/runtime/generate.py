"""Text in, text out: prompt encoding like `mlx_lm.generate`, streaming detokenisation, and the
stop rules of plain decoding (EOS, max tokens, stop strings) applied to the speculative stream."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from woodcock.runtime.decode import Stats, speculative_generate_step
from woodcock.runtime.sampling import Sampling


def encode_prompt(
    tokenizer, prompt: str, *, chat: bool = True, system: str | None = None
) -> list[int]:
    """As mlx_lm.generate does: the chat template when asked for and present, then encode."""
    use_template = chat and tokenizer.has_chat_template
    if use_template:
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": prompt})
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(prompt, add_special_tokens=not use_template))


@dataclass
class Generation:
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = "length"  # "stop" at EOS or a stop string
    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    generation_seconds: float = 0.0
    peak_memory_gb: float = 0.0
    stats: Stats | None = None

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
) -> Generation:
    stats = Stats()
    mx.reset_peak_memory()
    steps = speculative_generate_step(
        prompt_ids,
        session.target,
        session.drafter,
        policy=policy,
        sampling=sampling,
        stats=stats,
        lookup=session.lookup,
    )
    start = time.perf_counter()
    first_token_at = [0.0]

    def tokens():
        for i, (token, _) in enumerate(steps):
            if i == 0:
                first_token_at[0] = time.perf_counter()
            yield token

    result = finish_text(
        tokens(), session.tokenizer, max_tokens=max_tokens, stop=stop, on_text=on_text
    )
    end = time.perf_counter()
    result.prompt_tokens = len(prompt_ids)
    result.prompt_seconds = first_token_at[0] - start
    result.generation_seconds = end - first_token_at[0]
    result.peak_memory_gb = mx.get_peak_memory() / 1e9
    result.stats = stats
    return result
