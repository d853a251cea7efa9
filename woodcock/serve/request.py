"""A generation request, parsed and checked before it is queued.

A bad value is a RequestError, answered 400 with OpenAI's error object naming the field
(`param`); an unknown `model` is a 404 with code `model_not_found`, as OpenAI answers it.
Fields that would change the answer in ways this server does not implement are refused rather
than ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from jinja2 import TemplateError

from woodcock.jsonfile import is_int_list, outside_range
from woodcock.runtime.generate import encode_messages

DEFAULT_MAX_TOKENS = 512  # when a request names no limit (as mlx_lm.server)
MAX_TOP_LOGPROBS = {"chat.completions": 20, "completions": 5}  # as OpenAI documents them
ROLES = {"system", "developer", "user", "assistant"}


class RequestError(Exception):
    """A request the server refuses, as OpenAI's error object with an HTTP status."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        status: int = 400,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code
        self.status, self.kind, self.headers = status, kind, headers or {}

    def body(self) -> dict:
        error = {"message": self.message, "type": self.kind, "param": self.param}
        return {"error": {**error, "code": self.code}}


class ContextOverflow(RequestError):
    """A prompt, or a prompt and the requested completion, longer than the target's context: the
    numbers kept for an API that words the refusal its own way."""

    def __init__(
        self,
        message: str,
        *,
        context: int,
        prompt_tokens: int,
        completion_tokens: int | None,
        param: str,
    ):
        super().__init__(message, param=param, code="context_length_exceeded")
        self.context, self.prompt_tokens = context, prompt_tokens
        self.completion_tokens = completion_tokens  # None: the prompt alone is too long


def model_not_found(name: str, model_id: str) -> RequestError:
    return RequestError(
        f"The model {name!r} does not exist: this server serves {model_id!r}",
        param="model",
        code="model_not_found",
        status=404,
    )


def json_type(value) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}
    names.update({list: "an array", dict: "an object", type(None): "null"})
    return names.get(type(value), type(value).__name__)


def _no_constants(name: str):
    raise ValueError(f"{name} is not JSON")


def parse_json_body(raw: bytes) -> dict:
    """A request's body: a JSON object (NaN and Infinity are not JSON) whose strings are text: a
    lone UTF-16 surrogate (`"\ud800"`, half an emoji cut by a client) is valid JSON but no
    tokenizer can encode it."""
    try:
        body = json.loads(raw, parse_constant=_no_constants)
    except (ValueError, UnicodeDecodeError) as e:
        raise RequestError(f"the body is not valid JSON ({e})", code="invalid_json") from None
    except RecursionError:
        message = "the body is not valid JSON (nested too deeply)"
        raise RequestError(message, code="invalid_json") from None
    if not isinstance(body, dict):
        raise RequestError(
            f"the body must be a JSON object, got {json_type(body)}", code="invalid_json"
        )
    _refuse_lone_surrogates(body)
    return body


def _refuse_lone_surrogates(body: dict) -> None:
    pending: list[tuple[str, object]] = [("", body)]
    while pending:
        where, value = pending.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                pending.append((f"{where}.{key}" if where else str(key), item))
                _check_text(where or "the body", key)
        elif isinstance(value, list):
            pending.extend((f"{where}[{i}]", item) for i, item in enumerate(value))
        elif isinstance(value, str):
            _check_text(where, value)


def _check_text(where: str, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(
            f"{where}: a lone UTF-16 surrogate ({text[e.start]!r} at character {e.start}) is not"
            " text; send whole characters",
            param=where,
            code="invalid_value",
        ) from None


@dataclass
class GenerationRequest:
    endpoint: str  # "chat.completions" or "completions"
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # None: not asked for; n: each token's, with the n most likely
    logit_bias: dict[int, float] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 0.0  # mlx-lm's; 0 leaves the logits alone


@dataclass(frozen=True)
class ModelFacts:
    """What parsing a request needs to know of the served model."""

    model_id: str
    tokenizer: object
    vocab_size: int
    context_length: int | None
    default_max_tokens: int = DEFAULT_MAX_TOKENS


def _number(body: dict, name: str, default, *, low=None, high=None, integer: bool = False):
    value = body.get(name)
    if value is None:
        return default
    kind = "an integer" if integer else "a number"
    if integer and isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise RequestError(
            f"{name}: expected {kind}, got {json_type(value)}", param=name, code="invalid_type"
        )
    if (low is not None and value < low) or (high is not None and value > high):
        if low is not None and high is not None:
            bounds = f"in [{low}, {high}]"
        else:
            bounds = f">= {low}" if low is not None else f"<= {high}"
        raise RequestError(
            f"{name} = {value}: expected {kind} {bounds}", param=name, code="invalid_value"
        )
    return value


def _boolean(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(
            f"{name}: expected a boolean, got {json_type(value)}", param=name, code="invalid_type"
        )
    return value


def _refuse_unsupported(body: dict, endpoint: str) -> None:
    """Fields that would change the answer in ways this server does not implement: refused
    rather than ignored. `n` other than 1 is refused with them."""
    off = {
        "tools": lambda v: not v,
        "functions": lambda v: not v,
        "tool_choice": lambda v: v in (None, "none"),
        "function_call": lambda v: v in (None, "none"),
        "response_format": lambda v: v is None or v == {"type": "text"},
    }
    if endpoint == "completions":
        off.update(
            echo=lambda v: v in (None, False),
            suffix=lambda v: v in (None, ""),
            best_of=lambda v: v in (None, 1),
        )
    for name, is_off in off.items():
        try:
            refused = not is_off(body.get(name))
        except TypeError:  # unhashable
            refused = True
        if refused:
            raise RequestError(
                f"{name}: not supported by this server", param=name, code="unsupported_parameter"
            )
    n = _number(body, "n", 1, low=1, integer=True)
    if n != 1:
        raise RequestError(
            f"n = {n}: this server returns one choice per request (n = 1)",
            param="n",
            code="unsupported_parameter",
        )


def _logprobs(body: dict, endpoint: str) -> int | None:
    """How many of the most likely tokens to report with each token's log-probability; None
    when the log-probabilities are not asked for. Chat asks with `logprobs: true` and
    `top_logprobs`, completions with the integer `logprobs`."""
    top = MAX_TOP_LOGPROBS[endpoint]
    if endpoint == "completions":
        return _number(body, "logprobs", None, low=0, high=top, integer=True)
    count = _number(body, "top_logprobs", None, low=0, high=top, integer=True)
    if not _boolean(body, "logprobs", False):
        if count is not None:
            raise RequestError(
                "top_logprobs: only allowed with logprobs: true",
                param="top_logprobs",
                code="invalid_value",
            )
        return None
    return count or 0


def _logit_bias(body: dict, facts: ModelFacts) -> dict[int, float] | None:
    """{token id (a string, as JSON keys are): a bias in [-100, 100] added to its logit}."""
    bias = body.get("logit_bias")
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise RequestError(
            f"logit_bias: expected an object, got {json_type(bias)}",
            param="logit_bias",
            code="invalid_type",
        )
    parsed = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            token = -1
        if not 0 <= token < facts.vocab_size or str(token) != key.strip():
            raise RequestError(
                f"logit_bias: key {key!r}: expected a token id in [0, {facts.vocab_size})",
                param="logit_bias",
                code="invalid_value",
            )
        name = f"logit_bias[{key}]"
        if value is None:
            raise RequestError(
                f"{name}: expected a number, got null", param=name, code="invalid_type"
            )
        parsed[token] = float(_number({name: value}, name, None, low=-100, high=100))
    return parsed or None


def content_text(content, param: str) -> str:
    """A message's content: a string, or text parts [{"type": "text", "text": ...}]."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise RequestError(
                    f"{param}[{i}]: only text parts ({{'type': 'text', 'text': ...}}) are"
                    " supported",
                    param=f"{param}[{i}]",
                    code="unsupported_parameter",
                )
            if not isinstance(part.get("text"), str):
                raise RequestError(
                    f"{param}[{i}].text: expected a string, got {json_type(part.get('text'))}",
                    param=f"{param}[{i}].text",
                    code="invalid_type",
                )
            texts.append(part["text"])
        return "".join(texts)
    raise RequestError(
        f"{param}: expected a string or an array of text parts, got {json_type(content)}",
        param=param,
        code="invalid_type",
    )


def _seed(body: dict) -> int | None:
    """OpenAI's seed, a signed 64-bit integer, as the unsigned one MLX's PRNG takes (-1 is
    2**64 - 1: distinct seeds stay distinct)."""
    seed = _number(body, "seed", None, low=-(2**63), high=2**63 - 1, integer=True)
    return None if seed is None else seed % 2**64


def chat_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if messages is None:
        raise RequestError(
            "messages: required", param="messages", code="missing_required_parameter"
        )
    if not isinstance(messages, list) or not messages:
        raise RequestError(
            f"messages: expected a non-empty array, got {json_type(messages)}"
            if not isinstance(messages, list)
            else "messages: expected at least one message",
            param="messages",
            code="invalid_type" if not isinstance(messages, list) else "invalid_value",
        )
    conversation = []
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(message, dict):
            raise RequestError(
                f"{param}: expected an object, got {json_type(message)}",
                param=param,
                code="invalid_type",
            )
        role = message.get("role")
        if role not in ROLES:
            given = "required" if role is None else f"{role!r}"
            raise RequestError(
                f"{param}.role: {given}: expected one of {', '.join(sorted(ROLES))}",
                param=f"{param}.role",
                code="invalid_value",
            )
        if message.get("tool_calls"):
            raise RequestError(
                f"{param}.tool_calls: not supported by this server",
                param=f"{param}.tool_calls",
                code="unsupported_parameter",
            )
        text = content_text(message.get("content"), f"{param}.content")
        # templates know system turns; OpenAI's developer role is the newer name for them
        conversation.append({"role": "system" if role == "developer" else role, "content": text})
    return conversation


def _prompt_ids(body: dict, facts: ModelFacts) -> list[int]:
    """/v1/completions' prompt: a string, token ids, or a batch of one of either."""
    prompt = body.get("prompt")
    if prompt is None:
        raise RequestError("prompt: required", param="prompt", code="missing_required_parameter")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > 1:
            raise RequestError(
                f"prompt: a batch of {len(prompt)} prompts; this server takes one per request",
                param="prompt",
                code="unsupported_parameter",
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = list(facts.tokenizer.encode(prompt, add_special_tokens=True))
    elif is_int_list(prompt):
        bad = outside_range(prompt, facts.vocab_size)
        if bad is not None:
            raise RequestError(
                f"prompt: token id {bad}: expected ids in [0, {facts.vocab_size})",
                param="prompt",
                code="invalid_value",
            )
        ids = list(prompt)
    else:
        raise RequestError(
            "prompt: expected a string, an array of token ids or an array of one of them, got"
            f" {json_type(prompt)}",
            param="prompt",
            code="invalid_type",
        )
    if not ids:
        raise RequestError("prompt: empty", param="prompt", code="invalid_value")
    return ids


def stop_strings(body: dict, name: str = "stop") -> tuple[str, ...]:
    stop = body.get(name)
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list):
        raise RequestError(
            f"{name}: expected a string or an array of strings, got {json_type(stop)}",
            param=name,
            code="invalid_type",
        )
    for i, item in enumerate(stops):
        if not isinstance(item, str):
            raise RequestError(
                f"{name}[{i}]: expected a string, got {json_type(item)}",
                param=f"{name}[{i}]",
                code="invalid_type",
            )
    if any(not s for s in stops):
        raise RequestError(f"{name}: empty stop strings", param=name, code="invalid_value")
    return tuple(stops)


def parse_request(body: dict, endpoint: str, facts: ModelFacts) -> GenerationRequest:
    """Check a request body and encode its prompt; RequestError names the first bad field."""
    model = body.get("model")
    if model is not None:
        if not isinstance(model, str):
            raise RequestError(
                f"model: expected a string, got {json_type(model)}",
                param="model",
                code="invalid_type",
            )
        if model != facts.model_id:
            raise model_not_found(model, facts.model_id)
    _refuse_unsupported(body, endpoint)
    stream = _boolean(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise RequestError(
            f"stream_options: expected an object, got {json_type(options)}",
            param="stream_options",
            code="invalid_type",
        )
    if options is not None and not stream:
        raise RequestError(
            "stream_options: only allowed with stream: true",
            param="stream_options",
            code="invalid_value",
        )
    include_usage = _boolean(options or {}, "include_usage", False)
    given = body.get("max_completion_tokens") is not None  # the newer name wins
    limit_name = "max_completion_tokens" if given else "max_tokens"
    requested = _number(body, limit_name, None, low=1, integer=True)
    request = GenerationRequest(
        endpoint,
        prompt_ids=[],
        max_tokens=requested or facts.default_max_tokens,
        temperature=_number(body, "temperature", 0.0, low=0, high=2),
        top_p=_number(body, "top_p", 0.0, low=0, high=1),
        top_k=_number(body, "top_k", 0, low=0, integer=True),
        min_p=_number(body, "min_p", 0.0, low=0, high=1),
        stop=stop_strings(body),
        seed=_seed(body),
        stream=stream,
        include_usage=include_usage,
        logprobs=_logprobs(body, endpoint),
        logit_bias=_logit_bias(body, facts),
        presence_penalty=_number(body, "presence_penalty", 0.0, low=-2, high=2),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, low=-2, high=2),
        repetition_penalty=_number(body, "repetition_penalty", 0.0, low=0),
    )
    if endpoint == "chat.completions":
        prompt_field = "messages"
        conversation = chat_messages(body)
        if not facts.tokenizer.has_chat_template:
            raise RequestError(
                "messages: the target has no chat template; send the text to /v1/completions",
                param="messages",
                code="invalid_value",
            )
        try:
            request.prompt_ids = encode_messages(facts.tokenizer, conversation)
        except TemplateError as e:  # e.g. a template that allows no system turn
            raise RequestError(
                f"messages: the target's chat template refused them ({e})",
                param="messages",
                code="invalid_value",
            ) from None
    else:
        prompt_field = "prompt"
        request.prompt_ids = _prompt_ids(body, facts)
    if facts.context_length is not None:
        _fit_context(request, facts.context_length, prompt_field, limit_name, requested)
    return request


def _fit_context(
    request: GenerationRequest,
    context: int,
    prompt_field: str,
    limit_name: str,
    requested: int | None,
) -> None:
    """Refuse a prompt, or a prompt and a requested limit, that the context cannot hold (with
    vLLM's message); a limit the request did not name ends the answer at the context's end
    ("length"), as vLLM's default does."""
    prompt_tokens = len(request.prompt_ids)
    if prompt_tokens >= context:
        raise ContextOverflow(
            f"{prompt_field}: {prompt_tokens} tokens; the model's context is {context} tokens,"
            " and at least one must be left to generate",
            context=context,
            prompt_tokens=prompt_tokens,
            completion_tokens=None,
            param=prompt_field,
        )
    if requested is not None and prompt_tokens + requested > context:
        raise ContextOverflow(
            f"This model's maximum context length is {context} tokens. However, you requested"
            f" {prompt_tokens + requested} tokens ({prompt_tokens} in the messages, {requested}"
            " in the completion). Please reduce the length of the messages or completion.",
            context=context,
            prompt_tokens=prompt_tokens,
            completion_tokens=requested,
            param=limit_name,
        )
    request.max_tokens = min(request.max_tokens, context - prompt_tokens)
