"""`woodcock serve`: an OpenAI-compatible HTTP server that generates with speculative decoding.

Endpoints: POST /v1/chat/completions and /v1/completions (streamed as server-sent events with
`stream: true`), GET /v1/models, /health and /metrics (Prometheus text). Every answer's `usage`
adds the speculative loop's statistics to OpenAI's token counts.

One thread owns the model: MLX streams belong to the thread that made them, so the session is
opened in the worker thread and every generation runs there, one request at a time in arrival
order. At most `queue_size` requests wait behind the running one; more are answered 503 with a
Retry-After. A streaming client that goes away cancels its request: the speculative loop checks
between rounds (and prefill chunks), so the model is free again within one round.

Prompt cache: the target's KV cache and the drafter's context rows are kept after a request,
with the tokens they hold. The next prompt keeps the rows of the longest common token prefix
(less one token: an EAGLE-3 context row reads the token after its position, and at least one
prompt token must run for the first logits) and prefills only the rest, as mlx_lm.server does
for the target. Greedy output is the same with and without it.

Request fields are checked before a request is queued: a bad value is a 400 whose error object
names the field (`param`); an unknown `model` is a 404 with code `model_not_found`, as OpenAI
answers it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import queue
import socket
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from woodcock.errors import DrafterError

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
DEFAULT_QUEUE_SIZE = 8
DEFAULT_MAX_TOKENS = 512  # when a request names no limit (as mlx_lm.server)
CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")
ROLES = {"system", "developer", "user", "assistant"}


# -- errors -------------------------------------------------------------------------------------


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


def _json_type(value) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}
    names.update({list: "an array", dict: "an object", type(None): "null"})
    return names.get(type(value), type(value).__name__)


# -- requests -----------------------------------------------------------------------------------


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
            f"{name}: expected {kind}, got {_json_type(value)}", param=name, code="invalid_type"
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
            f"{name}: expected a boolean, got {_json_type(value)}", param=name, code="invalid_type"
        )
    return value


def _refuse_unsupported(body: dict, endpoint: str) -> None:
    """Fields that would change the answer in ways this server does not implement: refused
    rather than ignored. `n` other than 1 is refused with them."""
    off = {
        "logprobs": lambda v: v in (None, False, 0),
        "top_logprobs": lambda v: v in (None, 0),
        "tools": lambda v: not v,
        "functions": lambda v: not v,
        "tool_choice": lambda v: v in (None, "none"),
        "function_call": lambda v: v in (None, "none"),
        "logit_bias": lambda v: not v,
        "presence_penalty": lambda v: v in (None, 0),
        "frequency_penalty": lambda v: v in (None, 0),
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


def _content_text(content, param: str) -> str:
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
                    f"{param}[{i}].text: expected a string, got {_json_type(part.get('text'))}",
                    param=f"{param}[{i}].text",
                    code="invalid_type",
                )
            texts.append(part["text"])
        return "".join(texts)
    raise RequestError(
        f"{param}: expected a string or an array of text parts, got {_json_type(content)}",
        param=param,
        code="invalid_type",
    )


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if messages is None:
        raise RequestError(
            "messages: required", param="messages", code="missing_required_parameter"
        )
    if not isinstance(messages, list) or not messages:
        raise RequestError(
            f"messages: expected a non-empty array, got {_json_type(messages)}"
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
                f"{param}: expected an object, got {_json_type(message)}",
                param=param,
                code="invalid_type",
            )
        role = message.get("role")
        if role not in ROLES:
            raise RequestError(
                f"{param}.role: {role!r}: expected one of {', '.join(sorted(ROLES))}",
                param=f"{param}.role",
                code="invalid_value",
            )
        if message.get("tool_calls"):
            raise RequestError(
                f"{param}.tool_calls: not supported by this server",
                param=f"{param}.tool_calls",
                code="unsupported_parameter",
            )
        text = _content_text(message.get("content"), f"{param}.content")
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
    elif isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        bad = [t for t in prompt if not 0 <= t < facts.vocab_size]
        if bad:
            raise RequestError(
                f"prompt: token id {bad[0]}: expected ids in [0, {facts.vocab_size})",
                param="prompt",
                code="invalid_value",
            )
        ids = list(prompt)
    else:
        raise RequestError(
            "prompt: expected a string, an array of token ids or an array of one of them, got"
            f" {_json_type(prompt)}",
            param="prompt",
            code="invalid_type",
        )
    if not ids:
        raise RequestError("prompt: empty", param="prompt", code="invalid_value")
    return ids


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise RequestError(
            f"stop: expected a string or an array of strings, got {_json_type(stop)}",
            param="stop",
            code="invalid_type",
        )
    if any(not s for s in stops):
        raise RequestError("stop: empty stop strings", param="stop", code="invalid_value")
    return tuple(stops)


def parse_request(body: dict, endpoint: str, facts: ModelFacts) -> GenerationRequest:
    """Check a request body and encode its prompt; RequestError names the first bad field."""
    model = body.get("model")
    if model is not None:
        if not isinstance(model, str):
            raise RequestError(
                f"model: expected a string, got {_json_type(model)}",
                param="model",
                code="invalid_type",
            )
        if model != facts.model_id:
            raise RequestError(
                f"The model {model!r} does not exist: this server serves {facts.model_id!r}",
                param="model",
                code="model_not_found",
                status=404,
            )
    _refuse_unsupported(body, endpoint)
    stream = _boolean(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise RequestError(
            f"stream_options: expected an object, got {_json_type(options)}",
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
        stop=_stop(body),
        seed=_number(body, "seed", None, integer=True),
        stream=stream,
        include_usage=include_usage,
    )
    if endpoint == "chat.completions":
        prompt_field = "messages"
        conversation = _messages(body)
        if not facts.tokenizer.has_chat_template:
            raise RequestError(
                "messages: the target has no chat template; send the text to /v1/completions",
                param="messages",
                code="invalid_value",
            )
        from jinja2 import TemplateError

        from woodcock.runtime.generate import encode_messages

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
    context = facts.context_length
    if context is not None:
        if len(request.prompt_ids) >= context:
            raise RequestError(
                f"{prompt_field}: {len(request.prompt_ids)} tokens; the model's context is"
                f" {context} tokens, and at least one must be left to generate",
                param=prompt_field,
                code="context_length_exceeded",
            )
        # the answer ends at the context's end ("length"), as plain decoding would have to
        request.max_tokens = min(request.max_tokens, context - len(request.prompt_ids))
    return request


# -- generation ---------------------------------------------------------------------------------


class _PrefillCancelled(Exception):
    pass


class Engine:
    """Runs generations on a session, one at a time, in the thread that opened the session, and
    remembers which tokens its caches hold for the next prompt."""

    def __init__(self, session, policy: str | None, *, prefix_cache: bool = True):
        """policy: as `woodcock generate --policy` takes it, with a latency file where the
        policy needs one; None decodes plainly with mlx-lm (the session's drafter is unused)."""
        from woodcock.runtime.policy import parse_policy

        self.session, self.policy, self.prefix_cache = session, policy, prefix_cache
        self.cached_tokens: list[int] = []  # the tokens whose rows both caches hold, in order
        # one policy object for the server's life, as `woodcock bench` keeps one across its
        # prompts: an adaptive policy's acceptance estimates go on learning from every request
        # (a fresh one would start from the prior at every request)
        self._policy = None
        if policy is not None:
            self._policy = parse_policy(
                policy, session.drafter, prior=session.holdout_agreement, head=session.head_label
            )

    def facts(self, model_id: str, default_max_tokens: int = DEFAULT_MAX_TOKENS) -> ModelFacts:
        args = getattr(self.session.model, "args", None)
        context = next(
            (getattr(args, name) for name in CONTEXT_FIELDS if getattr(args, name, None)), None
        )
        return ModelFacts(
            model_id,
            self.session.tokenizer,
            self.session.target.vocab_size,
            int(context) if context else None,
            default_max_tokens,
        )

    def reusable(self, prompt_ids: list[int]) -> int:
        """Prompt tokens whose cached rows the next generation keeps: the longest prefix shared
        with the cached tokens, less one (the drafter's row for the last of them reads the token
        after it), and never the whole prompt (its last token must run for the first logits)."""
        if not self.prefix_cache:
            return 0
        common = 0
        for cached, token in zip(self.cached_tokens, prompt_ids, strict=False):
            if cached != token:
                break
            common += 1
        return max(0, min(common - 1, len(prompt_ids) - 1))

    def run(
        self,
        request: GenerationRequest,
        *,
        on_text: Callable[[str], None] | None = None,
        cancelled: Callable[[], bool] | None = None,
    ):
        import mlx.core as mx

        from woodcock.runtime.generate import generate
        from woodcock.runtime.sampling import Sampling

        if request.seed is not None:
            mx.random.seed(request.seed)
        ids, cached = request.prompt_ids, self.reusable(request.prompt_ids)
        self.cached_tokens = []  # until this generation says what the caches hold
        if self.policy is None:
            result = self._run_plain(request, cached, on_text, cancelled)
        else:
            sampling = Sampling(request.temperature, request.top_p, request.top_k, request.min_p)
            result = generate(
                self.session,
                ids,
                max_tokens=request.max_tokens,
                policy=self._policy,
                sampling=sampling,
                stop=request.stop,
                on_text=on_text,
                cached=cached,
                cancelled=cancelled,
            )
        # the caches hold the first `offset` tokens of the prompt and the stream; the stream
        # may have run past what was kept (a round's drafts after a stop), hence the minimum
        self.cached_tokens = (ids + result.tokens)[: self.session.target.offset]
        return result

    def _run_plain(self, request, cached, on_text, cancelled):
        """mlx-lm's own decoding loop on the target's cache: the baseline the drafter is
        measured against, with the same prompt cache, stop rules and cancellation."""
        import mlx.core as mx
        from mlx_lm.generate import generate_step
        from mlx_lm.sample_utils import make_sampler

        from woodcock.runtime.decode import Stats
        from woodcock.runtime.generate import timed_text

        target, ids = self.session.target, request.prompt_ids
        if not (cached and target.truncate(cached)):
            cached = 0
            target.reset()

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
            prompt_cache=target.cache,
            prompt_progress_callback=check,
        )

        def tokens():
            try:
                for token, _ in steps:
                    yield token
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
        )
        result.stats = Stats(prompt_tokens=len(ids), cached_tokens=cached)
        return result


@dataclass
class Job:
    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    state: str = "queued"  # queued, running, cancelled (before it ran) or done

    def emit(self, kind: str, value) -> None:
        """From the worker thread: ("text", str), ("done", Generation) or ("error", Exception)."""
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is listening
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))


class Metrics:
    """Counters since start-up, rendered in the Prometheus text format."""

    COUNTERS = {
        "requests": "Generation requests answered, by endpoint",
        "request_errors": "Requests refused or failed, by HTTP status",
        "queue_rejections": "Requests refused with 503 because the queue was full",
        "cancelled_requests": "Requests whose client went away before the answer was complete",
        "cancelled_completion_tokens": "Tokens generated for requests cancelled while running",
        "prompt_tokens": "Prompt tokens of answered requests",
        "cached_prompt_tokens": "Prompt tokens whose cached rows were reused, not prefilled",
        "completion_tokens": "Tokens generated",
        "drafted_tokens": "Tokens proposed for verification (drafter and prompt lookup)",
        "accepted_tokens": "Proposed tokens the target accepted",
        "rounds": "Speculative rounds (one target forward each)",
        "prompt_seconds": "Time to the first token, summed",
        "generation_seconds": "Time from the first token to the last, summed",
    }

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[tuple[str, tuple], float] = {}

    def add(self, name: str, value: float = 1, **labels: str) -> None:
        key = (name, tuple(sorted(labels.items())))
        with self._lock:
            self._values[key] = self._values.get(key, 0) + value

    def record(self, endpoint: str, result) -> None:
        stats = result.stats
        self.add("requests", endpoint=endpoint)
        self.add("prompt_tokens", result.prompt_tokens)
        self.add("cached_prompt_tokens", stats.cached_tokens)
        self.add("completion_tokens", len(result.tokens))
        self.add("drafted_tokens", sum(stats.drafted))
        self.add("accepted_tokens", sum(stats.accepted))
        self.add("rounds", stats.rounds)
        self.add("prompt_seconds", result.prompt_seconds)
        self.add("generation_seconds", result.generation_seconds)

    def render(self, gauges: dict[str, tuple[str, float]]) -> str:
        with self._lock:
            values = dict(self._values)
        lines = []
        for name, help_text in self.COUNTERS.items():
            lines += [
                f"# HELP woodcock_{name}_total {help_text}.",
                f"# TYPE woodcock_{name}_total counter",
            ]
            samples = [(labels, v) for (n, labels), v in values.items() if n == name] or [((), 0)]
            for labels, value in sorted(samples):
                label_text = ",".join(f'{k}="{v}"' for k, v in labels)
                lines.append(
                    f"woodcock_{name}_total{{{label_text}}} {value:g}"
                    if label_text
                    else f"woodcock_{name}_total {value:g}"
                )
        for name, (help_text, value) in gauges.items():
            lines += [f"# HELP woodcock_{name} {help_text}.", f"# TYPE woodcock_{name} gauge"]
            lines.append(f"woodcock_{name} {value:g}")
        return "\n".join(lines) + "\n"


class GenerationWorker:
    """The one thread that touches MLX: it opens the engine with `load`, then runs the queued
    jobs in arrival order. At most `queue_size` jobs wait behind the running one."""

    def __init__(self, load: Callable[[], Engine], *, queue_size: int = DEFAULT_QUEUE_SIZE):
        if queue_size < 1:
            raise DrafterError(f"--queue-size {queue_size}: expected at least 1")
        self.queue_size = queue_size
        self.metrics = Metrics()
        self.engine: Engine | None = None
        self.waiting = 0
        self.running: Job | None = None
        self.service_seconds = 0.0  # moving average of a request's time in the worker
        self._load = load
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._main, name="woodcock-generation", daemon=True)

    def start(self) -> Engine:
        """Open the engine in the worker thread; its errors (a bad path, policy...) raise here."""
        self._thread.start()
        self._ready.wait()
        if self._load_error is not None:
            raise self._load_error
        return self.engine

    def submit(self, job: Job) -> bool:
        """Queue a job; False when `queue_size` jobs are waiting already."""
        with self._lock:
            if self.waiting >= self.queue_size:
                return False
            self.waiting += 1
        self._jobs.put(job)
        return True

    def cancel(self, job: Job) -> None:
        """The client went away: a waiting job is dropped, a running one stops within a round."""
        with self._lock:
            if job.state == "queued":
                job.state = "cancelled"
                self.waiting -= 1
            elif job.state != "running":
                return
        job.cancelled.set()
        self.metrics.add("cancelled_requests")

    def retry_after(self) -> int:
        """Seconds until a slot is likely free: the running request and those waiting."""
        return max(1, math.ceil(self.service_seconds * (self.waiting + 1)))

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel the running job, drop the waiting ones and end the thread."""
        with self._lock:
            self._stopping = True
            running = self.running
        if running is not None:
            running.cancelled.set()
        self._jobs.put(None)
        self._thread.join(timeout)

    def _main(self) -> None:
        try:
            self.engine = self._load()
        except BaseException as e:  # handed to start(), in the main thread
            self._load_error = e
            self._ready.set()
            return
        self._ready.set()
        while (job := self._jobs.get()) is not None:
            with self._lock:
                if job.state == "cancelled" or self._stopping:
                    continue
                job.state, self.running = "running", job
                self.waiting -= 1
            started = time.perf_counter()
            try:
                on_text = (lambda text: job.emit("text", text)) if job.request.stream else None
                result = self.engine.run(
                    job.request, on_text=on_text, cancelled=job.cancelled.is_set
                )
                if job.cancelled.is_set():  # what was generated for nobody
                    self.metrics.add("cancelled_completion_tokens", len(result.tokens))
                else:
                    self.metrics.record(job.request.endpoint, result)
                job.emit("done", result)
            except Exception as e:
                self.engine.cached_tokens = []
                self.metrics.add("request_errors", status="500")
                job.emit("error", e)
            finally:
                seconds = time.perf_counter() - started
                self.service_seconds = (
                    seconds
                    if not self.service_seconds
                    else 0.7 * self.service_seconds + 0.3 * seconds
                )
                with self._lock:
                    job.state, self.running = "done", None


# -- responses ----------------------------------------------------------------------------------


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
class _Answer:
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
        return _event(self._object(kind, [choice], **extra))

    def role_chunk(self, **extra) -> str:
        delta = {"role": "assistant", "content": ""}
        choice = {"index": 0, "delta": delta, "finish_reason": None}
        return _event(self._object("chat.completion.chunk", [choice], **extra))

    def usage_chunk(self, result) -> str:
        kind = "chat.completion.chunk" if self.endpoint == "chat.completions" else "text_completion"
        return _event(self._object(kind, [], usage=usage(result)))


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _no_constants(name: str):
    raise ValueError(f"{name} is not JSON")


async def _json_body(request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw, parse_constant=_no_constants)
    except (ValueError, UnicodeDecodeError) as e:
        raise RequestError(f"the body is not valid JSON ({e})", code="invalid_json") from None
    if not isinstance(body, dict):
        raise RequestError(
            f"the body must be a JSON object, got {_json_type(body)}", code="invalid_json"
        )
    return body


async def _until_disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def create_app(
    worker: GenerationWorker,
    *,
    model_id: str,
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
    description: dict | None = None,
):
    """The ASGI application over a started worker. description: extra fields for /v1/models
    (the drafter and policy, say)."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.routing import Route

    engine = worker.engine
    facts = engine.facts(model_id, default_max_tokens)
    metrics = worker.metrics
    # encoding runs off the event loop, one prompt at a time (a fast tokenizer object must not
    # be used by two threads at once)
    encoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="woodcock-encode")
    started = int(time.time())

    def error_response(error: RequestError) -> JSONResponse:
        metrics.add("request_errors", status=str(error.status))
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    async def generation(request, endpoint: str):
        try:
            body = await _json_body(request)
            loop = asyncio.get_running_loop()
            parsed = await loop.run_in_executor(encoder, parse_request, body, endpoint, facts)
        except RequestError as e:
            return error_response(e)
        job = Job(parsed, asyncio.get_running_loop())
        if not worker.submit(job):
            metrics.add("queue_rejections")
            waiting = worker.queue_size
            return error_response(
                RequestError(
                    f"the server is busy: {waiting} requests are waiting already (--queue-size"
                    f" {waiting}); retry later",
                    code="queue_full",
                    status=503,
                    kind="server_error",
                    headers={"Retry-After": str(worker.retry_after())},
                )
            )
        answer = _Answer(endpoint, model_id)
        if parsed.stream:
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            return StreamingResponse(
                stream(job, answer), media_type="text/event-stream", headers=headers
            )
        watcher = asyncio.ensure_future(_until_disconnected(request.receive))
        getter = asyncio.ensure_future(job.events.get())
        try:
            await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
        if not getter.done():  # the client went away: free the model
            getter.cancel()
            worker.cancel(job)
            return Response(status_code=204)
        kind, value = getter.result()
        if kind == "error":
            return internal_error(value)
        return JSONResponse(answer.complete(value))

    async def stream(job: Job, answer: _Answer) -> AsyncIterator[str]:
        extra = {"usage": None} if job.request.include_usage else {}
        finished = False
        try:
            if answer.endpoint == "chat.completions":
                yield answer.role_chunk(**extra)
            while True:
                kind, value = await job.events.get()
                if kind == "text":
                    yield answer.chunk(value, **extra)
                elif kind == "done":
                    yield answer.chunk(None, value.finish_reason, **extra)
                    if job.request.include_usage:
                        yield answer.usage_chunk(value)
                    break
                else:
                    yield _event(_internal_error_body(value))
                    break
            finished = True
            yield "data: [DONE]\n\n"
        finally:  # also when the client has gone and the response task is cancelled
            if not finished:
                worker.cancel(job)

    def _internal_error_body(error: Exception) -> dict:
        detail = str(error).splitlines()[0] if str(error) else ""
        return RequestError(
            f"generation failed: {type(error).__name__}: {detail}", kind="server_error", status=500
        ).body()

    def internal_error(error: Exception) -> JSONResponse:
        return JSONResponse(_internal_error_body(error), status_code=500)

    async def chat_completions(request):
        return await generation(request, "chat.completions")

    async def completions(request):
        return await generation(request, "completions")

    entry = {"id": model_id, "object": "model", "created": started, "owned_by": "woodcock"}
    entry.update(description or {})

    async def models(request):
        return JSONResponse({"object": "list", "data": [entry]})

    async def model(request):
        if request.path_params["name"] != model_id:
            name = request.path_params["name"]
            return error_response(
                RequestError(
                    f"The model {name!r} does not exist: this server serves {model_id!r}",
                    param="model",
                    code="model_not_found",
                    status=404,
                )
            )
        return JSONResponse(entry)

    async def health(request):
        return JSONResponse(
            {
                "status": "ok",
                "model": model_id,
                "busy": worker.running is not None,
                "waiting": worker.waiting,
            }
        )

    async def metrics_text(request):
        gauges = {
            "queue_waiting": ("Requests waiting for the model", worker.waiting),
            "queue_size": ("Most requests that may wait (--queue-size)", worker.queue_size),
            "busy": ("1 while a request is generating", int(worker.running is not None)),
        }
        return PlainTextResponse(
            metrics.render(gauges), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    async def http_error(request, exc: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = (
            f"no route {request.method} {request.url.path}"
            if exc.status_code in (404, 405)
            else str(exc.detail)
        )
        return error_response(RequestError(message, code=code, status=exc.status_code))

    async def server_error(request, exc: Exception):
        metrics.add("request_errors", status="500")
        return internal_error(exc)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.get_running_loop().run_in_executor(None, worker.stop)
        encoder.shutdown(wait=False)

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{name:path}", model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics_text, methods=["GET"]),
    ]
    return Starlette(
        routes=routes,
        exception_handlers={HTTPException: http_error, Exception: server_error},
        lifespan=lifespan,
    )


# -- start-up -----------------------------------------------------------------------------------


def resolve_served_pair(
    target: str | None, drafter: str | None, *, plain: bool
) -> tuple[str, str | None, str]:
    """(target source, drafter or None for plain decoding, model id): the default target and
    its shipped drafter where neither is named, as `woodcock generate` resolves them."""
    from woodcock.default_target import DEFAULT_TARGET, resolve_pair, resolve_target

    model_id = DEFAULT_TARGET if target in (None, DEFAULT_TARGET) else target
    if plain:
        if drafter is not None:
            raise DrafterError("--no-drafter decodes plainly: give it or --drafter, not both")
        return resolve_target(target), None, model_id
    return (*resolve_pair(target, drafter), model_id)


def open_engine(
    target: str,
    drafter: str | None,
    policy: str,
    *,
    dtype: str | None = None,
    lookup: bool = True,
    prefix_cache: bool = True,
) -> Engine:
    """Open the session (in the calling thread, which must be the one that generates) and the
    policy: `auto` / `confidence` without a file use this machine's cached latency profile for
    the pair, measured now, once, if there is none."""
    from woodcock.runtime.session import open_session

    if drafter is None:
        # plain decoding needs only the target: the weight-free n-gram drafter opens it alone
        session = open_session(target, "ngram", dtype=dtype, lookup=False)
        return Engine(session, None, prefix_cache=prefix_cache)
    session = open_session(target, drafter, dtype=dtype, lookup=lookup)
    if policy in ("auto", "confidence"):
        from woodcock.runtime.latency import cached_profile

        def announce(done: int, total: int) -> None:  # called only while measuring
            if done == 1:
                print(
                    f"woodcock: measuring this machine's latency for --policy {policy} (once)",
                    file=sys.stderr,
                    flush=True,
                )

        policy = f"{policy}:{cached_profile(session, target, drafter, progress=announce)}"
    return Engine(session, policy, prefix_cache=prefix_cache)


def _listening_socket(host: str, port: int) -> socket.socket:
    if not 0 <= port <= 65535:
        raise DrafterError(f"--port {port}: expected a port in [0, 65535]")
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        # listening from now: a client that connects before the server is up waits in the
        # backlog instead of being refused
        sock.listen(2048)
    except OSError as e:
        raise DrafterError(f"--host {host} --port {port}: cannot listen there ({e})") from None
    return sock


def serve(
    target: str | None = None,
    drafter: str | None = None,
    policy: str = "auto",
    *,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    queue_size: int = DEFAULT_QUEUE_SIZE,
    prefix_cache: bool = True,
    lookup: bool = True,
    dtype: str | None = None,
    plain: bool = False,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    log_level: str = "info",
) -> None:
    """Open the pair and serve it until interrupted. Errors in what was asked for (paths, the
    policy, the address) raise DrafterError before the server listens. plain: decode with
    mlx-lm alone (no drafter), the baseline for measuring one."""
    import uvicorn

    if queue_size < 1:
        raise DrafterError(f"--queue-size {queue_size}: expected at least 1")
    if max_tokens < 1:
        raise DrafterError(f"--max-tokens {max_tokens}: expected at least 1")
    source, drafter, model_id = resolve_served_pair(target, drafter, plain=plain)
    sock = _listening_socket(host, port)
    worker = GenerationWorker(
        lambda: open_engine(
            source, drafter, policy, dtype=dtype, lookup=lookup, prefix_cache=prefix_cache
        ),
        queue_size=queue_size,
    )
    try:
        engine = worker.start()
    except BaseException:
        sock.close()
        raise
    from woodcock.runtime.machine import machine_facts, warn_slow_paths

    warn_slow_paths(machine_facts(engine.session.dtype_name))
    description = {
        "drafter": drafter,
        "policy": engine.policy or "plain (mlx-lm, no drafter)",
        "prompt_lookup": engine.session.lookup is not None,
        "prefix_cache": prefix_cache,
    }
    app = create_app(
        worker, model_id=model_id, default_max_tokens=max_tokens, description=description
    )
    address = sock.getsockname()
    print(
        f"woodcock: serving {model_id} at http://{host}:{address[1]}/v1"
        f" ({'plain decoding' if plain else f'drafter {drafter}, policy {engine.policy}'})",
        file=sys.stderr,
        flush=True,
    )
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5)
    uvicorn.Server(config).run(sockets=[sock])
