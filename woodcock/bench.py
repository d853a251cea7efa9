"""`woodcock bench`: plain mlx-lm decoding and woodcock on the same prompts, interleaved in one
process, with the outputs compared token for token (where they part, the first divergence
classified: woodcock.runtime.divergence) and the speed table per domain."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from woodcock.default_target import resolve_pair
from woodcock.errors import DrafterError
from woodcock.prompts import load_prompt_file, load_prompts
from woodcock.runtime.backend import describe as describe_backend
from woodcock.runtime.backend import report as backend_report
from woodcock.runtime.decode import Stats
from woodcock.runtime.divergence import classify
from woodcock.runtime.generate import encode_prompt, generate
from woodcock.runtime.latency import (
    LatencyProfile,
    cached_profile,
    counting_steps,
    policy_with_profile,
)
from woodcock.runtime.machine import machine_facts
from woodcock.runtime.policy import parse_policy
from woodcock.runtime.sampling import Sampling
from woodcock.runtime.session import open_session
from woodcock.staging import staged_file

# mlx-lm (which loads transformers) and matplotlib (an optional dependency) are imported where
# they are used: importing this module for its tables or `ideal_seconds` stays light.


@dataclass
class DomainResult:
    domain: str
    prompts: int = 0
    identical: int = 0
    ties: int = 0  # first divergence within the backend's measured rounding noise
    different: int = 0
    divergences: list[dict] = field(default_factory=list)
    baseline_tokens: int = 0
    baseline_seconds: float = 0.0
    woodcock_tokens: int = 0
    woodcock_seconds: float = 0.0
    # what the latency profile says the same tokens cost: plain steps, and woodcock's rounds
    ideal_baseline_seconds: float = 0.0
    ideal_woodcock_seconds: float = 0.0
    stats: Stats = field(default_factory=Stats)

    def add(self, other: DomainResult) -> None:
        self.prompts += other.prompts
        self.identical += other.identical
        self.ties += other.ties
        self.different += other.different
        self.divergences += other.divergences
        self.baseline_tokens += other.baseline_tokens
        self.baseline_seconds += other.baseline_seconds
        self.woodcock_tokens += other.woodcock_tokens
        self.woodcock_seconds += other.woodcock_seconds
        self.ideal_baseline_seconds += other.ideal_baseline_seconds
        self.ideal_woodcock_seconds += other.ideal_woodcock_seconds
        self.add_stats(other.stats)

    def add_stats(self, stats: Stats) -> None:
        self.stats.drafted += stats.drafted
        self.stats.accepted += stats.accepted
        self.stats.copied += stats.copied
        self.stats.extended += stats.extended
        self.stats.drafts_made += stats.drafts_made

    def row(self) -> dict:
        baseline = self.baseline_tokens / self.baseline_seconds if self.baseline_seconds else 0.0
        ours = self.woodcock_tokens / self.woodcock_seconds if self.woodcock_seconds else 0.0
        speedup = ours / baseline if baseline else 0.0
        ideal = (
            self.ideal_baseline_seconds / self.ideal_woodcock_seconds
            if self.ideal_woodcock_seconds
            else 0.0
        )
        return {
            "domain": self.domain,
            "prompts": self.prompts,
            "identical": self.identical,
            "ties": self.ties,
            "different": self.different,
            "baseline_tps": baseline,
            "woodcock_tps": ours,
            "speedup": speedup,
            "ideal_speedup": ideal,
            "measured_over_ideal": speedup / ideal if ideal else 0.0,
            "rounds": self.stats.rounds,
            "tokens_per_round": self.stats.tokens_per_round,
            "average_draft_length": self.stats.average_draft_length,
            "acceptance_by_position": self.stats.acceptance_by_position(),
            "copied_rounds": self.stats.copied_rounds,
            "copied_tokens_per_round": self.stats.copied_tokens_per_round,
            "extended_rounds": self.stats.extended_rounds,
            "divergences": self.divergences,
        }

    def compare(self, prompt_id: str, divergence) -> None:
        """Count one prompt's outputs as identical, a tie or different (a Divergence or None)."""
        if divergence is None:
            self.identical += 1
            return
        if divergence.tie:
            self.ties += 1
        else:
            self.different += 1
        self.divergences.append(
            {"domain": self.domain, "prompt": prompt_id, **divergence.as_dict()}
        )


def baseline_generate(
    model, tokenizer, prompt_ids: Sequence[int], max_tokens: int
) -> tuple[list[int], float]:
    """mlx-lm's own stream_generate, greedy: (tokens as plain decoding emits them, seconds spent
    generating after the prompt)."""
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    tokens, last = [], None
    for response in stream_generate(
        model, tokenizer, mx.array(prompt_ids), max_tokens=max_tokens, sampler=make_sampler(0.0)
    ):
        if last is not None:
            tokens.append(last.token)
        last = response
    if last is not None and last.finish_reason == "length":
        tokens.append(last.token)
    seconds = last.generation_tokens / last.generation_tps if last and last.generation_tps else 0.0
    return tokens, seconds


def ideal_seconds(
    stats: Stats, profile: LatencyProfile, head: str | None = None
) -> tuple[float, float]:
    """What the latency profile predicts for the tokens these rounds emitted: (plain decoding's
    seconds, one one-token step a token; the rounds' seconds, each its drafting, of every draft
    made, those a policy cut too, none for a copy, plus verifying its drafts and the anchor),
    every step priced at its context length."""
    plain = rounds = 0.0
    context = stats.prompt_tokens
    for drafted, accepted, made in zip(
        stats.drafted, stats.accepted, stats.drafts_made, strict=True
    ):
        rounds += profile.verify_cost(drafted + 1, context)
        if made:
            rounds += profile.draft_cost(made, head)
        plain += sum(profile.verify_cost(1, context + i) for i in range(accepted + 1))
        context += accepted + 1
    return plain, rounds


@dataclass
class BenchRun:
    """One way of decoding measured against the shared baseline: a session (target, drafter and
    prompt lookup or not), a policy, and the latency profile that prices its rounds."""

    drafter: str  # as the user named it
    policy: str
    session: object
    make_policy: Callable[[], object]
    profile: LatencyProfile

    @property
    def lookup(self) -> bool:
        return self.session.lookup is not None

    @property
    def label(self) -> str:
        return f"{self.drafter}, policy {self.policy}, {'with' if self.lookup else 'no'} lookup"


def bench_runs(
    target: str | None,
    drafters: Sequence[str | None],
    policies: Sequence[str],
    lookups: Sequence[bool],
    dtype: str | None,
    *,
    measuring: Callable[[int, int], None] | None = None,
) -> list[BenchRun]:
    """Every (drafter, policy, lookup) asked for, in that order, each a BenchRun; the target is
    loaded once and shared. A confidence policy is left out for a drafter without blocks.
    measuring: (done, total) while this machine's latency profile for a pair is measured."""
    runs, loaded, applied = [], None, set()
    for drafter in drafters:
        pair = resolve_pair(target, drafter)
        session = open_session(*pair, dtype=dtype, loaded=loaded)
        loaded = (session.model, session.tokenizer)
        name = drafter if drafter is not None else Path(pair[1]).name
        for policy in policies:
            if policy.partition(":")[0] == "confidence" and session.drafter.num_drafts is None:
                continue
            applied.add(policy)
            with_file = policy_with_profile(policy, session, *pair, progress=measuring)
            # the profile an adaptive policy decides with, else this machine's, prices the ideal
            kind, _, given_file = with_file.partition(":")
            adaptive = kind in ("auto", "confidence")
            profile = LatencyProfile.load(
                given_file if adaptive else cached_profile(session, *pair, progress=measuring)
            )

            def make_policy(text=with_file, session=session):
                return parse_policy(
                    text, session.drafter, prior=session.holdout_agreement, head=session.head_label
                )

            make_policy()  # a policy that cannot be built fails before any prompt runs
            for lookup in lookups:
                variant = session if lookup else dataclasses.replace(session, lookup=None)
                runs.append(BenchRun(name, policy, variant, make_policy, profile))
    for policy in policies:
        if policy not in applied:
            raise DrafterError(
                f"--policy {policy} is for block drafters (DFlash, DSpark): none of the drafters"
                " given is one"
            )
    return runs


def run_bench(
    runs: Sequence[BenchRun],
    prompts,
    *,
    max_tokens: int,
    chat: bool = True,
    progress: Callable[[], None] = lambda: None,
) -> list[list[DomainResult]]:
    """Prompt by prompt: plain decoding once (with the first run's target), then every run in
    turn, so a machine's drift reaches all of them alike. Each run keeps one policy object across
    all prompts (an adaptive policy keeps learning); its profile prices the rounds it made.
    -> the results by domain, one list per run."""
    policies = [run.make_policy() for run in runs]
    results: list[dict[str, DomainResult]] = [{} for _ in runs]
    first = runs[0].session
    for prompt in prompts:
        ids = encode_prompt(first.tokenizer, prompt.prompt, chat=chat)
        expected, baseline_seconds = baseline_generate(
            first.model, first.tokenizer, ids, max_tokens
        )
        for run, policy, by_domain in zip(runs, policies, results, strict=True):
            ours = generate(
                run.session, ids, max_tokens=max_tokens, policy=policy, sampling=Sampling()
            )
            result = by_domain.setdefault(prompt.domain, DomainResult(prompt.domain))
            result.prompts += 1
            result.compare(prompt.id, classify(run.session, ids, expected, ours.tokens, ours.stats))
            result.baseline_tokens += len(expected)
            result.baseline_seconds += baseline_seconds
            result.woodcock_tokens += len(ours.tokens)
            result.woodcock_seconds += ours.generation_seconds
            plain, rounds = ideal_seconds(ours.stats, run.profile, run.session.head_label)
            result.ideal_baseline_seconds += plain
            result.ideal_woodcock_seconds += rounds
            result.add_stats(ours.stats)
            progress()
    return [list(by_domain.values()) for by_domain in results]


def summary_rows(results: list[DomainResult]) -> list[dict]:
    total = DomainResult("all")
    for result in results:
        total.add(result)
    return [r.row() for r in results] + [total.row()]


def render_table(rows: list[dict]) -> str:
    header = (
        f"{'domain':<14}{'prompts':>8}{'baseline tok/s':>16}{'woodcock tok/s':>16}{'speedup':>9}"
        f"{'ideal':>8}{'of ideal':>10}{'tok/round':>11}{'avg K':>7}{'copied':>8}"
        "  acceptance by position (drafter)"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        acceptance = " ".join(f"{a:.2f}" for a in row["acceptance_by_position"])
        copied = row["copied_rounds"] / row["rounds"] if row["rounds"] else 0.0
        lines.append(
            f"{row['domain']:<14}{row['prompts']:>8}{row['baseline_tps']:>16.1f}"
            f"{row['woodcock_tps']:>16.1f}{row['speedup']:>8.2f}x{row['ideal_speedup']:>7.2f}x"
            f"{row['measured_over_ideal']:>10.0%}{row['tokens_per_round']:>11.2f}"
            f"{row['average_draft_length']:>7.2f}{copied:>8.0%}  {acceptance}"
        )
    total = rows[-1]
    verdict = (
        f"greedy outputs identical to plain mlx-lm decoding on {total['identical']} of"
        f" {total['prompts']} prompts"
    )
    if total["identical"] != total["prompts"]:
        verdict += (
            f"; {total['ties']} ties (the first divergence within the backend's measured rounding"
            f" noise), {total['different']} DIFFERENT"
        )
    lines.append(verdict)
    lines += [divergence_line(d) for d in total["divergences"]]
    return "\n".join(lines)


def divergence_line(d: dict) -> str:
    """One prompt's first divergence (`Divergence.as_dict` with its domain and prompt id)."""
    return (
        f"  {d['domain']} prompt {d['prompt']}: first divergence at token {d['position']}, plain"
        f" {d['plain_token']} / woodcock {d['woodcock_token']}; margin {d['one_row_margin']:.3g}"
        f" on the one-row path, {d['verify_margin']:.3g} in the {d['verify_rows']}-row verify;"
        f" noise {d['noise']:.3g}: {d['kind'] if d['kind'] == 'tie' else 'DIFFERENT'}"
    )


def render_comparison(labelled: Sequence[tuple[str, list[dict]]]) -> str:
    """Every run's all-domain row, one line each, in the order they ran."""
    width = max(len(label) for label, _ in labelled) + 2
    header = (
        f"{'run':<{width}}{'woodcock tok/s':>15}{'speedup':>9}{'ideal':>8}{'of ideal':>10}"
        f"{'tok/round':>11}{'identical':>11}"
    )
    lines = [header, "-" * len(header)]
    for label, rows in labelled:
        total = rows[-1]
        lines.append(
            f"{label:<{width}}{total['woodcock_tps']:>15.1f}{total['speedup']:>8.2f}x"
            f"{total['ideal_speedup']:>7.2f}x{total['measured_over_ideal']:>10.0%}"
            f"{total['tokens_per_round']:>11.2f}{total['identical']:>7} / {total['prompts']}"
        )
    return "\n".join(lines)


TABLE_NOTES = (
    "ideal: the speed-up this machine's latency profile predicts for these rounds (drafting and"
    " verifying at the measured cost, plain decoding at one-token steps); of ideal: measured /"
    " ideal\n"
    "copied: share of rounds that copied from the context (prompt lookup) instead of drafting\n"
    "acceptance by position j: of the drafter's rounds that drafted at least j tokens, the share"
    " whose first j were all accepted (not given the first j-1 were)"
)


def write_chart(labelled: Sequence[tuple[str, list[dict]]], path: str) -> None:
    """One PNG: acceptance by draft position over all domains, one line per run, and the speed-up
    by domain, one bar per run."""
    plt = _pyplot()
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(labelled)
    for index, (label, rows) in enumerate(labelled):
        rates = rows[-1]["acceptance_by_position"]
        left.plot(range(1, len(rates) + 1), rates, marker="o", label=label)
        positions = [i + (index - (len(labelled) - 1) / 2) * width for i in range(len(rows))]
        right.bar(positions, [r["speedup"] for r in rows], width, label=label)
    domains = [r["domain"] for r in labelled[0][1]]
    left.set(
        xlabel="draft position", ylabel="acceptance", ylim=(0, 1), title="Acceptance by position"
    )
    left.legend(fontsize="small")
    right.set_xticks(range(len(domains)), domains)
    right.axhline(1.0, color="gray", linewidth=0.8)
    right.set(ylabel="speedup vs mlx-lm", title="Speedup by domain")
    figure.tight_layout()
    with staged_file(Path(path)) as temporary:
        figure.savefig(temporary, dpi=120, format="png")
    plt.close(figure)


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise DrafterError("--chart needs matplotlib: pip install 'woodcock[bench]'") from None
    return plt


@dataclass(frozen=True)
class BenchReport:
    """What `woodcock bench` prints: every run's rows by domain (the last one all domains), in
    the order the runs were measured."""

    max_tokens: int
    runs: list[BenchRun]
    labelled: list[tuple[str, list[dict]]]  # (run label, summary rows), one a run
    machine: dict

    backend: dict  # woodcock.runtime.backend.report()

    @property
    def identical(self) -> bool:
        """Every run's greedy output was plain decoding's on every prompt."""
        return all(rows[-1]["identical"] == rows[-1]["prompts"] for _, rows in self.labelled)

    @property
    def different(self) -> int:
        """Prompts, over all runs, whose first divergence is not a rounding tie."""
        return sum(rows[-1]["different"] for _, rows in self.labelled)

    def as_json(self) -> dict:
        return {
            "max_tokens": self.max_tokens,
            "runs": [
                {"drafter": run.drafter, "policy": run.policy, "lookup": run.lookup, "rows": rows}
                for run, (_, rows) in zip(self.runs, self.labelled, strict=True)
            ],
            "machine": self.machine,
            "backend": self.backend,
        }

    def render_text(self) -> str:
        parts = [f"{label}\n{render_table(rows)}\n" for label, rows in self.labelled]
        if len(self.runs) > 1:
            baseline = self.labelled[0][1][-1]["baseline_tps"]
            parts.append(f"plain mlx-lm decoding: {baseline:.1f} tok/s")
            parts.append(render_comparison(self.labelled) + "\n")
        facts = self.machine
        blas = (facts.get("blas") or {}).get("library") or "unknown"
        threads = facts.get("openblas_num_threads") if blas == "openblas" else None
        parts.append(TABLE_NOTES)
        parts.append(
            f"{self.max_tokens} new tokens, greedy, batch 1; {describe_backend(self.backend)},"
            f" BLAS {blas}"
            + (f" on {threads} threads" if threads else "")
        )
        return "\n".join(parts)


def benchmark(
    target: str | None,
    drafters: Sequence[str | None] = (None,),
    policies: Sequence[str] = ("auto",),
    *,
    domains: Sequence[str] | None = None,
    prompt_file: str | Path | None = None,
    prompts: int = 10,
    max_tokens: int = 256,
    chat: bool = True,
    dtype: str | None = None,
    lookup: bool = True,
    compare_lookup: bool = False,
    chart: str | Path | None = None,
    measuring: Callable[[int, int], None] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> BenchReport:
    """`woodcock bench`: up to `prompts` prompts of each domain (the shipped sets, or the JSONL
    `prompt_file`), each decoded plainly and then by every drafter, policy and lookup setting
    (both when compare_lookup); a PNG chart too when `chart` names one. measuring: (done, total)
    while a latency profile is measured; progress: (done, total) after each prompt's run."""
    if compare_lookup and not lookup:
        raise DrafterError("--compare-lookup runs with prompt lookup and without: drop --no-lookup")
    if chart is not None:
        _pyplot()  # before the measuring, which a missing matplotlib would waste
    if prompt_file is not None:
        selected = load_prompt_file(prompt_file, domains, limit_per_domain=prompts)
    else:
        selected = load_prompts(domains, limit_per_domain=prompts)
    lookups = (True, False) if compare_lookup else (lookup,)
    runs = bench_runs(target, drafters, policies, lookups, dtype, measuring=measuring)
    advance = counting_steps(len(selected) * len(runs), progress)
    results = run_bench(runs, selected, max_tokens=max_tokens, chat=chat, progress=advance)
    labelled = [
        (run.label, summary_rows(result)) for run, result in zip(runs, results, strict=True)
    ]
    if chart is not None:
        write_chart(labelled, str(chart))
    return BenchReport(
        max_tokens, runs, labelled, machine_facts(runs[0].session.dtype_name), backend_report()
    )
