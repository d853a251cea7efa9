"""The one thread that owns the model, and the jobs it runs.

MLX streams belong to the thread that made them, so the session is opened in the worker thread
and every generation runs there, in arrival order: one request at a time, or up to `max_batch`
decoding together (woodcock.serve.batching), a waiting request joining as soon as one leaves.
At most `queue_size` requests wait behind the running ones; more are answered 503 with a
Retry-After. A streaming client that goes away cancels its request, and so does a request's
timeout: the speculative loop checks between rounds (and prefill chunks), so its slot is free
again within one round. When the server is told to stop, the waiting requests end at once with
a 503 and the running ones get a few seconds to finish before they end with it too.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from woodcock.errors import DrafterError
from woodcock.serve.batching import Batcher
from woodcock.serve.engine import Engine
from woodcock.serve.metrics import Metrics
from woodcock.serve.request import GenerationRequest, RequestError

DEFAULT_QUEUE_SIZE = 8
DEFAULT_MAX_BATCH = 1  # requests generating at once


@dataclass
class Job:
    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    state: str = "queued"  # queued, running, cancelled (before it ran) or done
    arrived: float = field(default_factory=time.monotonic)
    cut_by_shutdown: bool = False  # ended by the server's shutdown: answered 503, not "done"

    def emit(self, kind: str, value) -> None:
        """From the worker thread: ("start", the prompt tokens whose cached rows it reuses;
        streamed requests only), ("text", str), ("done", Generation) or ("error", Exception)."""
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is listening
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))


class GenerationWorker:
    """The one thread that touches MLX: it opens the engine with `load`, then runs the queued
    jobs in arrival order, up to `max_batch` at once. At most `queue_size` jobs wait behind the
    running ones."""

    def __init__(
        self,
        load: Callable[[], Engine],
        *,
        queue_size: int = DEFAULT_QUEUE_SIZE,
        max_batch: int = DEFAULT_MAX_BATCH,
    ):
        if queue_size < 1:
            raise DrafterError(f"--queue-size {queue_size}: expected at least 1")
        if max_batch < 1:
            raise DrafterError(f"--max-batch {max_batch}: expected at least 1")
        self.queue_size, self.max_batch = queue_size, max_batch
        self.metrics = Metrics()
        self.engine: Engine | None = None
        self.waiting = 0
        self.running: list[Job] = []
        self.service_seconds = 0.0  # moving average of a request's time in the worker
        self._load = load
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._stopping = False
        self.shutting_down = False
        self._thread = threading.Thread(target=self._main, name="woodcock-generation", daemon=True)

    def start(self) -> Engine:
        """Open the engine in the worker thread; its errors (a bad path, policy, a model that
        cannot batch...) raise here."""
        self._thread.start()
        self._ready.wait()
        if self._load_error is not None:
            raise self._load_error
        return self.engine

    def submit(self, job: Job) -> bool:
        """Queue a job; False when `queue_size` jobs are waiting already beyond those the free
        slots will take (they are queued too until the worker reaches them), or the server is
        shutting down."""
        with self._lock:
            if self.shutting_down:
                return False
            free_slots = max(0, self.max_batch - len(self.running))
            if self.waiting >= self.queue_size + free_slots:
                return False
            self.waiting += 1
        self._jobs.put(job)
        return True

    def cancel(self, job: Job, *, timed_out: bool = False) -> None:
        """The client went away (or the request's time ran out): a waiting job is dropped, a
        running one stops within a round."""
        with self._lock:
            if job.state == "queued":
                job.state = "cancelled"
                self.waiting -= 1
            elif job.state != "running":
                return
        job.cancelled.set()
        self.metrics.add("timed_out_requests" if timed_out else "cancelled_requests")

    def retry_after(self) -> int:
        """Seconds until a slot is likely free: the running requests and those waiting."""
        ahead = (self.waiting + len(self.running)) / self.max_batch
        return max(1, math.ceil(self.service_seconds * ahead))

    def shut_down(self, grace: float) -> None:
        """The server is stopping: no job is taken any more, the waiting ones end at once with
        `shutting_down_error`, the running ones get `grace` seconds to finish and then end with
        it too. From any thread but the event loop's (it takes the lock)."""
        with self._lock:
            if self.shutting_down:
                return
            self.shutting_down = True
            waiting, stop_sent = [], False
            with contextlib.suppress(queue.Empty):
                while True:
                    job = self._jobs.get_nowait()
                    if job is None:
                        stop_sent = True
                    elif job.state == "queued":
                        job.state, self.waiting = "cancelled", self.waiting - 1
                        waiting.append(job)
            if stop_sent:
                self._jobs.put(None)
        for job in waiting:
            job.emit("error", shutting_down_error())
        timer = threading.Timer(grace, self._cut_running)
        timer.daemon = True
        timer.start()

    def _cut_running(self) -> None:
        with self._lock:
            running = list(self.running)
            for job in running:
                job.cut_by_shutdown = True
        for job in running:
            job.cancelled.set()

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel the running jobs, drop the waiting ones and end the thread."""
        with self._lock:
            self._stopping = True
            running = list(self.running)
        for job in running:
            job.cancelled.set()
        self._jobs.put(None)
        self._thread.join(timeout)

    def _main(self) -> None:
        try:
            self.engine = self._load()
            batcher = Batcher(self.engine, self.max_batch) if self.max_batch > 1 else None
        except BaseException as e:  # handed to start(), in the main thread
            self._load_error = e
            self._ready.set()
            return
        self._ready.set()
        if batcher is None:
            self._one_at_a_time()
        else:
            self._batched(batcher)

    def _next_job(self, block: bool) -> Job | None:
        """The next job to run (marked running), None when there is none (without blocking)
        or the worker stops."""
        while True:
            try:
                job = self._jobs.get(block=block)
            except queue.Empty:
                return None
            if job is None:
                self._stopping = True
                return None
            with self._lock:
                if job.state == "cancelled" or self._stopping:
                    continue
                if self.shutting_down:  # taken from the queue as shut_down emptied it
                    job.state, self.waiting = "cancelled", self.waiting - 1
                    job.emit("error", shutting_down_error())
                    continue
                job.state = "running"
                self.running.append(job)
                self.waiting -= 1
            self.metrics.observe("queue_wait_seconds", time.monotonic() - job.arrived)
            return job

    def _one_at_a_time(self) -> None:
        while (job := self._next_job(block=True)) is not None:
            started = time.perf_counter()
            evictions = self._evictions()
            try:
                streamed = job.request.stream
                result = self.engine.run(
                    job.request,
                    on_start=(lambda cached: job.emit("start", cached)) if streamed else None,
                    on_text=(lambda text: job.emit("text", text)) if streamed else None,
                    cancelled=job.cancelled.is_set,
                )
                self._done(job, result, started, evictions)
            except Exception as e:
                self.engine.cached_tokens = []
                self._failed(job, e, started)

    def _batched(self, batcher: Batcher) -> None:
        """Admit waiting jobs while slots are free (waiting for one only when none runs), then
        one round of all running ones; a job that finished leaves before the next round."""
        started: dict[int, float] = {}
        while not self._stopping or batcher.running:
            while not self._stopping and not batcher.full:
                job = self._next_job(block=not batcher.running)
                if job is None:
                    break
                started[id(job)], evictions = time.perf_counter(), self._evictions()
                try:
                    result = batcher.admit(job)
                except Exception as e:
                    self._failed(job, e, started.pop(id(job)))
                    continue
                if result is not None:
                    self._done(job, result, started.pop(id(job)), evictions)
            if not batcher.running:
                continue
            evictions = self._evictions()
            self.metrics.observe("batch_size", len(batcher.running))
            try:
                finished = batcher.round()
            except Exception as e:
                for job in batcher.drop_all():
                    self._failed(job, e, started.pop(id(job)))
                continue
            for job, result in finished:
                self._done(job, result, started.pop(id(job)), evictions)
                evictions = self._evictions()

    def _evictions(self) -> int:
        pool = self.engine.pool
        return pool.evictions if pool is not None else 0

    def _done(self, job: Job, result, started: float, evictions: int) -> None:
        if job.cancelled.is_set():  # what was generated for nobody
            self.metrics.add("cancelled_completion_tokens", len(result.tokens))
        else:
            self.metrics.record(job.request.endpoint, result)
        if self.engine.prefix_cache:
            hit = result.stats.cached_tokens > 0
            self.metrics.add("prefix_cache_hits" if hit else "prefix_cache_misses")
        self.metrics.add("prefix_cache_evictions", self._evictions() - evictions)
        # out of `running` before the client hears: a request sent right after its answer
        # arrives finds the slot free (/metrics, /health and submit() read `running`)
        self._finished(job, started)
        if job.cut_by_shutdown:
            job.emit("error", shutting_down_error())
        else:
            job.emit("done", result)

    def _failed(self, job: Job, error: Exception, started: float) -> None:
        self.metrics.add("request_errors", status="500")
        self._finished(job, started)
        job.emit("error", error)

    def _finished(self, job: Job, started: float) -> None:
        seconds = time.perf_counter() - started
        self.service_seconds = (
            seconds if not self.service_seconds else 0.7 * self.service_seconds + 0.3 * seconds
        )
        with self._lock:
            job.state = "done"
            self.running.remove(job)


def shutting_down_error() -> RequestError:
    return RequestError(
        "the server is shutting down; retry on another instance or once it has restarted",
        code="shutting_down",
        status=503,
        kind="server_error",
    )
