"""The ASGI application over a started GenerationWorker: POST /v1/chat/completions and
/v1/completions (streamed as server-sent events with `stream: true`), GET /v1/models, /health
and /metrics. Importing this module imports starlette: the server imports it when it starts."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from woodcock.serve.openai import STREAM_END, Answer, sse_event
from woodcock.serve.request import (
    DEFAULT_MAX_TOKENS,
    RequestError,
    model_not_found,
    parse_json_body,
    parse_request,
)
from woodcock.serve.worker import GenerationWorker, Job


def create_app(
    worker: GenerationWorker,
    *,
    model_id: str,
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
    description: dict | None = None,
) -> Starlette:
    """The ASGI application over a started worker. description: extra fields for /v1/models
    (the drafter and policy, say)."""
    handlers = _Handlers(worker, model_id, default_max_tokens, description or {})
    routes = [
        Route("/v1/chat/completions", handlers.chat_completions, methods=["POST"]),
        Route("/v1/completions", handlers.completions, methods=["POST"]),
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


class _Handlers:
    """The routes' handlers, over one worker and the model it serves."""

    def __init__(
        self, worker: GenerationWorker, model_id: str, default_max_tokens: int, description: dict
    ):
        self.worker, self.metrics, self.model_id = worker, worker.metrics, model_id
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

    async def chat_completions(self, request):
        return await self._generation(request, "chat.completions")

    async def completions(self, request):
        return await self._generation(request, "completions")

    async def models(self, request):
        return JSONResponse({"object": "list", "data": [self.entry]})

    async def model(self, request):
        name = request.path_params["name"]
        if name != self.model_id:
            return self._error_response(model_not_found(name, self.model_id))
        return JSONResponse(self.entry)

    async def health(self, request):
        worker = self.worker
        busy = worker.running is not None
        return JSONResponse(
            {"status": "ok", "model": self.model_id, "busy": busy, "waiting": worker.waiting}
        )

    async def metrics_text(self, request):
        worker = self.worker
        gauges = {
            "queue_waiting": ("Requests waiting for the model", worker.waiting),
            "queue_size": ("Most requests that may wait (--queue-size)", worker.queue_size),
            "busy": ("1 while a request is generating", int(worker.running is not None)),
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
        return self._error_response(RequestError(message, code=code, status=exc.status_code))

    async def server_error(self, request, exc: Exception):
        self.metrics.add("request_errors", status="500")
        return JSONResponse(_failure_body(exc), status_code=500)

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        yield
        await asyncio.get_running_loop().run_in_executor(None, self.worker.stop)
        self.encoder.shutdown(wait=False)

    def _error_response(self, error: RequestError) -> JSONResponse:
        self.metrics.add("request_errors", status=str(error.status))
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    async def _generation(self, request, endpoint: str):
        loop = asyncio.get_running_loop()
        try:
            body = parse_json_body(await request.body())
            parsed = await loop.run_in_executor(
                self.encoder, parse_request, body, endpoint, self.facts
            )
        except RequestError as e:
            return self._error_response(e)
        job = Job(parsed, loop)
        if not self.worker.submit(job):
            self.metrics.add("queue_rejections")
            return self._error_response(self._queue_full())
        answer = Answer(endpoint, self.model_id)
        if parsed.stream:
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            return StreamingResponse(
                self._stream(job, answer), media_type="text/event-stream", headers=headers
            )
        return await self._complete(request, job, answer)

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

    async def _complete(self, request, job: Job, answer: Answer) -> Response:
        """The whole answer, or 204 when the client goes away first (which frees the model)."""
        watcher = asyncio.ensure_future(_until_disconnected(request.receive))
        getter = asyncio.ensure_future(job.events.get())
        try:
            await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
        if not getter.done():
            getter.cancel()
            self.worker.cancel(job)
            return Response(status_code=204)
        kind, value = getter.result()
        if kind == "error":
            return JSONResponse(_failure_body(value), status_code=500)
        return JSONResponse(answer.complete(value))

    async def _stream(self, job: Job, answer: Answer) -> AsyncIterator[str]:
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
                    yield sse_event(_failure_body(value))
                    break
            finished = True
            yield STREAM_END
        finally:  # also when the client has gone and the response task is cancelled
            if not finished:
                self.worker.cancel(job)


def _failure_body(error: Exception) -> dict:
    """The error object of a generation that raised."""
    detail = str(error).splitlines()[0] if str(error) else ""
    return RequestError(
        f"generation failed: {type(error).__name__}: {detail}", kind="server_error", status=500
    ).body()


async def _until_disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
