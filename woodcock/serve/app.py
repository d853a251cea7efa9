"""The ASGI application over a started GenerationWorker: POST /v1/chat/completions and
/v1/completions (streamed as server-sent events with `stream: true`), Anthropic's POST
/v1/messages and /v1/messages/count_tokens, GET /v1/models, /health and /metrics. Importing this
module imports starlette: the server imports it when it starts."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from woodcock.serve import anthropic
from woodcock.serve.openai import STREAM_END, Answer, sse_event
from woodcock.serve.request import (
    DEFAULT_MAX_TOKENS,
    GenerationRequest,
    ModelFacts,
    RequestError,
    model_not_found,
    parse_json_body,
    parse_request,
)
from woodcock.serve.worker import GenerationWorker, Job, shutting_down_error

ENDPOINTS = ("chat.completions", "completions")


def create_app(
    worker: GenerationWorker,
    *,
    model_id: str,
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
    description: dict | None = None,
    request_timeout: float | None = None,
) -> Starlette:
    """The ASGI application over a started worker. description: extra fields for /v1/models
    (the drafter and policy, say). request_timeout: seconds from a request's arrival (queue
    wait included) after which it is cancelled: answered 504 `timeout`, or, streamed, ended
    with an error event; None: no limit."""
    handlers = _Handlers(worker, model_id, default_max_tokens, description or {}, request_timeout)
    routes = [
        Route("/v1/chat/completions", handlers.chat_completions, methods=["POST"]),
        Route("/v1/completions", handlers.completions, methods=["POST"]),
        Route("/v1/messages", handlers.messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", handlers.count_tokens, methods=["POST"]),
        Route("/v1/models", handlers.models, methods=["GET"]),
        Route("/v1/models/{name:path}", handlers.model, methods=["GET"]),
        Route("/health", handlers.health, methods=["GET"]),
        Route("/metrics", handlers.metrics_text, methods=["GET"]),
    ]
    return Starlette(
        routes=routes,
        exception_handlers={HTTPException: handlers.http_error, Exception: handlers.server_error},
        lifespan=handlers.lifespan,
    )


def _openai_error(error: RequestError) -> tuple[dict, int]:
    return error.body(), error.status


class _OpenAIAnswer:
    """OpenAI's shapes of one answer: whole, or as the stream's chunks."""

    def __init__(self, answer: Answer, include_usage: bool):
        self.answer, self.include_usage = answer, include_usage
        self.extra = {"usage": None} if include_usage else {}

    def complete(self, result) -> dict:
        return self.answer.complete(result)

    def opening(self, cached_tokens: int) -> str:
        chat = self.answer.endpoint == "chat.completions"
        return self.answer.role_chunk(**self.extra) if chat else ""

    def text(self, text: str) -> str:
        return self.answer.chunk(text, **self.extra)

    def done(self, result) -> str:
        last = self.answer.chunk(None, result.finish_reason, **self.extra)
        return last + (self.answer.usage_chunk(result) if self.include_usage else "")

    def failure(self, error: RequestError) -> str:
        return sse_event(error.body())

    def closing(self) -> str:
        return STREAM_END


@dataclass(frozen=True)
class _Api:
    """How one API parses a request, shapes its answer (`_OpenAIAnswer`'s methods) and its
    errors (body and status)."""

    parse: Callable[[dict, ModelFacts], GenerationRequest]
    answer: Callable[[GenerationRequest], object]
    error_body: Callable[[RequestError], tuple[dict, int]]


class _Handlers:
    """The routes' handlers, over one worker and the model it serves."""

    def __init__(
        self,
        worker: GenerationWorker,
        model_id: str,
        default_max_tokens: int,
        description: dict,
        request_timeout: float | None = None,
    ):
        self.worker, self.metrics, self.model_id = worker, worker.metrics, model_id
        self.request_timeout = request_timeout
        self.facts = worker.engine.facts(model_id, default_max_tokens)
        # encoding runs off the event loop, one prompt at a time (a fast tokenizer object must
        # not be used by two threads at once)
        self.encoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="woodcock-encode")
        self.entry = {
            "id": model_id,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "woodcock",
            **description,
        }
        self.openai = {endpoint: self._openai(endpoint) for endpoint in ENDPOINTS}
        self.anthropic = _Api(
            anthropic.parse_messages,
            lambda parsed: anthropic.MessageAnswer(model_id, parsed),
            anthropic.error_body,
        )

    def _openai(self, endpoint: str) -> _Api:
        return _Api(
            lambda body, facts: parse_request(body, endpoint, facts),
            lambda parsed: _OpenAIAnswer(Answer(endpoint, self.model_id), parsed.include_usage),
            _openai_error,
        )

    async def chat_completions(self, request):
        return await self._generation(request, self.openai["chat.completions"])

    async def completions(self, request):
        return await self._generation(request, self.openai["completions"])

    async def messages(self, request):
        return await self._generation(request, self.anthropic)

    async def count_tokens(self, request):
        loop = asyncio.get_running_loop()
        try:
            body = await self._body(request)
            count = await loop.run_in_executor(
                self.encoder, anthropic.count_input_tokens, body, self.facts
            )
        except ClientDisconnect:  # gone before its body was whole: nobody to answer
            return Response(status_code=204)
        except RequestError as e:
            return self._error_response(e, self.anthropic)
        return JSONResponse({"input_tokens": count})

    async def models(self, request):
        return JSONResponse({"object": "list", "data": [self.entry]})

    async def model(self, request):
        name = request.path_params["name"]
        if name != self.model_id:
            return self._error_response(model_not_found(name, self.model_id))
        return JSONResponse(self.entry)

    async def health(self, request):
        worker = self.worker
        busy = bool(worker.running)
        return JSONResponse(
            {"status": "ok", "model": self.model_id, "busy": busy, "waiting": worker.waiting}
        )

    async def metrics_text(self, request):
        worker = self.worker
        running = len(worker.running)
        gauges = {
            "queue_waiting": ("Requests waiting for the model", worker.waiting),
            "queue_size": ("Most requests that may wait (--queue-size)", worker.queue_size),
            "busy": ("1 while a request is generating", int(running > 0)),
            "running_requests": ("Requests generating now", running),
            "max_batch_size": ("Most requests that generate at once", worker.max_batch),
            "batch_occupancy": (
                "Running requests over the most that may run",
                running / worker.max_batch,
            ),
        }
        if (pool := worker.engine.pool) is not None:
            gauges |= {
                "prefix_cache_entries": ("Conversations in the prefix pool", len(pool.entries)),
                "prefix_cache_bytes": ("Bytes of KV rows in the prefix pool", pool.nbytes),
                "prefix_cache_limit_bytes": (
                    "The pool's limit (--prefix-cache-gb)",
                    pool.limit_bytes,
                ),
            }
        return PlainTextResponse(
            self.metrics.render(gauges), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    async def http_error(self, request, exc: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = (
            f"no route {request.method} {request.url.path}"
            if exc.status_code in (404, 405)
            else str(exc.detail)
        )
        error = RequestError(message, code=code, status=exc.status_code)
        return self._error_response(error, self._api_of(request))

    async def server_error(self, request, exc: Exception):
        return self._error_response(_failure(exc), self._api_of(request))

    def _api_of(self, request) -> _Api:
        """Whose error shape a request that reached no handler gets: the path's API's."""
        anthropic_path = request.url.path.startswith("/v1/messages")
        return self.anthropic if anthropic_path else self.openai["chat.completions"]

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        yield
        await asyncio.get_running_loop().run_in_executor(None, self.worker.stop)
        self.encoder.shutdown(wait=False)

    def _error_response(self, error: RequestError, api: _Api | None = None) -> JSONResponse:
        body, status = (api or self.openai["chat.completions"]).error_body(error)
        self.metrics.add("request_errors", status=str(status))
        return JSONResponse(body, status_code=status, headers=error.headers)

    async def _generation(self, request, api: _Api):
        loop = asyncio.get_running_loop()
        try:
            body = await self._body(request)
            parsed = await loop.run_in_executor(self.encoder, api.parse, body, self.facts)
        except ClientDisconnect:  # gone before its body was whole: nobody to answer
            return Response(status_code=204)
        except RequestError as e:
            return self._error_response(e, api)
        job = Job(parsed, loop)
        if not self.worker.submit(job):
            if self.worker.shutting_down:
                return self._error_response(shutting_down_error(), api)
            self.metrics.add("queue_rejections")
            return self._error_response(self._queue_full(), api)
        answer = api.answer(parsed)
        if parsed.stream:
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            return StreamingResponse(
                self._stream(job, answer), media_type="text/event-stream", headers=headers
            )
        return await self._complete(request, job, answer, api)

    async def _body(self, request) -> dict:
        """The request's JSON body, read within --request-timeout: a client that never finishes
        sending it would hold its connection and task for as long as it likes."""
        try:
            raw = await asyncio.wait_for(request.body(), self.request_timeout)
        except TimeoutError:
            raise RequestError(
                f"the request body did not arrive within --request-timeout"
                f" {self.request_timeout:g} seconds",
                code="timeout",
                status=408,
                kind="timeout_error",
            ) from None
        return parse_json_body(raw)

    def _queue_full(self) -> RequestError:
        waiting = self.worker.queue_size
        return RequestError(
            f"the server is busy: {waiting} requests are waiting already (--queue-size"
            f" {waiting}); retry later",
            code="queue_full",
            status=503,
            kind="server_error",
            headers={"Retry-After": str(self.worker.retry_after())},
        )

    def _time_left(self, job: Job) -> float | None:
        """Seconds until the job's timeout (None: no limit)."""
        if self.request_timeout is None:
            return None
        return max(0.0, job.arrived + self.request_timeout - time.monotonic())

    def _timed_out(self) -> RequestError:
        return RequestError(
            f"the request ran past --request-timeout {self.request_timeout:g} seconds (queue"
            " wait included) and was cancelled",
            code="timeout",
            status=504,
            kind="timeout_error",
        )

    async def _complete(self, request, job: Job, answer, api: _Api) -> Response:
        """The whole answer, or 204 when the client goes away first (which frees the model)."""
        watcher = asyncio.ensure_future(_until_disconnected(request.receive))
        getter = asyncio.ensure_future(job.events.get())
        try:
            await asyncio.wait(
                {getter, watcher}, timeout=self._time_left(job), return_when=asyncio.FIRST_COMPLETED
            )
            disconnected = watcher.done()
        finally:
            watcher.cancel()
        if not getter.done():
            getter.cancel()
            if disconnected:
                self.worker.cancel(job)
                return Response(status_code=204)
            self.worker.cancel(job, timed_out=True)
            return self._error_response(self._timed_out(), api)
        kind, value = getter.result()
        if kind == "error":
            if isinstance(value, RequestError):  # the worker's refusal (it is shutting down)
                return self._error_response(value, api)
            body, status = api.error_body(_failure(value))
            return JSONResponse(body, status_code=status)
        return JSONResponse(answer.complete(value))

    async def _stream(self, job: Job, answer) -> AsyncIterator[str]:
        """The answer's events as the worker reports them (answer: `_OpenAIAnswer`'s methods)."""
        finished = False
        try:
            while True:
                try:
                    kind, value = await asyncio.wait_for(job.events.get(), self._time_left(job))
                except TimeoutError:
                    finished = True
                    self.worker.cancel(job, timed_out=True)
                    self.metrics.add("request_errors", status="504")
                    yield answer.failure(self._timed_out())
                    break
                if kind == "start":  # the worker took the job: the prompt's cached tokens
                    if opening := answer.opening(value):
                        yield opening
                elif kind == "text":
                    yield answer.text(value)
                elif kind == "done":
                    yield answer.done(value)
                    break
                elif isinstance(value, RequestError):  # the worker's refusal (it is shutting down)
                    self.metrics.add("request_errors", status=str(value.status))
                    yield answer.failure(value)
                    break
                else:
                    yield answer.failure(_failure(value))
                    break
            finished = True
            if closing := answer.closing():
                yield closing
        finally:  # also when the client has gone and the response task is cancelled
            if not finished:
                self.worker.cancel(job)


def _failure(error: Exception) -> RequestError:
    """The error of a generation that raised."""
    detail = str(error).splitlines()[0] if str(error) else ""
    return RequestError(
        f"generation failed: {type(error).__name__}: {detail}", kind="server_error", status=500
    )


async def _until_disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
