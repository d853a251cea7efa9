"""Where a speculative round's time goes (not a test): the host's time building each phase's lazy
graph against the time waiting for the device to compute it, for a greedy round at a fixed draft
length and for a plain decoding step, on one prompt.

    python benchmarks/round_profile.py [--target T --drafter D] [--dtype float32] [--allow-tf32]
        [--draft 3] [--rounds 32] [--repeats 3] [--no-chat] [--json FILE]

A round's phases, each closed by an evaluation so that each wait is its own: draft build (the
drafter's steps as a lazy graph), draft wait, verify build (the target's forward of the anchor
and the drafts, and the verdict), verify wait, commit (rollback and bookkeeping). Forcing the
drafts costs a wait the runtime does not pay: `round as run` is the same round as
speculative_generate_step runs it, with its one wait; `round drafts early` the same with the
device set to the drafts (async_eval) while the host builds the verify; `round staged` that,
and the device set to each quarter of the verify's layers as soon as it is built (on a GPU the
host builds while the device computes, as mlx-lm's plain decoding overlaps its steps); `round
scores read` as run, but with the drafter's scores read on the host before the verify is
built, the second wait the auto and confidence policies pay (every draft kept). A plain
step is mlx-lm's model on one token and its argmax, built then waited for; `mlx-lm
generate_step` is plain decoding as mlx-lm runs it (it builds the next step while the device
computes this one). Milliseconds are medians over the rounds, the best of the repeats; every
kind of round must emit the same tokens. Operations: how many the lazy graphs of a round's
drafts, its verify and a plain step hold, views aside (on a GPU, where each launches a kernel
and a small model's step is launch-bound, the cost to cut).
"""

# ruff: noqa: I001  (woodcock is imported before mlx so that the CPU backend picks up OpenBLAS)
from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import platform
import re
import statistics
import sys
import time

from woodcock.runtime.backend import configure_tf32

configure_tf32("--allow-tf32" in sys.argv[1:])  # before MLX's first matmul

import mlx.core as mx  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from woodcock.default_target import resolve_pair  # noqa: E402
from woodcock.prompts import load_prompts  # noqa: E402
from woodcock.runtime.backend import describe, report  # noqa: E402
from woodcock.runtime.decode import SpeculativeSequence, Stats  # noqa: E402
from woodcock.runtime.generate import encode_prompt  # noqa: E402
from woodcock.runtime.machine import cpu_model  # noqa: E402
from woodcock.runtime.policy import FixedPolicy  # noqa: E402
from woodcock.runtime.session import open_session  # noqa: E402

# operations that make a view of their input on a GPU: no kernel launch
VIEWS = {"Broadcast", "Transpose", "Flatten", "Unflatten", "Reshape", "ExpandDims", "Squeeze"}
STAGES = 4  # "staged" rounds: the device starts after each quarter of the verify's layers
PHASES = ["draft build", "draft wait", "verify build", "verify wait", "commit"]


class ScoresRead(FixedPolicy):
    """A fixed draft length that reads the drafts' scores, as auto does, and keeps them all."""

    needs_scores = True


def rounds(session, prompt: list[int], draft: int, count: int, mode: str):
    """`count` greedy rounds after the prompt: (each round's seconds by phase where `mode` is
    "forced", else its whole seconds; the tokens emitted). "as run": one wait a round, as
    speculative_generate_step runs it; "drafts early": the device starts on the drafts
    (async_eval) while the host builds the verify, still one wait; "staged": that, and the
    verify's first layers handed to the device while the host builds the later ones; "scores
    read": as run, with the drafter's scores read on the host first, as the auto and
    confidence policies do (a second wait; this policy keeps every draft)."""
    policy = ScoresRead(draft) if mode == "scores read" else FixedPolicy(draft)
    sequence = SpeculativeSequence(
        prompt, session.target, session.drafter, policy=policy, stats=Stats()
    )
    tokens = [step[0] for step in sequence.start()]
    forced = mode == "forced"
    timings = []
    for _ in range(count):
        marks = [time.perf_counter()]
        proposal = sequence.propose()  # [k+1]
        if forced:
            marks.append(time.perf_counter())
            mx.eval(proposal)
            marks.append(time.perf_counter())
        elif mode in ("drafts early", "staged"):
            mx.async_eval(proposal)
        every = max(1, len(session.target.layers) // STAGES) if mode == "staged" else 0
        with staged(session.target.layers, every):
            sequence.judge(*session.target.forward(proposal))
        if forced:
            marks.append(time.perf_counter())
        mx.eval(sequence.verdict)
        marks.append(time.perf_counter())
        tokens += [step[0] for step in sequence.commit(marks[-1] - marks[0])]
        marks.append(time.perf_counter())
        spans = [b - a for a, b in itertools.pairwise(marks)]
        timings.append(dict(zip(PHASES, spans, strict=True)) if forced else sum(spans))
    return timings, tokens


class _Stage:
    """Stands in for a decoder layer: calls it, hands its output to the device (async_eval)."""

    def __init__(self, layer):
        self.layer = layer

    def __call__(self, x, *args, **kwargs):
        out = self.layer(x, *args, **kwargs)
        mx.async_eval(out)
        return out

    def __getattr__(self, name):
        return getattr(self.layer, name)


@contextlib.contextmanager
def staged(layers: list, every: int):
    """For the length of a forward, every `every`-th layer of the model's list (in place) starts
    the device on what is built so far (0: none)."""
    originals = list(layers)
    if every:
        layers[:] = [_Stage(x) if (i + 1) % every == 0 else x for i, x in enumerate(originals)]
    try:
        yield
    finally:
        layers[:] = originals


def graph_sizes(session, prompt: list[int], draft: int) -> dict[str, int]:
    """The operations MLX runs for a round's drafts, for its verify after them and for a plain
    step, views aside: on a GPU about a kernel launch each. The CPU backend composes the fast
    operations (RMS norm, RoPE, attention) of several, so its counts are higher."""
    sequence = SpeculativeSequence(
        prompt, session.target, session.drafter, policy=FixedPolicy(draft), stats=Stats()
    )
    for _ in sequence.start():
        pass
    proposal = sequence.propose()
    sizes = {"draft": operations(proposal)}
    mx.eval(proposal)
    sequence.judge(*session.target.forward(proposal))
    sizes["verify"] = operations(*sequence.verdict)
    mx.eval(sequence.verdict)
    cache = make_prompt_cache(session.model)
    mx.eval(session.model(mx.array(prompt)[None], cache=cache))
    sizes["plain step"] = operations(
        mx.argmax(session.model(mx.array(prompt[-1:])[None], cache=cache)[0, -1])
    )
    return sizes


def operations(*arrays: mx.array) -> int:
    graph = io.StringIO()
    mx.export_to_dot(graph, *arrays)
    found = re.findall(r'label ="([^"]+)", shape=rectangle', graph.getvalue())
    return sum(name not in VIEWS for name in found)


def plain_steps(model, prompt: list[int], count: int) -> list[tuple[float, float]]:
    """(build, wait) seconds of `count` one-token greedy steps after the prompt."""
    cache = make_prompt_cache(model)
    token = mx.argmax(model(mx.array(prompt)[None], cache=cache)[0, -1])
    mx.eval(token)
    timings = []
    for _ in range(count):
        start = time.perf_counter()
        token = mx.argmax(model(token.reshape(1, 1), cache=cache)[0, -1])
        built = time.perf_counter()
        mx.eval(token)
        timings.append((built - start, time.perf_counter() - built))
    return timings


def generate_step_seconds(model, prompt: list[int], count: int) -> float:
    """Seconds a token of mlx-lm's own greedy decoding, past its first token."""
    steps = generate_step(mx.array(prompt), model, max_tokens=count + 1)
    next(steps)
    start = time.perf_counter()
    for _ in steps:
        pass
    return (time.perf_counter() - start) / count


def profile(session, prompt: list[int], draft: int, count: int, repeats: int) -> dict:
    best: dict[str, float] = {}

    def keep(name: str, seconds: float) -> None:
        best[name] = min(best.get(name, float("inf")), 1000 * seconds)

    rounds(session, prompt, draft, 4, "forced")  # warm-up: compiles and allocates
    plain_steps(session.model, prompt, 4)
    identical = True
    for _ in range(repeats):
        phased, forced_tokens = rounds(session, prompt, draft, count, "forced")
        for phase in PHASES:
            keep(phase, statistics.median(t[phase] for t in phased))
        keep("round, phases forced", statistics.median(sum(t.values()) for t in phased))
        for mode in ("as run", "drafts early", "staged", "scores read"):
            whole, tokens = rounds(session, prompt, draft, count, mode)
            keep(f"round {mode}", statistics.median(whole))
            identical = identical and tokens == forced_tokens
        plain = plain_steps(session.model, prompt, count)
        keep("plain step build", statistics.median(b for b, _ in plain))
        keep("plain step wait", statistics.median(w for _, w in plain))
        keep("plain step", statistics.median(b + w for b, w in plain))
        keep("mlx-lm generate_step", generate_step_seconds(session.model, prompt, count))
    return {
        "ms": {name: round(value, 3) for name, value in best.items()},
        "operations": graph_sizes(session, prompt, draft),
        "tokens_per_round": (len(tokens) - 1) / count,  # the first came with the prompt
        "identical": identical,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", help="mlx-lm model (default: the default target)")
    parser.add_argument("--drafter", help="drafter (default: the default target's shipped one)")
    parser.add_argument("--dtype", help="the target's and drafter's dtype (default: as bench's)")
    parser.add_argument("--allow-tf32", action="store_true", help="TF32 fp32 matmuls on CUDA")
    parser.add_argument("--draft", type=int, default=3, help="drafts a round")
    parser.add_argument("--rounds", type=int, default=32, help="rounds timed a repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-chat", action="store_true", help="the prompt without a template")
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    if args.draft < 1 or args.rounds < 1 or args.repeats < 1:
        parser.error("--draft, --rounds and --repeats: expected at least 1")
    target, drafter = resolve_pair(args.target, args.drafter)
    session = open_session(target, drafter, dtype=args.dtype, lookup=False)
    text = load_prompts(["chat"], limit_per_domain=1)[0].prompt
    prompt = encode_prompt(session.tokenizer, text, chat=not args.no_chat)
    found = profile(session, prompt, args.draft, args.rounds, args.repeats)
    machine = f"{cpu_model() or platform.machine()}, {describe(report())}"
    ms = found["ms"]
    print(
        f"{args.target or 'the default target'} + {args.drafter or 'its shipped drafter'},"
        f" {session.dtype_name}, fixed:{args.draft}, {len(prompt)}-token prompt, {machine};"
        f" medians of {args.rounds} rounds, best of {args.repeats}"
    )
    for name, value in ms.items():
        print(f"  {name:<22}{value:>9.2f} ms")
    counted = ", ".join(f"{name} {count}" for name, count in found["operations"].items())
    print(f"  operations, views aside (on a GPU about its kernel launches): {counted}")
    per_token = ms["mlx-lm generate_step"]
    print(
        f"  {found['tokens_per_round']:.2f} tokens a round; a round as run costs"
        f" {ms['round as run'] / per_token:.2f} plain tokens; same tokens every way:"
        f" {found['identical']}"
    )
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"machine": machine, "dtype": session.dtype_name, **found}, file, indent=2)
    if not found["identical"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
