"""`woodcock generate`: one prompt through a target and drafter pair, and the report the command
prints (JSON fields, or a few lines of text after the streamed output)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx

from woodcock.default_target import resolve_pair
from woodcock.runtime.backend import describe as describe_backend
from woodcock.runtime.backend import report as backend_report
from woodcock.runtime.generate import Generation, check_context_room, encode_prompt, generate
from woodcock.runtime.latency import policy_with_profile
from woodcock.runtime.machine import machine_facts, warn_slow_paths
from woodcock.runtime.policy import parse_policy
from woodcock.runtime.sampling import Sampling
from woodcock.runtime.session import open_session


@dataclass(frozen=True)
class GenerationReport:
    fields: dict  # what --json prints
    lookup: bool  # prompt lookup was on: the text says what it copied

    def render_text(self) -> str:
        report = self.fields
        acceptance = " ".join(f"{rate:.2f}" for rate in report["acceptance_by_position"])
        acceptance = acceptance or "- (plain decoding: no round drafted)"
        copied = (
            f"\nprompt lookup: {report['copied_rounds']} rounds copied from the context,"
            f" {report['copied_tokens_per_round']:.2f} tokens each; {report['extended_rounds']}"
            " drafter rounds extended by a copy"
            if self.lookup
            else ""
        )
        drafted = report["draft_lengths"]
        more = " ..." if report["rounds"] > 32 else ""
        return (
            "\n"
            + "=" * 10
            + f"\nprompt: {report['prompt_tokens']} tokens,"
            f" {report['prompt_tps']:.1f} tokens-per-sec"
            f"\ngeneration: {report['generation_tokens']} tokens,"
            f" {report['generation_tps']:.1f} tokens-per-sec"
            f"\ntokens per round: {report['tokens_per_round']:.2f} over {report['rounds']} rounds"
            f" (draft {report['draft_seconds']:.2f} s, verify {report['verify_seconds']:.2f} s)"
            f"\nacceptance by position: {acceptance}{copied}"
            f"\ndraft length ({report['policy']}): {report['average_draft_length']:.2f} on"
            f" average; per round {' '.join(map(str, drafted[:32]))}{more}"
            f"\npeak memory: {report['peak_memory_gb']:.3f} GB"
            f"\nbackend: {describe_backend(report['backend'])}"
        )


def generation_fields(result: Generation, policy: str) -> dict:
    """The JSON report of one generation: its text, speed, rounds and acceptance."""
    stats = result.stats
    return {
        "text": result.text,
        "finish_reason": result.finish_reason,
        "prompt_tokens": result.prompt_tokens,
        "prompt_tps": result.prompt_tps,
        "generation_tokens": len(result.tokens),
        "generation_tps": result.generation_tps,
        "rounds": stats.rounds,
        "tokens_per_round": stats.tokens_per_round,
        "acceptance_by_position": stats.acceptance_by_position(),
        "copied_rounds": stats.copied_rounds,
        "copied_tokens_per_round": stats.copied_tokens_per_round,
        "extended_rounds": stats.extended_rounds,
        "policy": policy,
        "average_draft_length": stats.average_draft_length,
        "draft_lengths": stats.drafted,
        "draft_seconds": stats.draft_seconds,
        "verify_seconds": stats.verify_seconds,
        "peak_memory_gb": result.peak_memory_gb,
        "backend": backend_report(),
    }


def generate_report(
    target: str | None,
    drafter: str | None,
    prompt: str,
    *,
    policy: str = "auto",
    max_tokens: int = 256,
    chat: bool = True,
    system: str | None = None,
    temperature: float = 0.0,
    top_p: float = 0.0,
    top_k: int = 0,
    min_p: float = 0.0,
    seed: int | None = None,
    stop: Sequence[str] = (),
    dtype: str | None = None,
    lookup: bool = True,
    on_text: Callable[[str], None] | None = None,
    measuring: Callable[[int, int], None] | None = None,
) -> GenerationReport:
    """Open the pair (None: the default target and its shipped drafter), decode `prompt` and
    report. on_text: each new piece of text as it is final. measuring: (done, total) while this
    machine's latency profile for `auto` / `confidence` is measured, the first time only."""
    sampling = Sampling(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)
    if seed is not None:
        mx.random.seed(seed)
    pair = resolve_pair(target, drafter)
    session = open_session(*pair, dtype=dtype, lookup=lookup)
    # before any token, so that a user watching a slow stream knows why at once
    warn_slow_paths(machine_facts(session.dtype_name))
    policy = policy_with_profile(policy, session, *pair, progress=measuring)
    chosen_policy = parse_policy(
        policy, session.drafter, prior=session.holdout_agreement, head=session.head_label
    )
    ids = encode_prompt(session.tokenizer, prompt, chat=chat, system=system)
    check_context_room(session, len(ids), max_tokens, f"--max-tokens {max_tokens}")
    result = generate(
        session,
        ids,
        max_tokens=max_tokens,
        policy=chosen_policy,
        sampling=sampling,
        stop=stop,
        on_text=on_text,
    )
    return GenerationReport(generation_fields(result, policy), lookup=session.lookup is not None)
