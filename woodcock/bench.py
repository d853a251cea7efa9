"""`woodcock bench`: plain mlx-lm decoding and woodcock on the same prompts, interleaved in one
process, with the outputs compared token for token and the speed table per domain."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from woodcock.runtime.decode import Stats
from woodcock.runtime.generate import encode_prompt, generate
from woodcock.runtime.latency import LatencyProfile
from woodcock.runtime.sampling import Sampling


@dataclass
class DomainResult:
    domain: str
    prompts: int = 0
    identical: int = 0
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
        }


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
    seconds, one one-token step a token; the rounds' seconds, each its drafting, none for a copy,
    plus verifying its drafts and the anchor), every step priced at its context length."""
    plain = rounds = 0.0
    context = stats.prompt_tokens
    for drafted, accepted, copied, extended in zip(
        stats.drafted, stats.accepted, stats.copied, stats.extended, strict=True
    ):
        own_drafts = 0 if copied else drafted - extended
        rounds += profile.verify_cost(drafted + 1, context)
        if own_drafts:
            rounds += profile.draft_cost(own_drafts, head)
        plain += sum(profile.verify_cost(1, context + i) for i in range(accepted + 1))
        context += accepted + 1
    return plain, rounds


def run_bench(
    session,
    prompts,
    *,
    policy_factory: Callable[[], object],
    profile: LatencyProfile,
    max_tokens: int,
    chat: bool = True,
    progress: Callable[[], None] = lambda: None,
) -> list[DomainResult]:
    """One policy object across all prompts (an adaptive policy keeps learning), prompts in the
    given order, baseline then woodcock for each; `profile` prices the rounds each run made."""
    policy = policy_factory()
    results: dict[str, DomainResult] = {}
    for prompt in prompts:
        ids = encode_prompt(session.tokenizer, prompt.prompt, chat=chat)
        expected, baseline_seconds = baseline_generate(
            session.model, session.tokenizer, ids, max_tokens
        )
        ours = generate(session, ids, max_tokens=max_tokens, policy=policy, sampling=Sampling())
        result = results.setdefault(prompt.domain, DomainResult(prompt.domain))
        result.prompts += 1
        result.identical += ours.tokens == expected
        result.baseline_tokens += len(expected)
        result.baseline_seconds += baseline_seconds
        result.woodcock_tokens += len(ours.tokens)
        result.woodcock_seconds += ours.generation_seconds
        plain, rounds = ideal_seconds(ours.stats, profile, session.head_label)
        result.ideal_baseline_seconds += plain
        result.ideal_woodcock_seconds += rounds
        result.add_stats(ours.stats)
        progress()
    return list(results.values())


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
    verdict = "identical" if total["identical"] == total["prompts"] else "DIFFERENT"
    lines.append(
        "ideal: the speed-up this machine's latency profile predicts for these rounds (drafting"
        " and verifying at the measured cost, plain decoding at one-token steps); of ideal:"
        " measured / ideal"
    )
    lines.append(
        "copied: share of rounds that copied from the context (prompt lookup) instead of drafting"
    )
    lines.append(
        f"greedy outputs {verdict} to plain mlx-lm decoding on {total['identical']} of"
        f" {total['prompts']} prompts"
    )
    return "\n".join(lines)


def write_chart(rows: list[dict], path: str) -> None:
    """Acceptance by position per domain, and speedup by domain, as one PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from woodcock.errors import DrafterError

        raise DrafterError("--chart needs matplotlib: pip install 'woodcock[bench]'") from None
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for row in rows:
        rates = row["acceptance_by_position"]
        left.plot(range(1, len(rates) + 1), rates, marker="o", label=row["domain"])
    left.set(
        xlabel="draft position", ylabel="acceptance", ylim=(0, 1), title="Acceptance by position"
    )
    left.legend()
    right.bar([r["domain"] for r in rows], [r["speedup"] for r in rows])
    right.axhline(1.0, color="gray", linewidth=0.8)
    right.set(ylabel="speedup vs mlx-lm", title="Speedup by domain")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
