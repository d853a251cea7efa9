"""OpenAI's response shapes: a whole answer, its streamed chunks as server-sent events, and the
`usage` object, which adds the speculative loop's statistics to OpenAI's token counts."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass


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


@dataclass
class Answer:
    """The fixed fields of one request's response objects and chunks."""

    endpoint: str
    model_id: str
    id: str = ""
    created: int = 0

    def __post_init__(self) -> None:
        prefix = "chatcmpl" if self.endpoint == "chat.completions" else "cmpl"
        self.id, self.created = f"{prefix}-{uuid.uuid4().hex[:24]}", int(time.time())

    def _object(self, kind: str, choices: list, **extra) -> dict:
        head = {"id": self.id, "object": kind, "created": self.created, "model": self.model_id}
        return {**head, "choices": choices, **extra}

    def complete(self, result) -> dict:
        if self.endpoint == "chat.completions":
            message = {"role": "assistant", "content": result.text}
            choice = {"index": 0, "message": message, "logprobs": None}
            kind = "chat.completion"
        else:
            choice, kind = {"index": 0, "text": result.text, "logprobs": None}, "text_completion"
        choice["finish_reason"] = result.finish_reason
        return self._object(kind, [choice], usage=usage(result))

    def chunk(self, text: str | None = None, finish_reason: str | None = None, **extra) -> str:
        if self.endpoint == "chat.completions":
            delta = {} if text is None else {"content": text}
            choice, kind = {"index": 0, "delta": delta}, "chat.completion.chunk"
        else:
            choice, kind = {"index": 0, "text": text or "", "logprobs": None}, "text_completion"
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
