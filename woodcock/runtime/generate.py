"""Text in, text out: prompt encoding like `mlx_lm.generate`, streaming detokenisation, and the
stop rules of plain decoding (EOS, max tokens, stop strings) applied to the speculative stream."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from woodcock.errors import DrafterError
from woodcock.jsonfile import outside_range
from woodcock.runtime.decode import Stats, speculative_generate_step
from woodcock.runtime.sampling import LogitsProcessor, Sampling


def encode_prompt(
    tokenizer, prompt: str, *, chat: bool = True, system: str | None = None
) -> list[int]:
    """As mlx_lm.generate does: the chat template when asked for and present, then encode."""
    if not isinstance(prompt, str):
        raise DrafterError(f"prompt = {prompt!r:.60}: expected a string")
    check_system_prompt(system, chat=chat, chat_template=tokenizer.has_chat_template)
    if chat and tokenizer.has_chat_template:
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": prompt})
        return encode_messages(tokenizer, messages)
    return list(tokenizer.encode(prompt, add_special_tokens=True))


def check_system_prompt(system: str | None, *, chat: bool, chat_template: bool = True) -> None:
    """A system prompt goes only through a chat template: refused, not dropped, without one."""
    if system is None:
        return
    if not chat:
        raise DrafterError("--system: a system prompt needs the chat template; drop --no-chat")
    if not chat_template:
        raise DrafterError(
            "--system: a system prompt needs the chat template, and the target's tokenizer has none"
        )


def encode_messages(tokenizer, messages: Sequence[dict]) -> list[int]:
    """A conversation ({"role", "content"} dicts, oldest first) through the chat template, with
    the prompt for the assistant's next turn; the template writes any special tokens itself."""
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


@dataclass
class TokenLogprob:
    """One emitted token's log-probability under the target and the most likely tokens at its
    position (text is each token decoded alone; raw its bytes, which for a token holding part
    of a character are not that text's)."""

    token: int
    text: str
    raw: bytes
    logprob: float
    top: list[tuple[int, str, bytes, float]]  # (token, text, raw, logprob), most likely first


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
    ranked: list[tuple[int, float]] = []
    if top:
        ids = mx.argpartition(-logprobs, kth=top - 1)[:top]
        ranked = sorted(zip(ids.tolist(), logprobs[ids].tolist(), strict=True), key=lambda x: -x[1])
    raw, *best_raw = token_bytes(tokenizer, [token, *(i for i, _ in ranked)])
    best = [
        (i, tokenizer.decode([i]), b, value) for (i, value), b in zip(ranked, best_raw, strict=True)
    ]
    return TokenLogprob(token, tokenizer.decode([token]), raw, logprobs[token].item(), best)


def token_bytes(tokenizer, tokens: list[int]) -> list[bytes]:
    """The bytes each token adds to the text: its vocabulary entry read as byte-level BPE
    (GPT-2's byte alphabet) or SentencePiece (`<0xNN>` byte pieces, `▁` for a space) where the
    tokenizer's detokenizer is one of those, else the token decoded alone."""
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer

    detokenizer = tokenizer.detokenizer  # a copy each time it is read
    byte_level = isinstance(detokenizer, BPEStreamingDetokenizer)
    sentencepiece = isinstance(detokenizer, SPMStreamingDetokenizer)
    return [_token_bytes(tokenizer, t, byte_level, sentencepiece) for t in tokens]


def _token_bytes(tokenizer, token: int, byte_level: bool, sentencepiece: bool) -> bytes:
    piece = tokenizer.convert_ids_to_tokens(token) if byte_level or sentencepiece else None
    if not isinstance(piece, str):
        return tokenizer.decode([token]).encode("utf-8")
    if byte_level:
        table = _byte_level_alphabet()
        return b"".join(bytes([table[c]]) if c in table else c.encode("utf-8") for c in piece)
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return bytes([int(piece[3:5], 16)])
    return piece.replace("\u2581", " ").encode("utf-8")


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: character -> byte. Printable Latin-1 bytes stand for
    themselves; the others, in order, for the characters from U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    table = {chr(b): b for b in printable}
    others = (b for b in range(256) if chr(b) not in table)
    table.update({chr(256 + n): b for n, b in enumerate(others)})
    return table


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


# Prompt tokens a continuation is detokenized after: enough for a tokenizer's spacing rules
# (vLLM's incremental detokenizer starts 5 tokens back).
CONTINUED_PROMPT_TOKENS = 5


class TextStream:
    """Plain decoding's stop rules over tokens given one at a time (`add`): end before an EOS
    token, after max_tokens, or where a stop string begins (the text is cut there). Text that
    could still become a stop string is held back from `on_text`.

    logprobs: None, or each token comes with the target's log-probabilities at its position [V]
    and the result's `logprobs` has each token's entry with the `logprobs` most likely tokens;
    `on_text` then gets LoggedText pieces carrying the entries consumed since the last piece (a
    last empty piece carries those no text came with).

    continues: the prompt's tokens, for text that is appended to the prompt's (a completion):
    the text is what the tokens add after the prompt's last few, its leading space included,
    where on its own (an answer) mlx-lm's detokenizers drop a leading space."""

    def __init__(
        self,
        tokenizer,
        *,
        max_tokens: int,
        stop: Sequence[str] = (),
        on_text: Callable[[str], None] | None = None,
        logprobs: int | None = None,
        continues: Sequence[int] = (),
    ):
        self.result = Generation()
        self.done = False
        self._tokenizer, self._max_tokens, self._stop = tokenizer, max_tokens, stop
        self._on_text, self._logprobs = on_text, logprobs
        self._detokenizer = tokenizer.detokenizer
        self._detokenizer.reset()
        self._prompt_text = ""  # the detokenizer's text of the prompt's tokens it was given
        if continues:
            prompt = tokenizer.detokenizer
            for token in continues[-CONTINUED_PROMPT_TOKENS:]:
                prompt.add_token(token)
                self._detokenizer.add_token(token)
            prompt.finalize()
            self._prompt_text = prompt.text
        self._eos = set(tokenizer.eos_token_ids)
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._shown, self._cut, self._sent = 0, -1, 0
        self._entries: list[TokenLogprob] = []

    def add(self, token: int, logprobs: mx.array | None = None) -> bool:
        """One more token (with its log-probabilities when asked for); True once the text is
        complete (this token and any after it are not part of it)."""
        result = self.result
        if self._logprobs is not None and token not in self._eos:
            self._entries.append(token_logprob(self._tokenizer, token, logprobs, self._logprobs))
        if token in self._eos:
            result.finish_reason, self.done = "stop", True
            return True
        result.tokens.append(token)
        self._detokenizer.add_token(token)
        text = self._text()
        if self._cut_at_stop(text):
            return True
        if len(text) - self._hold > self._shown:
            self._show(text[self._shown : len(text) - self._hold])
            self._shown = len(text) - self._hold
        self.done = len(result.tokens) == self._max_tokens
        return self.done

    def close(self) -> Generation:
        """The text so far, complete or not (a cancelled generation ends here too)."""
        result = self.result
        if self._cut < 0:
            self._detokenizer.finalize()  # text held back (a space, part of a character)
            text = self._text()
            if not self._cut_at_stop(text):
                result.text = text
        if len(result.text) > self._shown:
            self._show(result.text[self._shown :])
            self._shown = len(result.text)
        if self._logprobs is not None:
            result.logprobs = self._entries
            if self._sent < len(self._entries):
                self._show("")
        return result

    def _text(self) -> str:
        return self._detokenizer.text[len(self._prompt_text) :]

    def _cut_at_stop(self, text: str) -> bool:
        """Cut the text where a stop string begins, if one does: the generation is complete."""
        cut = min((i for i in (text.find(s) for s in self._stop) if i >= 0), default=-1)
        if cut < 0:
            return False
        self._cut = cut
        self.result.text, self.result.finish_reason = text[:cut], "stop"
        self.result.stop_string = next(s for s in self._stop if text.find(s) == cut)
        self.done = True
        return True

    def _show(self, text: str) -> None:
        if self._on_text is None:
            return
        if self._logprobs is None:
            self._on_text(text)
            return
        self._on_text(LoggedText(text, self._entries[self._sent :]))
        self._sent = len(self._entries)


def finish_text(
    tokens: Iterable[int],
    tokenizer,
    *,
    max_tokens: int,
    stop: Sequence[str] = (),
    on_text: Callable[[str], None] | None = None,
) -> Generation:
    """A token stream through a TextStream, pulled only as far as the text needs."""
    text = TextStream(tokenizer, max_tokens=max_tokens, stop=stop, on_text=on_text)
    for token in tokens:
        if text.add(token):
            break
    return text.close()


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
    key: mx.array | None = None,
    continues: Sequence[int] = (),
) -> Generation:
    """cached, cancelled, logits_processors, key: as for `speculative_generate_step` (a
    cancelled generation ends with the text so far). logprobs, continues: as for TextStream.
    stop: stop strings (one string: that one)."""
    stop = (stop,) if isinstance(stop, str) else stop
    prompt_ids = checked_arguments(
        session, prompt_ids, max_tokens, policy, sampling, stop, logprobs
    )
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
        key=key,
        max_tokens=max_tokens,
    )
    result = timed_text(
        ((step[0], step[2]) for step in steps) if logprobs is not None else (s[0] for s in steps),
        session.tokenizer,
        prompt_tokens=len(prompt_ids),
        max_tokens=max_tokens,
        stop=stop,
        on_text=on_text,
        logprobs=logprobs,
        continues=continues,
    )
    result.stats = stats
    return result


def checked_arguments(
    session, prompt_ids, max_tokens, policy, sampling, stop, logprobs
) -> list[int]:
    """What `generate` refuses before any work, naming the argument (the command line and the
    server check their own options first, in their own words): the prompt's ids as a list."""
    if not _is_int(max_tokens) or max_tokens < 1:
        raise DrafterError(f"max_tokens = {max_tokens!r}: expected an integer at least 1")
    vocab = session.target.vocab_size
    ids = prompt_ids.tolist() if hasattr(prompt_ids, "tolist") else prompt_ids  # numpy, MLX
    ids = list(ids) if isinstance(ids, Sequence) and not isinstance(ids, str) else None
    if ids is None or not all(_is_int(t) for t in ids):
        raise DrafterError(
            "prompt_ids: expected a list of integer token ids (encode_prompt makes one from text)"
        )
    if not ids:
        raise DrafterError("prompt_ids: empty; expected at least one token")
    outside = outside_range(ids, vocab)
    if outside is not None:
        raise DrafterError(f"prompt_ids: token id {outside}: expected ids in [0, {vocab})")
    check_context_room(session, len(ids), max_tokens, f"max_tokens = {max_tokens}")
    if isinstance(policy, str) or not hasattr(policy, "draft_length"):
        raise DrafterError(
            f"policy = {policy!r}: expected a policy object; parse_policy(text, drafter) makes"
            " one from text such as 'fixed:3'"
        )
    if not isinstance(sampling, Sampling):
        raise DrafterError(f"sampling = {sampling!r}: expected a Sampling (Sampling() is greedy)")
    if not all(isinstance(text, str) and text for text in stop):
        raise DrafterError(f"stop = {stop!r}: expected non-empty strings")
    if logprobs is not None and (not _is_int(logprobs) or not 0 <= logprobs <= vocab):
        raise DrafterError(f"logprobs = {logprobs!r}: expected None or an integer in [0, {vocab}]")
    return ids


def check_context_room(session, prompt_tokens: int, max_tokens: int, named: str) -> None:
    """Refuse a prompt and a length that the target's context cannot hold; `named`: how the
    caller's option reads (`--max-tokens 9`, `max_tokens = 9`)."""
    context = session.target.context_length
    if context is not None and prompt_tokens + max_tokens > context:
        raise DrafterError(
            f"{named}: {prompt_tokens} prompt tokens + {max_tokens} exceed the target's context"
            f" of {context} tokens (at most {max(context - prompt_tokens, 0)} here)"
        )


def _is_int(value) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def timed_text(
    tokens: Iterable[int] | Iterable[tuple[int, mx.array]],
    tokenizer,
    *,
    prompt_tokens: int,
    max_tokens: int,
    stop: Sequence[str] = (),
    on_text: Callable[[str], None] | None = None,
    logprobs: int | None = None,
    continues: Sequence[int] = (),
) -> Generation:
    """A lazy token stream (of (token, log-probabilities [V]) when `logprobs` is given: see
    TextStream) whose first token comes once the prompt has been processed, through a
    TextStream, with the prompt's and the generation's times and the peak memory."""
    mx.reset_peak_memory()
    start = time.perf_counter()
    first_token_at = 0.0
    text = TextStream(
        tokenizer,
        max_tokens=max_tokens,
        stop=stop,
        on_text=on_text,
        logprobs=logprobs,
        continues=continues,
    )
    for item in tokens:
        if not first_token_at:
            first_token_at = time.perf_counter()
        if text.add(*item) if logprobs is not None else text.add(item):
            break
    result = text.close()
    end = time.perf_counter()
    result.prompt_tokens = prompt_tokens
    if first_token_at:
        result.prompt_seconds = first_token_at - start
        result.generation_seconds = end - first_token_at
    result.peak_memory_gb = mx.get_peak_memory() / 1e9
    return result
