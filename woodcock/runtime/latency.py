"""Latency profiles: what one draft and one verification of k tokens cost on this machine, and
the expected tokens per second of a draft length under a given acceptance.

latency.json:
    {"format": "woodcock-latency", "version": 1, "machine": {...}, "target": ..., "drafter": ...,
     "dtype": ..., "draft_kind": "chain" | "block",
     "verify_seconds": {"<context>": [seconds to verify k = 1..16 tokens]},
     "draft_seconds": {"<head rows>": [seconds to draft k = 1..K tokens]}}
Each list holds medians of interleaved timings, made non-decreasing in k (`measure`).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import median

import numpy as np

from woodcock.default_target import cache_dir, resolve_pair
from woodcock.errors import DrafterError
from woodcock.jsonfile import read_json_object
from woodcock.runtime.backend import describe as describe_backend
from woodcock.runtime.backend import report as backend_report
from woodcock.staging import staged_file

# MLX and the modules that load it (machine, session) are imported in the functions that use
# them: this module (imported by policy.py) stays MLX-free so that OpenBLAS can still be opened
# under MLX after importing it (runtime/openblas.py).

FORMAT = "woodcock-latency"
MAX_VERIFY = 16
QUICK_CONTEXT = 256  # the profile `--policy auto` measures when given no file
# the verification lengths the quick profile times, the rest interpolated: every length a
# drafter round verifies, then sparser up to 16 (prompt-lookup copies). Where verifying grows
# with k, as on a CPU, the long ones dominate: timing all sixteen cost about twice as much
# there, and the interpolated costs fell within the timings' own run-to-run spread
QUICK_VERIFY = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16)
QUICK_DRAFT = 7
# how `cached_profile` measures, part of its cache key: 2 = interleaved sweeps made
# non-decreasing, 3 = verifying up to 16 tokens instead of 8, 4 = verifying with
# woodcock.runtime.cpu_kernels on the CPU, 5 = only QUICK_VERIFY timed
MEASURING = 5


@dataclass(frozen=True)
class LatencyProfile:
    verify_seconds: dict[int, list[float]]  # context length -> cost of verifying 1..16 tokens
    draft_seconds: dict[str, list[float]]  # head label -> cost of drafting 1..K tokens
    draft_kind: str

    @classmethod
    def load(cls, path: str | Path) -> LatencyProfile:
        data = read_json_object(Path(path))
        if data.get("format") != FORMAT or data.get("version") != 1:
            raise DrafterError(
                f"{path}: not a woodcock latency file (format {data.get('format')!r})"
            )
        try:
            verify = {int(c): [float(t) for t in ts] for c, ts in data["verify_seconds"].items()}
            draft = {str(h): [float(t) for t in ts] for h, ts in data["draft_seconds"].items()}
            kind = data["draft_kind"]
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise DrafterError(
                f"{path}: malformed latency file ({type(e).__name__}: {e})"
            ) from None
        rows = (*verify.values(), *draft.values())
        if not verify or not draft or any(not ts for ts in rows):
            raise DrafterError(f"{path}: empty verify_seconds or draft_seconds")
        if not all(math.isfinite(t) and t >= 0 for ts in rows for t in ts):
            raise DrafterError(f"{path}: expected finite, non-negative seconds in every row")
        # as `measure` writes them; a profile written another way would otherwise extrapolate
        # a dip into negative costs
        verify = {c: non_decreasing(ts) for c, ts in verify.items()}
        draft = {h: non_decreasing(ts) for h, ts in draft.items()}
        return cls(verify, draft, kind)

    @property
    def max_verify(self) -> int:
        """The most tokens every measured context has a verification cost for."""
        return min(len(row) for row in self.verify_seconds.values())

    def verify_cost(self, tokens: int, context: int) -> float:
        """Seconds to verify `tokens` rows at a context length, interpolated between the
        measured context lengths (clamped outside them); past the measured rows, extrapolated
        at the slope of the row's second half (prompt lookup verifies up to 32 rows: on the
        default pair 16 -> 32 rows cost 3.4 ms a row, 8 -> 16 rows 3.2 ms)."""
        contexts = sorted(self.verify_seconds)
        tokens = max(tokens, 1)
        i = bisect.bisect_left(contexts, context)
        if i == 0 or i == len(contexts):
            return _row_cost(self.verify_seconds[contexts[min(i, len(contexts) - 1)]], tokens)
        lo, hi = contexts[i - 1], contexts[i]
        w = (context - lo) / (hi - lo)
        a = _row_cost(self.verify_seconds[lo], tokens)
        b = _row_cost(self.verify_seconds[hi], tokens)
        return (1 - w) * a + w * b

    def draft_cost(self, tokens: int, head: str | None = None) -> float:
        row = self.draft_seconds.get(head or "", next(iter(self.draft_seconds.values())))
        if self.draft_kind == "block":
            return row[0]
        if tokens <= len(row):
            return row[tokens - 1]
        step = (row[-1] - row[0]) / max(len(row) - 1, 1)
        return row[-1] + step * (tokens - len(row))

    def round_cost(
        self, draft_length: int, context: int, head: str | None = None, *, verify_only: bool = False
    ) -> float:
        """Seconds for one round: draft K tokens, verify them with the anchor (K + 1 rows).
        verify_only: the drafts already exist."""
        cost = self.verify_cost(draft_length + 1, context)
        return cost if verify_only else cost + self.draft_cost(draft_length, head)

    def best_length(
        self,
        acceptance: list[float],
        context: int,
        *,
        head: str | None = None,
        verify_only: bool = False,
    ) -> int:
        """The draft length K maximising expected tokens per second, where acceptance[j] is the
        probability that draft j+1 is accepted given the ones before it were: E(K) = 1 +
        sum_k prod_{j<=k} acceptance[j] over `round_cost(K)`. K = 0 is a plain decoding step
        (one token for one one-token verification, nothing drafted): chosen when no draft length
        is expected to beat it."""
        best, best_rate, survive, expected = 0, 1 / self.verify_cost(1, context), 1.0, 1.0
        for k in range(1, len(acceptance) + 1):
            survive *= acceptance[k - 1]
            expected += survive
            cost = self.round_cost(k, context, head, verify_only=verify_only)
            if expected / cost > best_rate:
                best, best_rate = k, expected / cost
        return best

    def acceptance_needed(
        self, speedup: float, draft_length: int, context: int, *, head: str | None = None
    ) -> float | None:
        """The acceptance a, the same at every draft position, at which drafting `draft_length`
        tokens a round is `speedup` times as fast as plain decoding (one token per one-token
        verification); None when even a = 1 falls short. Tells whether a drafter can reach a
        speed-up on this machine before anyone trains one."""
        k = draft_length
        wanted = speedup * self.round_cost(k, context, head) / self.verify_cost(1, context)

        def expected(a: float) -> float:
            return sum(a**j for j in range(k + 1))

        if expected(1.0) < wanted:
            return None
        low, high = 0.0, 1.0
        for _ in range(50):
            middle = (low + high) / 2
            low, high = (middle, high) if expected(middle) < wanted else (low, middle)
        return high


def _row_cost(row: Sequence[float], tokens: int) -> float:
    """row[k - 1]: the cost of k rows; beyond the row, linear at the slope of its second half."""
    if tokens <= len(row):
        return row[tokens - 1]
    half = len(row) // 2
    slope = (row[-1] - row[half - 1]) / (len(row) - half) if half else 0.0
    return row[-1] + slope * (tokens - len(row))


def acceptance_needed_table(
    profile: LatencyProfile,
    context: int,
    *,
    head: str | None = None,
    speedups: Sequence[float] = (1.5, 2.0),
    max_length: int = 8,
) -> list[str]:
    """Printable rows of `LatencyProfile.acceptance_needed` for draft lengths 1..max_length
    ("-": out of reach at that length)."""
    lengths = range(1, min(max_length, profile.max_verify - 1) + 1)
    rows = ["speed-up " + "".join(f"{f'K={k}':>7}" for k in lengths)]
    for speedup in speedups:
        cells = []
        for k in lengths:
            needed = profile.acceptance_needed(speedup, k, context, head=head)
            cells.append(f"{'-' if needed is None else f'{needed:.2f}':>7}")
        rows.append(f"{f'{speedup:g}x':<8} " + "".join(cells))
    return rows


def timed_sweeps(
    runs: Sequence[Callable[[], None]],
    *,
    warmup: int = 2,
    repeats: int = 5,
    advance: Callable[[], None] = lambda: None,
) -> list[float]:
    """Median wall time of each run (each must synchronise) after warm-up, timed in `repeats`
    sweeps over all the runs in turn: a spell of a slower machine then raises every median a
    little rather than a few neighbouring ones a lot (which would bend the curve a policy reads).
    `advance` is called after each timing."""
    for run in runs:
        for _ in range(warmup):
            run()
    samples: list[list[float]] = [[] for _ in runs]
    for _ in range(repeats):
        for run, taken in zip(runs, samples, strict=True):
            start = time.perf_counter()
            run()
            taken.append(time.perf_counter() - start)
            advance()
    return [median(taken) for taken in samples]


def non_decreasing(values: Sequence[float]) -> list[float]:
    """The non-decreasing sequence closest to `values` in least squares (pool adjacent
    violators): verifying or drafting more tokens never costs less, so a dip is noise."""
    blocks: list[list[float]] = []  # [sum, count] of pooled neighbours
    for value in values:
        blocks.append([value, 1])
        while len(blocks) > 1 and blocks[-2][0] * blocks[-1][1] > blocks[-1][0] * blocks[-2][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(int(count))]


def write_profile(path: Path, data: dict) -> None:
    Path(path).write_text(json.dumps({"format": FORMAT, "version": 1, **data}, indent=2) + "\n")


def measure(
    target,
    drafters: dict[str, object],
    *,
    contexts: Sequence[int] = (64, 256, 1024),
    verify_lengths: Sequence[int] = tuple(range(1, MAX_VERIFY + 1)),
    max_draft: int = 8,
    repeats: int = 5,
    advance: Callable[[], None] = lambda: None,
) -> dict:
    """Median seconds to verify k = 1..max(verify_lengths) tokens at each context length (the
    lengths not in verify_lengths interpolated linearly between their timed neighbours), and to
    draft k tokens with each drafter (EAGLE-3: k chain steps after three new context rows, as in
    a round; block drafters: one block), each curve made non-decreasing in k. `advance` is
    called after each timing: repeats x (points measured) times."""
    import mlx.core as mx

    rng = np.random.default_rng(0)
    vocab = target.vocab_size
    verify: dict[str, list[float]] = {}
    context_taps = None
    for context in contexts:
        target.reset()
        logits, taps = target.forward(mx.array(rng.integers(0, vocab, context)))
        mx.eval(logits, taps)
        context_taps = taps
        runs = []
        for k in verify_lengths:
            tokens = mx.array(rng.integers(0, vocab, k))

            def verify_once(tokens=tokens, k=k):
                logits, taps = target.forward(tokens)
                mx.eval(logits, taps)
                target.rollback(k)

            runs.append(verify_once)
        timed = timed_sweeps(runs, repeats=repeats, advance=advance)
        every_length = np.arange(1, max(verify_lengths) + 1)
        row = np.interp(every_length, verify_lengths, timed).tolist()
        verify[str(context)] = non_decreasing(row)
    draft: dict[str, list[float]] = {}
    for label, drafter in drafters.items():
        drafter.reset()
        drafter.add_context(mx.array(rng.integers(0, vocab, context_taps.shape[0])), context_taps)
        new_rows = (mx.array(rng.integers(0, vocab, 3)), context_taps[-3:])
        lengths = (
            [drafter.num_drafts] if drafter.num_drafts is not None else range(1, max_draft + 1)
        )
        runs = [_drafting(drafter, k, new_rows) for k in lengths]
        draft[label] = non_decreasing(timed_sweeps(runs, repeats=repeats, advance=advance))
    kind = "block" if any(d.num_drafts is not None for d in drafters.values()) else "chain"
    return {"verify_seconds": verify, "draft_seconds": draft, "draft_kind": kind}


def _drafting(drafter, k: int, new_rows) -> Callable[[], None]:
    """One round's drafting: a chain drafter first takes a few new context rows, as it does
    after each verification; a block drafter drafts from the context it has."""
    import mlx.core as mx

    def run() -> None:
        if drafter.num_drafts is None:
            drafter.add_context(*new_rows)
        tokens, logits = drafter.propose(k, lambda row: mx.argmax(row, axis=-1))
        mx.eval(tokens, logits)

    return run


def counting_steps(total: int, progress: Callable[[int, int], None] | None) -> Callable[[], None]:
    """An `advance` for work of `total` steps that reports (done, total) to `progress`."""
    done = 0

    def advance() -> None:
        nonlocal done
        done += 1
        if progress:
            progress(done, total)

    return advance


def profile_cache_dir() -> Path:
    return cache_dir() / "latency"


def cached_profile(session, target: str, drafter: str, *, progress=None) -> Path:
    """The latency profile `--policy auto` / `confidence` use when given no file: measured once
    (context QUICK_CONTEXT, verifying QUICK_VERIFY tokens, drafting 1..QUICK_DRAFT tokens or
    one block with the session's own drafter and head) and kept in the user cache under a key
    of the machine facts (CPU, BLAS, threads, versions), the target and drafter paths with their
    modification times, the dtype and the head."""
    from woodcock.runtime.machine import machine_facts
    from woodcock.runtime.session import DrafterChoice

    dtype = session.dtype_name
    facts = machine_facts(dtype)
    blas = {k: v for k, v in facts.get("blas", {}).items() if k != "mapped"}  # import order
    key = {
        "machine": {**facts, "blas": blas},
        "target": _identity(target),
        "drafter": _identity(DrafterChoice.parse(drafter).source),
        "head": session.head_label,
        "measuring": MEASURING,
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()
    path = profile_cache_dir() / f"{digest[:20]}.json"
    if path.exists():
        try:
            LatencyProfile.load(path)
            return path
        except DrafterError:  # a damaged cache entry is measured again
            pass
    drafters = {session.head_label: session.drafter}
    block = session.drafter.num_drafts
    repeats = 3
    total = (len(QUICK_VERIFY) + (1 if block else QUICK_DRAFT)) * repeats
    profile = measure(
        session.target,
        drafters,
        contexts=(QUICK_CONTEXT,),
        verify_lengths=QUICK_VERIFY,
        max_draft=QUICK_DRAFT,
        repeats=repeats,
        advance=counting_steps(total, progress),
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    write_profile(
        partial, {"machine": facts, "target": target, "drafter": drafter, "dtype": dtype, **profile}
    )
    os.replace(partial, path)
    return path


def _identity(source: str) -> list:
    """A path with its modification time (a rewritten drafter gets a new profile); an id as is."""
    path = Path(source)
    return [str(path.resolve()), path.stat().st_mtime_ns] if path.exists() else [source]


def policy_with_profile(policy: str, session, target: str, drafter: str, *, progress=None) -> str:
    """`auto` / `confidence` given without a latency file: with this machine's cached profile for
    the pair (`cached_profile`, measured now, once, if there is none); any other policy as is."""
    if policy not in ("auto", "confidence"):
        return policy
    return f"{policy}:{cached_profile(session, target, drafter, progress=progress)}"


def measure_pair(
    target: str | None,
    drafter: str,
    out: Path,
    *,
    contexts: Sequence[int] = (64, 256, 1024),
    repeats: int = 5,
    dtype: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict:
    """`woodcock latency`: the pair's profile (`measure`) at these contexts, with the full head
    and every head size the drafter names (PATH@COUNTS:N1,N2), written to `out` with the machine
    facts; warns on stderr of the machine's slow paths. progress: (done, total) after each
    timing. -> what was written."""
    from woodcock.runtime.machine import machine_facts, warn_slow_paths
    from woodcock.runtime.session import open_session

    target, drafter = resolve_pair(target, drafter)
    session = open_session(target, drafter, dtype=dtype, many_heads=True)
    longest = session.target.context_length
    if longest is not None and max(contexts) + MAX_VERIFY > longest:
        raise DrafterError(
            f"--contexts {max(contexts)}: expected at most {longest - MAX_VERIFY} (the target's"
            f" context is {longest} tokens, and a verify adds up to {MAX_VERIFY})"
        )
    drafters = {"full": session.drafter_with_head(None)}
    for size in session.choice.head_sizes:
        drafters[str(size)] = session.drafter_with_head(size)
    per_drafter = 1 if session.spec.is_block else 8
    total = (len(contexts) * MAX_VERIFY + len(drafters) * per_drafter) * repeats
    profile = measure(
        session.target,
        drafters,
        contexts=contexts,
        repeats=repeats,
        advance=counting_steps(total, progress),
    )
    dtype_name = session.dtype_name
    facts = machine_facts(dtype_name)
    data = {
        "machine": facts,
        "backend": backend_report(),
        "target": target,
        "drafter": drafter,
        "dtype": dtype_name,
        **profile,
    }
    with staged_file(out) as temporary:
        write_profile(temporary, data)
    warn_slow_paths(facts)
    return data


def profile_summary(path: str | Path) -> str:
    """What `woodcock latency` prints about the profile it wrote: the cost of verifying and
    drafting at the first context measured, and the acceptance needed at every draft position."""
    data = read_json_object(Path(path))
    context, verify = next(iter(data["verify_seconds"].items()))
    draft = data["draft_seconds"]
    drafts = ", ".join(f"{label} {seconds[0] * 1e3:.1f} ms" for label, seconds in draft.items())
    head = next(iter(draft))
    lines = [
        f"wrote {path} ({describe_backend(data['backend'])}): verify 1 token"
        f" {verify[0] * 1e3:.1f} ms, 16 tokens"
        f" {verify[-1] * 1e3:.1f} ms (context {context}); draft {drafts}",
        f"acceptance needed at every draft position (context {context}, head {head}), against"
        " one-token steps:",
    ]
    table = acceptance_needed_table(LatencyProfile.load(path), int(context), head=head)
    return "\n".join(lines + ["  " + row for row in table])
