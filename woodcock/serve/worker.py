"""The one thread that owns the model, and the jobs it runs.

MLX streams belong to the thread that made them, so the session is opened in the worker thread
and every generation runs there, one request at a time in arrival order. At most `queue_size`
requests wait behind the running one; more are answered 503 with a Retry-After. A streaming
client that goes away cancels its request, and so does a request's timeout: the speculative
loop checks between rounds (and prefill chunks), so the model is free again within one round.
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
from woodcock.serve.engine import Engine
from woodcock.serve.metrics import Metrics
from woodcock.serve.request import GenerationRequest

DEFAULT_QUEUE_SIZE = 8
MAX_BATCH = 1  # requests generating at once


@dataclass
class Job:
    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    state: str = "queued"  # queued, running, cancelled (before it ran) or done
    arrived: float = field(default_factory=time.monotonic)

    def emit(self, kind: str, value) -> None:
        """From the worker thread: ("text", str), ("done", Generation) or ("error", Exception)."""
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is listening
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))


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
            self.metrics.observe("queue_wait_seconds", time.monotonic() - job.arrived)
            started = time.perf_counter()
            pool = self.engine.pool
            evictions = pool.evictions if pool is not None else 0
            try:
                on_text = (lambda text: job.emit("text", text)) if job.request.stream else None
                result = self.engine.run(
                    job.request, on_text=on_text, cancelled=job.cancelled.is_set
                )
                if job.cancelled.is_set():  # what was generated for nobody
                    self.metrics.add("cancelled_completion_tokens", len(result.tokens))
                else:
                    self.metrics.record(job.request.endpoint, result)
                if self.engine.prefix_cache:
                    hit = result.stats.cached_tokens > 0
                    self.metrics.add("prefix_cache_hits" if hit else "prefix_cache_misses")
                if pool is not None:
                    self.metrics.add("prefix_cache_evictions", pool.evictions - evictions)
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
