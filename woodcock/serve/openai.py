"""OpenAI's response shapes: a whole answer, its streamed chunks as server-sent events, the
`usage` object, which adds the speculative loop's statistics to OpenAI's token counts, and the
log-probabilities in chat's shape and in the completions' legacy one."""

from __future__ import annotations

import codecs
import json
import time
import uuid
from dataclasses import dataclass, field


def usage(result) -> dict:
    """OpenAI's counts, the prompt tokens reused from the cache, and the speculative loop's
    statistics. The accepted/rejected "prediction" tokens are the drafts the target accepted
    and rejected (what OpenAI reports for predicted outputs); all the round counts cover the
    rounds run, so the last one may count tokens past a stop."""
    stats = result.stats
    drafted, accepted = sum(stats.drafted), sum(stats.accepted)
    completion = len(result.tokens)
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": result.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
        "completion_tokens_details": {
            "accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": drafted - accepted,
        },
        "speculative": {
            "rounds": stats.rounds,
            "drafted_tokens": drafted,
            "accepted_tokens": accepted,
            "tokens_per_round": round(stats.tokens_per_round, 4),
            "acceptance_by_position": [round(r, 4) for r in stats.acceptance_by_position()],
            "copied_rounds": stats.copied_rounds,
            "prompt_seconds": round(result.prompt_seconds, 6),
            "generation_seconds": round(result.generation_seconds, 6),
            "draft_seconds": round(stats.draft_seconds, 6),
            "verify_seconds": round(stats.verify_seconds, 6),
        },
    }


def chat_logprobs(entries) -> dict:
    """Chat's `logprobs`: each token's text, log-probability, UTF-8 bytes and most likely
    alternatives (generate.TokenLogprob entries)."""

    def token(text: str, raw: bytes, logprob: float) -> dict:
        return {"token": text, "logprob": logprob, "bytes": list(raw)}

    return {
        "content": [
            {
                **token(e.text, e.raw, e.logprob),
                "top_logprobs": [token(text, raw, value) for _, text, raw, value in e.top],
            }
            for e in entries
        ]
    }


class TextOffsets:
    """Each token's offset in the answer's text: the characters its predecessors' bytes complete.
    A token holding part of a character adds nothing until the character is whole (its text
    alone, U+FFFD, is not its share of the answer's)."""

    def __init__(self) -> None:
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.characters = 0

    def next(self, raw: bytes) -> int:
        offset = self.characters
        self.characters += len(self.decoder.decode(raw))
        return offset


def completion_logprobs(entries, offsets: TextOffsets | None = None) -> dict:
    """The completions' legacy `logprobs`: parallel lists, the alternatives as {text: logprob}
    and each token's offset in the answer's text (`offsets`: the stream's so far)."""
    offsets = offsets or TextOffsets()
    text_offsets, tops = [], []
    for e in entries:
        text_offsets.append(offsets.next(e.raw))
        top: dict[str, float] = {}
        for _, text, _, value in e.top:
            top.setdefault(text, value)  # texts that agree (partial characters): the likelier
        tops.append(top)
    return {
        "tokens": [e.text for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": tops,
        "text_offset": text_offsets,
    }


@dataclass
class Answer:
    """The fixed fields of one request's response objects and chunks."""

    endpoint: str
    model_id: str
    id: str = ""
    created: int = 0
    text_offsets: TextOffsets = field(default_factory=TextOffsets)  # the completions' logprobs

    def __post_init__(self) -> None:
        prefix = "chatcmpl" if self.endpoint == "chat.completions" else "cmpl"
        self.id, self.created = f"{prefix}-{uuid.uuid4().hex[:24]}", int(time.time())

    def _object(self, kind: str, choices: list, **extra) -> dict:
        head = {"id": self.id, "object": kind, "created": self.created, "model": self.model_id}
        return {**head, "choices": choices, **extra}

    def complete(self, result) -> dict:
        logprobs = None
        if self.endpoint == "chat.completions":
            if result.logprobs is not None:
                logprobs = chat_logprobs(result.logprobs)
            message = {"role": "assistant", "content": result.text}
            choice = {"index": 0, "message": message, "logprobs": logprobs}
            kind = "chat.completion"
        else:
            if result.logprobs is not None:
                logprobs = completion_logprobs(result.logprobs)
            choice = {"index": 0, "text": result.text, "logprobs": logprobs}
            kind = "text_completion"
        choice["finish_reason"] = result.finish_reason
        return self._object(kind, [choice], usage=usage(result))

    def chunk(self, text: str | None = None, finish_reason: str | None = None, **extra) -> str:
        """text: a piece of the answer; a LoggedText piece adds its tokens' logprobs."""
        entries = getattr(text, "logprobs", None)
        if self.endpoint == "chat.completions":
            delta = {} if text is None else {"content": str(text)}
            choice, kind = {"index": 0, "delta": delta}, "chat.completion.chunk"
            if entries is not None:
                choice["logprobs"] = chat_logprobs(entries)
        else:
            logprobs = None
            if entries is not None:
                logprobs = completion_logprobs(entries, self.text_offsets)
            choice = {"index": 0, "text": str(text or ""), "logprobs": logprobs}
            kind = "text_completion"
        choice["finish_reason"] = finish_reason
        return sse_event(self._object(kind, [choice], **extra))

    def role_chunk(self, **extra) -> str:
        delta = {"role": "assistant", "content": ""}
        choice = {"index": 0, "delta": delta, "finish_reason": None}
        return sse_event(self._object("chat.completion.chunk", [choice], **extra))

    def usage_chunk(self, result) -> str:
        kind = "chat.completion.chunk" if self.endpoint == "chat.completions" else "text_completion"
        return sse_event(self._object(kind, [], usage=usage(result)))


def sse_event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


STREAM_END = "data: [DONE]\n\n"
