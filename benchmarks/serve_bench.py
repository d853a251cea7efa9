"""Serving benchmark (not a test): `woodcock serve` with the drafter against plain mlx-lm decoding
behind the same server, and a conversation's second turn with and without the prompt cache.

    python benchmarks/serve_bench.py [--target T --drafter D] [--policy auto] [-n 5]
                                     [--max-tokens 128] [--json]

Four servers run side by side, each a subprocess on a free loopback port: speculative and
plain (`plain=True`, the --no-drafter mode), each with and without the prompt cache. After one
warm-up request each, every one of n chat prompts of the shipped chat set goes to each server
in turn, one request at a time, greedy, max-tokens new tokens (tokens per second: completion
tokens over the request's wall time at the client, prompt included); then to each in turn a
second turn (the first turn's prompt and answer, then a short follow-up question), streamed,
its time to the first content chunk measured at the client, with the prompt tokens the cache
supplied. Interleaving the servers makes other load on the machine slow them all alike. Greedy
answers of all four servers must be identical; the script says so and exits 1 if not.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import subprocess
import sys
import tempfile
import time
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


class Server:
    """A `woodcock.serve.serve` subprocess on a free port (it prints the one it listens on)."""

    def __init__(self, target, drafter, policy, *, plain, prefix_cache, log: Path):
        options = {"port": 0, "plain": plain, "prefix_cache": prefix_cache, "log_level": "warning"}
        code = (
            "from woodcock.serve import serve;"
            f" serve({target!r}, {None if plain else drafter!r}, {policy!r}, **{options!r})"
        )
        self.log = log
        self.process = subprocess.Popen(
            [sys.executable, "-c", code], stdout=log.open("w"), stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + 600  # a first `auto` run measures the latency profile
        while time.monotonic() < deadline:
            found = re.search(r"serving (.+) at http://[^:]+:(\d+)/v1", log.read_text())
            if found:
                self.model, self.port = found.group(1), int(found.group(2))
                return
            if self.process.poll() is not None:
                raise SystemExit(f"the server exited:\n{log.read_text()}")
            time.sleep(0.2)
        self.stop()
        raise SystemExit(f"the server did not start:\n{log.read_text()}")

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
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                for choice in chunk["choices"]:
                    content = choice["delta"].get("content")
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
        speculative = usage["speculative"]
        self.rounds += speculative["rounds"]
        self.accepted += speculative["accepted_tokens"]
        self.drafted += speculative["drafted_tokens"]

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
    parser.add_argument("-n", "--prompts", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = parser.parse_args()

    from woodcock.prompts import load_prompts

    prompts = [p.prompt for p in load_prompts(["chat"], limit_per_domain=args.prompts)]
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


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
