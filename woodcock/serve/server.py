"""Start-up: resolve the served pair, open its engine in the worker thread, listen, and run
the app under uvicorn until interrupted."""

from __future__ import annotations

import math
import socket
import sys
import threading

from woodcock.default_target import DEFAULT_TARGET, resolve_pair, resolve_target
from woodcock.errors import DrafterError
from woodcock.runtime.backend import describe as describe_backend
from woodcock.runtime.backend import report as backend_report
from woodcock.runtime.latency import policy_with_profile
from woodcock.runtime.machine import machine_facts, warn_slow_paths
from woodcock.runtime.session import open_session
from woodcock.serve.engine import DEFAULT_PREFIX_CACHE_GB, Engine
from woodcock.serve.request import DEFAULT_MAX_TOKENS
from woodcock.serve.worker import DEFAULT_MAX_BATCH, DEFAULT_QUEUE_SIZE, GenerationWorker

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080


def resolve_served_pair(
    target: str | None, drafter: str | None, *, plain: bool
) -> tuple[str, str | None, str]:
    """(target source, drafter or None for plain decoding, model id): the default target and
    its shipped drafter where neither is named, as `woodcock generate` resolves them."""
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
    prefix_cache_gb: float = DEFAULT_PREFIX_CACHE_GB,
) -> Engine:
    """Open the session (in the calling thread, which must be the one that generates) and the
    policy: `auto` / `confidence` without a file use this machine's cached latency profile for
    the pair, measured now, once, if there is none."""
    if drafter is None:
        # plain decoding needs only the target: the weight-free n-gram drafter opens it alone
        session = open_session(target, "ngram", dtype=dtype, lookup=False)
        return Engine(session, None, prefix_cache=prefix_cache, prefix_cache_gb=prefix_cache_gb)
    session = open_session(target, drafter, dtype=dtype, lookup=lookup)

    def announce(done: int, total: int) -> None:  # called only while measuring
        if done == 1:
            print(
                f"woodcock: measuring this machine's latency for --policy {policy} (once)",
                file=sys.stderr,
                flush=True,
            )

    policy = policy_with_profile(policy, session, target, drafter, progress=announce)
    return Engine(session, policy, prefix_cache=prefix_cache, prefix_cache_gb=prefix_cache_gb)


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
    max_batch: int = DEFAULT_MAX_BATCH,
    prefix_cache: bool = True,
    prefix_cache_gb: float | None = None,
    request_timeout: float | None = None,
    lookup: bool = True,
    dtype: str | None = None,
    plain: bool = False,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    log_level: str = "info",
) -> None:
    """Open the pair and serve it until interrupted. Errors in what was asked for (paths, the
    policy, the address) raise DrafterError before the server listens. plain: decode with
    mlx-lm alone (no drafter), the baseline for measuring one; with max_batch > 1 the batched
    loop decodes without drafts instead. max_batch: requests decoding together. prefix_cache_gb:
    the prefix pool's limit (None: DEFAULT_PREFIX_CACHE_GB; 0: no prefix cache, as
    prefix_cache=False). request_timeout: seconds a request may take from its arrival (None: no
    limit)."""
    import uvicorn

    from woodcock.serve.app import create_app  # imports starlette

    if queue_size < 1:
        raise DrafterError(f"--queue-size {queue_size}: expected at least 1")
    if max_batch < 1:
        raise DrafterError(f"--max-batch {max_batch}: expected at least 1")
    if max_tokens < 1:
        raise DrafterError(f"--max-tokens {max_tokens}: expected at least 1")
    if not prefix_cache and prefix_cache_gb is not None:
        raise DrafterError(
            f"--prefix-cache-gb {prefix_cache_gb}: sizes a prefix cache that --no-prefix-cache"
            " turns off; give one of them"
        )
    if prefix_cache_gb is None:
        prefix_cache_gb = DEFAULT_PREFIX_CACHE_GB
    if not (math.isfinite(prefix_cache_gb) and prefix_cache_gb >= 0):
        raise DrafterError(f"--prefix-cache-gb {prefix_cache_gb}: expected a number at least 0")
    if request_timeout is not None and not (math.isfinite(request_timeout) and request_timeout > 0):
        raise DrafterError(f"--request-timeout {request_timeout}: expected a number of seconds > 0")
    prefix_cache = prefix_cache and prefix_cache_gb > 0
    source, drafter, model_id = resolve_served_pair(target, drafter, plain=plain)
    sock = _listening_socket(host, port)
    worker = GenerationWorker(
        lambda: open_engine(
            source,
            drafter,
            policy,
            dtype=dtype,
            lookup=lookup,
            prefix_cache=prefix_cache,
            prefix_cache_gb=prefix_cache_gb,
        ),
        queue_size=queue_size,
        max_batch=max_batch,
    )
    try:
        engine = worker.start()
    except BaseException:
        sock.close()
        raise
    warn_slow_paths(machine_facts(engine.session.dtype_name))
    description = {
        "drafter": drafter,
        "policy": engine.policy or "plain (mlx-lm, no drafter)",
        "prompt_lookup": engine.session.lookup is not None,
        "prefix_cache": prefix_cache,
        "prefix_cache_gb": prefix_cache_gb if prefix_cache else 0,
        "request_timeout": request_timeout,
        "max_batch": max_batch,
        "backend": backend_report(),
    }
    app = create_app(
        worker,
        model_id=model_id,
        default_max_tokens=max_tokens,
        description=description,
        request_timeout=request_timeout,
    )
    address = sock.getsockname()
    print(
        f"woodcock: serving {model_id} at http://{host}:{address[1]}/v1"
        f" ({'plain decoding' if plain else f'drafter {drafter}, policy {engine.policy}'};"
        f" {describe_backend(description['backend'])})",
        file=sys.stderr,
        flush=True,
    )
    _run(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5), worker, sock)


RUNNING_GRACE_SECONDS = 4  # of uvicorn's 5 for open requests, before it cancels them


def _run(config, worker: GenerationWorker, sock: socket.socket) -> None:
    """uvicorn's server, which also tells the worker at the first exit signal (SIGTERM, Ctrl-C):
    the waiting requests end at once with a 503 and the running ones before uvicorn's grace
    runs out, each in its API's error shape, not cut off mid-answer by uvicorn's cancellation."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            # a signal handler may interrupt the event loop's thread while it holds the worker's
            # lock: the worker is told from a thread of its own
            threading.Thread(
                target=worker.shut_down, args=(RUNNING_GRACE_SECONDS,), daemon=True
            ).start()
            super().handle_exit(sig, frame)

    Server(config).run(sockets=[sock])
