"""Serving benchmark (not a test): `woodcock serve` with the drafter against plain mlx-lm decoding
behind the same server, and a conversation's second turn with and without the prompt cache; or,
with --clients N, concurrent requests against woodcock one at a time, woodcock batching them and
mlx-lm's own server.

    python benchmarks/serve_bench.py [--target T --drafter D] [--policy auto] [-n 5]
                                     [--max-tokens 128] [--json]
    python benchmarks/serve_bench.py --clients N [--target T --drafter D] [--policy auto]
                                     [-n N] [--max-tokens 128] [--json]

Four servers run side by side, each a subprocess on a free loopback port: speculative and
plain (`plain=True`, the --no-drafter mode), each with and without the prompt cache. After one
warm-up request each, every one of n chat prompts of the shipped chat set goes to each server
in turn, one request at a time, greedy, max-tokens new tokens (tokens per second: completion
tokens over the request's wall time at the client, prompt included); then to each in turn a
second turn (the first turn's prompt and answer, then a short follow-up question), streamed,
its time to the first content chunk measured at the client, with the prompt tokens the cache
supplied. Interleaving the servers makes other load on the machine slow them all alike. Greedy
answers of all four servers must be identical; the script says so and exits 1 if not.

With --clients N, three servers run side by side instead: `woodcock serve` one request at a
time (max_batch=1), `woodcock serve` generating up to N requests at once (max_batch=N) and
`python -m mlx_lm.server` on the same target directory, batching up to N (--decode-concurrency
and --prompt-concurrency N). No server keeps a prompt cache, so that no pass reuses another's
prefill. N requests (the first n chat prompts, default N, repeated in order when n < N), greedy,
max-tokens new tokens, all streamed. After one warm-up request each, the servers take turns pass
by pass: a lone pass (the N requests one after another) on each, then a concurrent pass (the N
requests sent at once from N client threads) on each. Reported per server: the concurrent
pass's throughput (completion tokens over the wall time from the first send to the last
finish) against woodcock one at a time's and mlx_lm.server's, the lone pass's (tokens over the
sum of the requests' times), the mean time to the first content chunk alone and concurrently,
and how many concurrent answers equal the same request's lone answer from the same server and
woodcock one at a time's lone answer. Exit 1 if a woodcock server answers any request
differently concurrently than alone; mlx_lm.server's differences are reported only.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

FOLLOW_UP = "Now say that again in one short sentence."
CONFIGS = [
    # (label, plain, prefix cache)
    ("speculative", False, True),
    ("speculative", False, False),
    ("plain mlx-lm", True, True),
    ("plain mlx-lm", True, False),
]
STARTUP_SECONDS = 600  # a first `auto` run measures the latency profile


class Server:
    """A `woodcock.serve.serve` subprocess on a free port (it prints the one it listens on).
    options: more keyword arguments of `serve` (max_batch, queue_size...)."""

    def __init__(self, target, drafter, policy, *, plain, prefix_cache, log: Path, **options):
        options = {
            "port": 0,
            "plain": plain,
            "prefix_cache": prefix_cache,
            "log_level": "warning",
            **options,
        }
        code = (
            "from woodcock.serve import serve;"
            f" serve({target!r}, {None if plain else drafter!r}, {policy!r}, **{options!r})"
        )
        self.start([sys.executable, "-c", code], log, self._announced)

    def start(self, command: list[str], log: Path, ready, env: dict | None = None) -> None:
        """Run `command`, logging to `log`, until `ready()` says it answers."""
        self.log = log
        self.process = subprocess.Popen(
            command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env
        )
        deadline = time.monotonic() + STARTUP_SECONDS
        while time.monotonic() < deadline:
            if ready():
                return
            if self.process.poll() is not None:
                raise SystemExit(f"the server exited:\n{log.read_text()}")
            time.sleep(0.2)
        self.stop()
        raise SystemExit(f"the server did not start:\n{log.read_text()}")

    def _announced(self) -> bool:
        found = re.search(r"serving (.+) at http://[^:]+:(\d+)/v1", self.log.read_text())
        if found:
            self.model, self.port = found.group(1), int(found.group(2))
        return found is not None

    def chat(self, messages, max_tokens: int, *, stream: bool = False):
        """(text, usage, seconds to the first content chunk, total seconds)."""
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        start = time.perf_counter()
        first = None
        try:
            connection.request("POST", "/v1/chat/completions", body=json.dumps(body))
            response = connection.getresponse()
            if response.status != 200:
                raise SystemExit(f"HTTP {response.status}: {response.read().decode()}")
            if not stream:
                answer = json.loads(response.read())
                seconds = time.perf_counter() - start
                return answer["choices"][0]["message"]["content"], answer["usage"], None, seconds
            text, usage = "", None
            for line in response:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue  # mlx_lm.server also sends ": keepalive" comments while prefilling
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                for choice in chunk["choices"]:
                    content = choice.get("delta", {}).get("content")
                    if content and first is None:
                        first = time.perf_counter() - start
                    text += content or ""
            return text, usage, first, time.perf_counter() - start
        finally:
            connection.close()

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()


class MlxLmServer(Server):
    """`python -m mlx_lm.server` on `target` (a local directory or a cached Hub id), batching up
    to `batch` requests, on a free port chosen here: it takes no port 0, as it would not say
    which port it got."""

    # mlx_lm.server's name for the model given by --model: any other would be loaded anew
    model = "default_model"

    def __init__(self, target: str, batch: int, *, log: Path):
        self.port = free_port()
        command = [
            sys.executable,
            "-m",
            "mlx_lm.server",
            "--model",
            target,
            "--port",
            str(self.port),
            # a request arriving while others run joins their batch (one without a seed, as
            # here; a seed would serve it alone): up to `batch` decoding and `batch` prefilling
            # together, the cap woodcock's max_batch=N has
            "--decode-concurrency",
            str(batch),
            "--prompt-concurrency",
            str(batch),
            # no prompt cache: the concurrent pass would find its prompts prefilled by the lone
            # pass (woodcock's servers run with prefix_cache=False for the same reason)
            "--prompt-cache-size",
            "0",
            "--log-level",
            "WARNING",
        ]
        self.start(command, log, self._healthy, env=same_blas_environment())

    def _healthy(self) -> bool:
        # /health answers once the generation thread runs, perhaps still loading the model:
        # the warm-up request waits for that
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
        try:
            connection.request("GET", "/health")
            return connection.getresponse().status == 200
        except OSError:
            return False
        finally:
            connection.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def same_blas_environment() -> dict:
    """The environment for mlx_lm.server: on Linux, importing woodcock puts the system's OpenBLAS
    under MLX's CPU backend (3-18x faster fp32 matmuls), so woodcock's servers run on it;
    preloading it gives mlx_lm.server the same, or the comparison would measure the BLAS. A
    BLAS preloaded already is inherited by all three servers and left alone."""
    from woodcock.runtime.openblas import OPT_OUT, find_openblas, usable_cores

    env = dict(os.environ)
    blas = find_openblas()
    if platform.system() == "Linux" and env.get(OPT_OUT) != "0" and blas.exists():
        env.setdefault("LD_PRELOAD", str(blas))
        env.setdefault("OPENBLAS_NUM_THREADS", str(usable_cores()))  # as woodcock sets it
    return env


@dataclass
class Totals:
    answers: list[str] = field(default_factory=list)
    second_turns: list[str] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0
    rounds: int = 0
    accepted: int = 0
    drafted: int = 0
    first_chunk_seconds: float = 0.0
    cached: int = 0
    prompt_tokens: int = 0

    def first_turn(self, text: str, usage: dict, seconds: float) -> None:
        self.answers.append(text)
        self.tokens += usage["completion_tokens"]
        self.seconds += seconds
        # woodcock's own usage field: mlx_lm.server, say, has none
        speculative = usage.get("speculative") or {}
        self.rounds += speculative.get("rounds", 0)
        self.accepted += speculative.get("accepted_tokens", 0)
        self.drafted += speculative.get("drafted_tokens", 0)

    def second_turn(self, text: str, usage: dict, first_chunk: float) -> None:
        self.second_turns.append(text)
        self.first_chunk_seconds += first_chunk
        self.cached += usage["prompt_tokens_details"]["cached_tokens"]
        self.prompt_tokens += usage["prompt_tokens"]

    def row(self) -> dict:
        n = len(self.answers)
        return {
            "tokens": self.tokens,
            "tokens_per_second": self.tokens / self.seconds,
            "tokens_per_round": (self.accepted + self.rounds) / self.rounds
            if self.rounds
            else None,
            "acceptance": self.accepted / self.drafted if self.drafted else None,
            "second_turn_ttft_ms": 1e3 * self.first_chunk_seconds / n,
            "second_turn_cached": self.cached / n,
            "second_turn_prompt": self.prompt_tokens / n,
        }


def measure(servers: list[Server], prompts, max_tokens: int) -> list[Totals]:
    """Every prompt on every server in turn, so that other load on the machine slows them all
    alike."""
    totals = [Totals() for _ in servers]
    for server in servers:
        server.chat([{"role": "user", "content": "Hello"}], 8)  # warm-up
    for prompt in prompts:
        messages = [{"role": "user", "content": prompt}]
        for server, total in zip(servers, totals, strict=True):
            text, usage, _, seconds = server.chat(messages, max_tokens)
            total.first_turn(text, usage, seconds)
        for server, total in zip(servers, totals, strict=True):
            turn = messages + [
                {"role": "assistant", "content": total.answers[-1]},
                {"role": "user", "content": FOLLOW_UP},
            ]
            text, usage, first_chunk, _ = server.chat(turn, 16, stream=True)
            total.second_turn(text, usage, first_chunk)
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="mlx-lm model (default: the default target)")
    parser.add_argument("--drafter", help="drafter (default: the default target's shipped one)")
    parser.add_argument("--policy", default="auto")
    parser.add_argument(
        "-n",
        "--prompts",
        type=int,
        help="chat prompts (default 5; with --clients N: N, repeated in order when fewer)",
    )
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--clients",
        type=int,
        help="N concurrent requests: woodcock one at a time, woodcock max_batch=N, mlx_lm.server",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = parser.parse_args()
    if args.clients is not None and args.clients < 1:
        parser.error(f"--clients {args.clients}: expected at least 1")
    if args.prompts is not None and args.prompts < 1:
        parser.error(f"-n {args.prompts}: expected at least 1")

    from woodcock.prompts import load_prompts

    if args.clients is not None:
        limit = args.prompts or args.clients
        chat = [p.prompt for p in load_prompts(["chat"], limit_per_domain=limit)]
        # the N requests: the chat prompts in order, from the first again when there are fewer
        main_concurrency(args, [chat[i % len(chat)] for i in range(args.clients)])
        return
    prompts = [p.prompt for p in load_prompts(["chat"], limit_per_domain=args.prompts or 5)]
    servers = []
    with tempfile.TemporaryDirectory() as logs:
        try:
            for i, (label, plain, prefix_cache) in enumerate(CONFIGS):
                print(
                    f"starting: {label}, prompt cache {'on' if prefix_cache else 'off'}",
                    file=sys.stderr,
                )
                servers.append(
                    Server(
                        args.target,
                        args.drafter,
                        args.policy,
                        plain=plain,
                        prefix_cache=prefix_cache,
                        log=Path(logs) / f"server{i}.log",
                    )
                )
            totals = measure(servers, prompts, args.max_tokens)
        finally:
            for server in servers:
                server.stop()
    rows = [
        {"mode": label, "prefix_cache": prefix_cache, **total.row()}
        for (label, _, prefix_cache), total in zip(CONFIGS, totals, strict=True)
    ]
    baseline = next(r for r in rows if r["mode"].startswith("plain") and r["prefix_cache"])
    identical = sum(len({t.answers[i] for t in totals}) == 1 for i in range(len(prompts)))
    identical_second = sum(
        len({t.second_turns[i] for t in totals}) == 1 for i in range(len(prompts))
    )
    if args.json:
        print(json.dumps({"rows": rows, "identical": identical, "prompts": len(prompts)}, indent=2))
    else:
        print(render(rows, baseline, args, len(prompts), identical, identical_second))
    sys.exit(0 if identical == identical_second == len(prompts) else 1)


def render(rows, baseline, args, n, identical, identical_second) -> str:
    lines = [
        "| mode | prompt cache | tokens/s | speedup | tokens/round | accepted | turn-2 TTFT |"
        " turn-2 cached / prompt tokens |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        per_round = f"{row['tokens_per_round']:.2f}" if row["tokens_per_round"] else "-"
        accepted = f"{row['acceptance']:.2f}" if row["acceptance"] is not None else "-"
        lines.append(
            f"| {row['mode']} | {'on' if row['prefix_cache'] else 'off'}"
            f" | {row['tokens_per_second']:.1f}"
            f" | {row['tokens_per_second'] / baseline['tokens_per_second']:.2f}x"
            f" | {per_round} | {accepted} | {row['second_turn_ttft_ms']:.0f} ms"
            f" | {row['second_turn_cached']:.0f} / {row['second_turn_prompt']:.0f} |"
        )
    target = args.target or "default target"
    lines.append(
        f"\n{n} chat prompts, greedy, {args.max_tokens} new tokens, one request at a time"
        f" ({target}, policy {args.policy}); identical answers across the four servers:"
        f" {identical}/{n} first turns, {identical_second}/{n} second turns"
    )
    return "\n".join(lines)


# --- --clients N: concurrent requests ---------------------------------------------------------


@dataclass
class Reply:
    """One streamed answer, timed at the client."""

    text: str
    # from usage; mlx_lm.server counts a final EOS token that woodcock does not (at most one
    # more per answer that stops before max-tokens)
    tokens: int
    first_chunk: float  # seconds from the send to the first content chunk
    sent: float  # time.perf_counter() at the send and after the last chunk
    done: float
    rounds: int = 0  # the speculative loop's, where the server reports them (woodcock)
    accepted: int = 0


@dataclass
class Passes:
    lone: list[Reply] = field(default_factory=list)
    concurrent: list[Reply] = field(default_factory=list)


def ask(server: Server, prompt: str, max_tokens: int) -> Reply:
    sent = time.perf_counter()
    text, usage, first_chunk, seconds = server.chat(
        [{"role": "user", "content": prompt}], max_tokens, stream=True
    )
    done = time.perf_counter()
    if not usage or "completion_tokens" not in usage:
        raise SystemExit(f"{server.log.name}: the stream ended without its token counts")
    speculative = usage.get("speculative") or {}  # woodcock's own field: mlx_lm.server has none
    return Reply(
        text,
        usage["completion_tokens"],
        seconds if first_chunk is None else first_chunk,  # an empty answer: its end
        sent,
        done,
        speculative.get("rounds", 0),
        speculative.get("accepted_tokens", 0),
    )


def concurrent_pass(server: Server, prompts: list[str], max_tokens: int) -> list[Reply]:
    """The requests sent at once, one client thread each (a thread's error raises here)."""
    ready = threading.Barrier(len(prompts))

    def client(prompt: str) -> Reply:
        ready.wait()  # no request leaves before every thread is there to send its own
        return ask(server, prompt, max_tokens)

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(client, prompts))


def measure_concurrency(
    servers: list[Server], labels: list[str], prompts: list[str], max_tokens: int
) -> list[Passes]:
    """A lone pass on every server in turn, then a concurrent pass on every server in turn, so
    that other load on the machine slows them all alike."""
    passes = [Passes() for _ in servers]
    for server in servers:
        server.chat([{"role": "user", "content": "Hello"}], 8)  # warm-up
    for server, label, done in zip(servers, labels, passes, strict=True):
        print(f"lone pass: {label}", file=sys.stderr)
        done.lone = [ask(server, prompt, max_tokens) for prompt in prompts]
    for server, label, done in zip(servers, labels, passes, strict=True):
        print(f"concurrent pass: {label}", file=sys.stderr)
        done.concurrent = concurrent_pass(server, prompts, max_tokens)
    return passes


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def tokens_per_round(replies: list[Reply]) -> float | None:
    rounds = sum(r.rounds for r in replies)
    return (sum(r.accepted for r in replies) + rounds) / rounds if rounds else None


def concurrency_row(label: str, woodcock: bool, passes: Passes, one_at_a_time: Passes) -> dict:
    """One server's figures; one_at_a_time: woodcock max_batch=1's passes, the reference
    answers."""
    lone, concurrent = passes.lone, passes.concurrent
    wall = max(r.done for r in concurrent) - min(r.sent for r in concurrent)
    lone_ttft = mean(r.first_chunk for r in lone)
    concurrent_ttft = mean(r.first_chunk for r in concurrent)
    requests = [
        {
            "lone_tokens": alone.tokens,
            "concurrent_tokens": together.tokens,
            "lone_ttft_ms": 1e3 * alone.first_chunk,
            "concurrent_ttft_ms": 1e3 * together.first_chunk,
            "identical_to_lone": together.text == alone.text,
            "identical_to_one_at_a_time": together.text == reference.text,
        }
        for alone, together, reference in zip(lone, concurrent, one_at_a_time.lone, strict=True)
    ]
    return {
        "server": label,
        "woodcock": woodcock,
        "concurrent_tokens": sum(r.tokens for r in concurrent),
        "concurrent_seconds": wall,
        "concurrent_tokens_per_second": sum(r.tokens for r in concurrent) / wall,
        "lone_tokens_per_second": sum(r.tokens for r in lone) / sum(r.done - r.sent for r in lone),
        "lone_ttft_ms": 1e3 * lone_ttft,
        "concurrent_ttft_ms": 1e3 * concurrent_ttft,
        "ttft_ratio": concurrent_ttft / lone_ttft,
        "tokens_per_round_lone": tokens_per_round(lone),
        "tokens_per_round_concurrent": tokens_per_round(concurrent),
        "identical_to_lone": sum(r["identical_to_lone"] for r in requests),
        "identical_to_one_at_a_time": sum(r["identical_to_one_at_a_time"] for r in requests),
        "requests": requests,
    }


def main_concurrency(args, prompts: list[str]) -> None:
    from woodcock.default_target import resolve_target

    n = args.clients
    configs = [
        # (label, max_batch; None: mlx_lm.server)
        ("woodcock, one at a time", 1),
        (f"woodcock, max_batch {n}", n),
        (f"mlx_lm.server, batch {n}", None),
    ]
    labels = [label for label, _ in configs]
    servers: list[Server] = []
    with tempfile.TemporaryDirectory() as logs:
        try:
            for i, (label, max_batch) in enumerate(configs):
                print(f"starting: {label}", file=sys.stderr)
                log = Path(logs) / f"server{i}.log"
                if max_batch is None:
                    # a directory (the default target's is the one woodcock converted it into)
                    servers.append(MlxLmServer(resolve_target(args.target), n, log=log))
                    continue
                server = Server(
                    args.target,
                    args.drafter,
                    args.policy,
                    plain=False,
                    prefix_cache=False,
                    log=log,
                    max_batch=max_batch,
                    queue_size=n,  # room for every request: one at a time, n - 1 wait
                )
                servers.append(server)
            passes = measure_concurrency(servers, labels, prompts, args.max_tokens)
        finally:
            for server in servers:
                server.stop()
    rows = [
        concurrency_row(label, max_batch is not None, done, passes[0])
        for (label, max_batch), done in zip(configs, passes, strict=True)
    ]
    for row in rows:
        for name, reference in (("vs_one_at_a_time", rows[0]), ("vs_mlx_lm_server", rows[2])):
            row[name] = (
                row["concurrent_tokens_per_second"] / reference["concurrent_tokens_per_second"]
            )
    differing = [row for row in rows if row["woodcock"] and row["identical_to_lone"] < n]
    if args.json:
        report = {
            "clients": n,
            "prompts": len(set(prompts)),
            "max_tokens": args.max_tokens,
            "target": args.target,
            "policy": args.policy,
            "machine": machine(),
            "rows": rows,
        }
        print(json.dumps(report, indent=2))
    else:
        print(render_concurrency(rows, args, len(set(prompts))))
    for row in differing:
        print(
            f"{row['server']}: {n - row['identical_to_lone']} of {n} answers differ under"
            " concurrency from the same request served alone",
            file=sys.stderr,
        )
    sys.exit(1 if differing else 0)


def render_concurrency(rows, args, distinct: int) -> str:
    lines = [
        "| server | tokens/s concurrent | tokens/s lone | vs one at a time | vs mlx_lm.server"
        " | TTFT lone | TTFT concurrent | TTFT ratio | tokens/round lone / concurrent"
        " | = lone | = one at a time |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        per_round = " / ".join(
            f"{row[key]:.2f}" if row[key] else "-"
            for key in ("tokens_per_round_lone", "tokens_per_round_concurrent")
        )
        n = len(row["requests"])
        lines.append(
            f"| {row['server']} | {row['concurrent_tokens_per_second']:.1f}"
            f" | {row['lone_tokens_per_second']:.1f} | {row['vs_one_at_a_time']:.2f}x"
            f" | {row['vs_mlx_lm_server']:.2f}x | {row['lone_ttft_ms']:.0f} ms"
            f" | {row['concurrent_ttft_ms']:.0f} ms | {row['ttft_ratio']:.2f}x | {per_round}"
            f" | {row['identical_to_lone']}/{n} | {row['identical_to_one_at_a_time']}/{n} |"
        )
    n = len(rows[0]["requests"])
    lines.append(
        f"\n{n} concurrent clients, {distinct} chat prompts, greedy, {args.max_tokens} new"
        f" tokens, streamed, no prompt cache ({args.target or 'default target'}, policy"
        f" {args.policy}). tokens/s concurrent: completion tokens over the wall time from the"
        " first send to the last finish (its ratios against the two baselines); lone: the same"
        " requests one after another, tokens over the sum of their times. TTFT: mean time to"
        " the first content chunk at the client. = lone, = one at a time: concurrent answers"
        " identical to the same request served alone by the same server, and by woodcock one"
        " at a time.\n"
        f"machine: {machine()}"
    )
    return "\n".join(lines)


def machine() -> str:
    """The CPU's model (from /proc/cpuinfo where there is one) and its cores."""
    model = platform.processor() or platform.machine()
    try:
        found = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
    except OSError:
        found = None
    if found:
        model = found.group(1).strip()
    cores = os.cpu_count()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cores
    return f"{model}, {cores} cores" + (f" ({usable} usable)" if usable != cores else "")


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
