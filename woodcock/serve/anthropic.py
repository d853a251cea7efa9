"""Anthropic's Messages API over the same requests and engine: a /v1/messages body becomes the
chat request the OpenAI side parses (so the checks, the chat template, the stop rules and the
context fit are the same), and its answer, its streamed events and its errors take Anthropic's
shapes. `usage` counts the prompt as Anthropic does (tokens read from the cache apart) and adds
the speculative loop's statistics, as the OpenAI side reports them."""

from __future__ import annotations

import json
import uuid
from dataclasses import replace

from woodcock.serve.openai import usage as openai_usage
from woodcock.serve.request import (
    ContextOverflow,
    GenerationRequest,
    ModelFacts,
    RequestError,
    chat_messages,
    content_text,
    json_type,
    parse_request,
    stop_strings,
)

# Fields that would change the answer in ways this server does not implement, each with the
# values that leave it off: refused rather than ignored, as the OpenAI side refuses its own.
# Others (metadata, service_tier, cache_control...) do not change the answer and are ignored.
UNSUPPORTED = {
    "tools": lambda v: not v,
    "tool_choice": lambda v: isinstance(v, dict) and v.get("type") in ("auto", "none"),
    "thinking": lambda v: isinstance(v, dict) and v.get("type") == "disabled",
    "output_config": lambda v: isinstance(v, dict) and v.get("format") is None,
    "output_format": lambda v: False,
    "container": lambda v: False,
    "mcp_servers": lambda v: not v,
}
# Anthropic's error types by the status the server would answer
ERROR_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    408: "timeout_error",
    500: "api_error",
    504: "timeout_error",
}
OVERLOADED = 529  # Anthropic's status for "busy, retry": what a full queue answers here


def _refuse_unsupported(body: dict) -> None:
    for name, is_off in UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and not is_off(value):
            raise RequestError(
                f"{name}: not supported by this server", param=name, code="unsupported_parameter"
            )


def _conversation(body: dict) -> list[dict]:
    """`system` and `messages` as the chat template's turns."""
    messages = body.get("messages")
    for i, message in enumerate(messages if isinstance(messages, list) else []):
        role = message.get("role") if isinstance(message, dict) else None
        if role in ("system", "developer"):
            raise RequestError(
                f"messages[{i}].role: {role!r}: expected assistant or user (the system prompt"
                " is the top-level `system`)",
                param=f"messages[{i}].role",
                code="invalid_value",
            )
    conversation = []
    for turn in chat_messages(body):
        # Anthropic combines consecutive turns of one role into a single turn: their text joins
        # as the text blocks of one message do
        if conversation and conversation[-1]["role"] == turn["role"]:
            conversation[-1]["content"] += turn["content"]
        else:
            conversation.append(turn)
    if conversation[-1]["role"] == "assistant":
        last = len(messages) - 1
        raise RequestError(
            f"messages[{last}]: a final assistant turn (prefill) is not supported: the answer"
            " starts a new assistant turn",
            param=f"messages[{last}]",
            code="unsupported_parameter",
        )
    system = body.get("system")
    if system is not None and (text := content_text(system, "system")):
        conversation.insert(0, {"role": "system", "content": text})
    return conversation


def _parse_as_chat(body: dict, facts: ModelFacts, max_tokens) -> GenerationRequest:
    _refuse_unsupported(body)
    # Anthropic's own bounds where they are narrower than OpenAI's (types are checked there)
    temperature = body.get("temperature")
    if isinstance(temperature, int | float) and not isinstance(temperature, bool):
        if not 0 <= temperature <= 1:
            raise RequestError(
                f"temperature = {temperature}: expected a number in [0, 1]",
                param="temperature",
                code="invalid_value",
            )
    sequences = body.get("stop_sequences")
    if sequences is not None and not isinstance(sequences, list):
        raise RequestError(
            f"stop_sequences: expected an array of strings, got {json_type(sequences)}",
            param="stop_sequences",
            code="invalid_type",
        )
    chat = {name: body.get(name) for name in ("model", "temperature", "top_p", "top_k", "stream")}
    stop = list(stop_strings(body, "stop_sequences"))
    chat.update(messages=_conversation(body), max_tokens=max_tokens, stop=stop)
    return replace(parse_request(chat, "chat.completions", facts), endpoint="messages")


def parse_messages(body: dict, facts: ModelFacts) -> GenerationRequest:
    """Check a /v1/messages body and encode its conversation; RequestError names the first bad
    field. max_tokens is required, as Anthropic requires it."""
    if body.get("max_tokens") is None:
        raise RequestError(
            "max_tokens: required", param="max_tokens", code="missing_required_parameter"
        )
    return _parse_as_chat(body, facts, body["max_tokens"])


def count_input_tokens(body: dict, facts: ModelFacts) -> int:
    """/v1/messages/count_tokens: the prompt's tokens, also when the context cannot hold it."""
    try:
        return len(_parse_as_chat(body, facts, 1).prompt_ids)
    except ContextOverflow as e:
        return e.prompt_tokens


def error_body(error: RequestError) -> tuple[dict, int]:
    """Anthropic's error object and the status it comes with: a full queue is 529 overloaded, and
    a context overflow is worded as Anthropic words it (agents read the numbers back)."""
    if error.status == 503:
        kind, status = "overloaded_error", OVERLOADED
    else:
        kind, status = ERROR_TYPES.get(error.status, "invalid_request_error"), error.status
    message = error.message
    if isinstance(error, ContextOverflow):
        prompt, limit = error.prompt_tokens, error.context
        message = (
            f"prompt is too long: {prompt} tokens > {limit - 1} maximum"
            if error.completion_tokens is None
            else f"input length and `max_tokens` exceed context limit: {prompt} +"
            f" {error.completion_tokens} > {limit}, decrease input length or `max_tokens` and"
            " try again"
        )
    return {"type": "error", "error": {"type": kind, "message": message}}, status


def usage(result) -> dict:
    """Anthropic's counts (the prompt tokens whose cached rows were reused apart from those
    processed) and the speculative loop's statistics."""
    cached = result.stats.cached_tokens
    return {
        "input_tokens": result.prompt_tokens - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": len(result.tokens),
        "speculative": openai_usage(result)["speculative"],
    }


def _stop_reason(result) -> tuple[str, str | None]:
    if result.finish_reason == "length":
        return "max_tokens", None
    if result.stop_string is not None:
        return "stop_sequence", result.stop_string
    return "end_turn", None


def _event(kind: str, payload: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload})}\n\n"


class MessageAnswer:
    """One request's message: whole, or as the stream's events (message_start, one text block's
    start, deltas and stop, message_delta with the stop reason and usage, message_stop)."""

    def __init__(self, model_id: str, request: GenerationRequest):
        self.model_id, self.input_tokens = model_id, len(request.prompt_ids)
        self.id = f"msg_{uuid.uuid4().hex[:24]}"

    def _message(self, text: str | None, stop_reason, stop_sequence, usage: dict) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "content": [] if text is None else [{"type": "text", "text": text}],
            "model": self.model_id,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": usage,
        }

    def complete(self, result) -> dict:
        return self._message(result.text, *_stop_reason(result), usage(result))

    def opening(self, cached_tokens: int) -> str:
        counts = {
            "input_tokens": self.input_tokens - cached_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached_tokens,
            "output_tokens": 0,
        }
        start = self._message(None, None, None, counts)
        block = {"index": 0, "content_block": {"type": "text", "text": ""}}
        return _event("message_start", {"message": start}) + _event("content_block_start", block)

    def text(self, text: str) -> str:
        delta = {"type": "text_delta", "text": text}
        return _event("content_block_delta", {"index": 0, "delta": delta})

    def done(self, result) -> str:
        stop_reason, stop_sequence = _stop_reason(result)
        delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
        return (
            _event("content_block_stop", {"index": 0})
            + _event("message_delta", {"delta": delta, "usage": usage(result)})
            + _event("message_stop", {})
        )

    def failure(self, error: RequestError) -> str:
        body, _ = error_body(error)
        return _event("error", {"error": body["error"]})

    def closing(self) -> str:
        return ""
