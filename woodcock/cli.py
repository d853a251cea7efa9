"""The `woodcock` command. Errors: one line on stderr and exit code 2; --debug shows tracebacks."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from woodcock import __version__
from woodcock.cli_options import DefaultableTarget, MaxTokens, parse_taps
from woodcock.default_target import resolve_pair
from woodcock.errors import DrafterError
from woodcock.runtime.backend import configure_tf32
from woodcock.runtime.backend import describe as describe_backend
from woodcock.runtime.backend import report as backend_report
from woodcock.train.cli import app as training_app
from woodcock.vocab_count import app as vocab_app

app = typer.Typer(
    name="woodcock",
    help="Portable speculative-decoding drafters: inspect, convert and run them.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
_debug = False
app.add_typer(training_app)  # distill, train
app.add_typer(vocab_app, name="vocab")


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"woodcock {__version__}")
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_print_version, is_eager=True, help="Print the version."
        ),
    ] = False,
    debug: Annotated[
        bool, typer.Option("--debug", help="Show Python tracebacks on errors.")
    ] = False,
) -> None:
    global _debug
    _debug = debug


@app.command()
def inspect(
    path: Annotated[str, typer.Argument(help="Drafter directory or Hugging Face id.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")] = False,
    taps: Annotated[
        str | None,
        typer.Option(
            "--taps", help="Canonical tap ids, for formats that do not record them (SafeAILab)."
        ),
    ] = None,
) -> None:
    """Describe a drafter: format, algorithm, taps in both conventions, fusion, layers, head,
    vocabulary, parameters, dtypes and warnings."""
    from woodcock.inspection import describe, render_text

    report = describe(path, taps=parse_taps(taps))
    typer.echo(json.dumps(report, indent=2) if as_json else render_text(report))


@app.command()
def convert(
    source: Annotated[str, typer.Argument(help="Drafter directory or Hugging Face id.")],
    dest: Annotated[str, typer.Argument(help="Output directory (must not exist, or --force).")],
    to: Annotated[
        str,
        typer.Option(
            "--to",
            help="Output format: woodcock, speculators, safeailab, specforge, zlab-dflash,"
            " deepspec-dspark or specforge-dspark.",
        ),
    ],
    source_format: Annotated[
        str | None, typer.Option("--from", help="Input format (default: detected).")
    ] = None,
    target: Annotated[
        str | None,
        typer.Option(
            "--target",
            help="Target model directory or id: records its facts, checks the taps and copies in"
            " the tensors the drafter shares with it (unless the output format always takes"
            " them from the target: zlab-dflash, specforge-dspark).",
        ),
    ] = None,
    dtype: Annotated[
        str | None, typer.Option("--dtype", help="Cast weights: float32, bfloat16 or float16.")
    ] = None,
    taps: Annotated[
        str | None,
        typer.Option(
            "--taps",
            help="Tapped target layers, canonical ids (residual stream after L layers), for"
            " sources that do not record them.",
        ),
    ] = None,
    truncate_vocab: Annotated[
        int | None,
        typer.Option(
            "--truncate-vocab",
            min=1,
            help="Keep the draft-head rows of the N most frequent tokens (by --counts, else the"
            " drafter's own counts).",
        ),
    ] = None,
    counts: Annotated[
        str | None,
        typer.Option(
            "--counts",
            help="Token counts (vocab_counts.npz from `woodcock vocab count`): for"
            " --truncate-vocab, or alone to record them with the drafter.",
        ),
    ] = None,
    expand_vocab: Annotated[
        bool,
        typer.Option(
            "--expand-vocab",
            help="Make a reduced draft vocabulary full (missing tokens get zero head rows).",
        ),
    ] = False,
    target_name: Annotated[
        str | None,
        typer.Option("--target-name", help="Record this as the target's name or id."),
    ] = None,
    dry_run: Annotated[
        bool,
        typer.Option("--dry-run", help="Print what would be written and write nothing."),
    ] = False,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing output.")] = False,
) -> None:
    """Convert a drafter between formats, losslessly or with an error saying why not."""
    from woodcock.conversion import convert as run_convert

    conversion = run_convert(
        source,
        dest,
        to=to,
        source_format=source_format,
        target=target,
        dtype=dtype,
        taps=parse_taps(taps),
        truncate_vocab=truncate_vocab,
        counts=counts,
        expand_vocab=expand_vocab,
        target_name=target_name,
        dry_run=dry_run,
        force=force,
    )
    typer.echo(conversion.summary())


@app.command()
def parity(
    path: Annotated[str, typer.Argument(help="Drafter directory or Hugging Face id.")],
    target: Annotated[
        str | None,
        typer.Option(
            "--target",
            help="Target model directory or id, for the tensors the drafter shares with it"
            " (required when it shares any).",
        ),
    ] = None,
    steps: Annotated[
        int, typer.Option("--steps", min=1, help="Greedy chain steps to compare.")
    ] = 4,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")] = False,
) -> None:
    """Check the MLX runtime against the torch reference on random inputs (fp32): max |diff| of
    every intermediate tensor and every step's logits, and the greedy tokens. Exit code 1 when a
    difference exceeds the tolerance (1e-4) or the tokens differ."""
    from woodcock.loading import load_drafter
    from woodcock.runtime.parity import parity as run_parity
    from woodcock.runtime.parity import render_text
    from woodcock.target_checkpoint import load_target_tensors

    drafter = load_drafter(path)
    tensors = load_target_tensors(target) if target is not None else None
    report = run_parity(drafter, tensors, steps=steps)
    typer.echo(json.dumps(report, indent=2) if as_json else render_text(report))
    if not report["ok"]:
        raise typer.Exit(1)


@app.command()
def doctor(
    drafter: Annotated[
        str, typer.Option("--drafter", help="Drafter directory or Hugging Face id.")
    ],
    target: DefaultableTarget = None,
    taps: Annotated[
        str | None,
        typer.Option(
            "--taps",
            help="Canonical tap ids to use instead of the drafter's own (tests a suspected"
            " off-by-one before re-converting).",
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")] = False,
) -> None:
    """Check a drafter against its target without a benchmark: shapes, taps, the embedding and
    head it copies, its vocabulary map, RoPE and norms, and teacher-forced agreement by draft
    step on a few built-in prompts, with the likely causes when it looks mis-converted. Exit
    code 1 when anything is found."""
    from rich.console import Console

    from woodcock.doctor import diagnose, render_text

    target, drafter = resolve_pair(target, drafter)
    with Console(stderr=True).status("doctor") as status:
        report = diagnose(
            target, drafter, taps=parse_taps(taps), progress=lambda step: status.update(step)
        )
    typer.echo(json.dumps(report, indent=2) if as_json else render_text(report))
    if report["exit_code"]:
        raise typer.Exit(report["exit_code"])


LookupOption = Annotated[
    bool,
    typer.Option(
        "--lookup/--no-lookup",
        help="Rounds whose last tokens occurred before copy what followed them (prompt lookup)"
        " instead of asking the drafter.",
    ),
]


AllowTf32 = Annotated[
    bool,
    typer.Option(
        "--allow-tf32",
        help="Let MLX's GPU backends multiply fp32 matrices in TF32: faster, but a verify of"
        " several rows may then round a near tie apart from plain decoding's one-row step.",
    ),
]


@app.command()
def generate(
    drafter: Annotated[
        str | None,
        typer.Option(
            "--drafter",
            help="Drafter directory or id; PATH@N keeps the N most frequent tokens' head rows"
            " (by the drafter's token counts), PATH@COUNTS:N by a vocab_counts.npz; 'ngram' for"
            " prompt lookup (default: the shipped drafter of the default target).",
        ),
    ] = None,
    target: DefaultableTarget = None,
    prompt: Annotated[
        str | None, typer.Option("--prompt", help="Prompt text ('-': stdin).")
    ] = None,
    prompt_file: Annotated[
        Path | None, typer.Option("--prompt-file", help="Read the prompt from a file.")
    ] = None,
    chat: Annotated[bool, typer.Option("--chat/--no-chat", help="Apply the chat template.")] = True,
    system: Annotated[str | None, typer.Option("--system", help="System prompt (chat).")] = None,
    policy: Annotated[
        str,
        typer.Option(
            "--policy",
            help="Draft length: fixed:K, auto[:latency.json] (chain drafters) or"
            " confidence[:latency.json] (block drafters with a confidence head); without a"
            " file, a short profile is measured once and kept in the user cache.",
        ),
    ] = "auto",
    max_tokens: MaxTokens = 256,
    temp: Annotated[
        float, typer.Option("--temp", min=0.0, help="Sampling temperature; 0 = greedy.")
    ] = 0.0,
    top_p: Annotated[
        float, typer.Option("--top-p", min=0.0, max=1.0, help="Nucleus mass; 0 = off.")
    ] = 0.0,
    top_k: Annotated[int, typer.Option("--top-k", min=0, help="Top-k; 0 = off.")] = 0,
    min_p: Annotated[
        float, typer.Option("--min-p", min=0.0, max=1.0, help="Min-p; 0 = off.")
    ] = 0.0,
    seed: Annotated[
        int | None, typer.Option("--seed", min=0, help="Random seed for sampling.")
    ] = None,
    stop: Annotated[
        list[str] | None, typer.Option("--stop", help="Stop string (repeatable).")
    ] = None,
    dtype: Annotated[
        str | None,
        typer.Option("--dtype", help="float32 (default on CPU), bfloat16 or float16."),
    ] = None,
    lookup: LookupOption = True,
    allow_tf32: AllowTf32 = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object at the end.")
    ] = False,
) -> None:
    """Generate with speculative decoding: greedy output is token for token the target's own;
    sampling follows the target's distribution exactly."""
    configure_tf32(allow_tf32)
    import mlx.core as mx

    from woodcock.runtime.generate import encode_prompt
    from woodcock.runtime.generate import generate as run_generate
    from woodcock.runtime.machine import machine_facts, warn_slow_paths
    from woodcock.runtime.policy import parse_policy
    from woodcock.runtime.sampling import Sampling
    from woodcock.runtime.session import open_session

    if (prompt is None) == (prompt_file is None):
        raise DrafterError("give exactly one of --prompt and --prompt-file")
    if prompt_file is not None:
        try:
            text = prompt_file.read_text(encoding="utf-8")
        except OSError as e:
            raise DrafterError(f"{prompt_file}: cannot be read ({e.strerror})") from None
    else:
        text = sys.stdin.read() if prompt == "-" else prompt
    sampling = Sampling(temperature=temp, top_p=top_p, top_k=top_k, min_p=min_p)
    if seed is not None:
        mx.random.seed(seed)
    pair = resolve_pair(target, drafter)
    session = open_session(*pair, dtype=dtype, lookup=lookup)
    # before any token, so that a user watching a slow stream knows why at once
    warn_slow_paths(machine_facts(session.dtype_name))
    policy = _with_latency_file(policy, session, *pair)
    chosen_policy = parse_policy(
        policy, session.drafter, prior=session.holdout_agreement, head=session.head_label
    )
    ids = encode_prompt(session.tokenizer, text, chat=chat, system=system)

    def show(segment: str) -> None:
        print(segment, end="", flush=True)

    result = run_generate(
        session,
        ids,
        max_tokens=max_tokens,
        policy=chosen_policy,
        sampling=sampling,
        stop=stop or (),
        on_text=None if as_json else show,
    )
    stats = result.stats
    report = {
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
    if as_json:
        typer.echo(json.dumps(report, indent=2))
        return
    acceptance = " ".join(f"{rate:.2f}" for rate in report["acceptance_by_position"])
    acceptance = acceptance or "- (plain decoding: no round drafted)"
    copied = (
        f"\nprompt lookup: {stats.copied_rounds} rounds copied from the context,"
        f" {stats.copied_tokens_per_round:.2f} tokens each; {stats.extended_rounds} drafter"
        " rounds extended by a copy"
        if session.lookup is not None
        else ""
    )
    typer.echo(
        "\n"
        + "=" * 10
        + f"\nprompt: {result.prompt_tokens} tokens, {result.prompt_tps:.1f} tokens-per-sec"
        f"\ngeneration: {len(result.tokens)} tokens, {result.generation_tps:.1f} tokens-per-sec"
        f"\ntokens per round: {stats.tokens_per_round:.2f} over {stats.rounds} rounds"
        f" (draft {stats.draft_seconds:.2f} s, verify {stats.verify_seconds:.2f} s)"
        f"\nacceptance by position: {acceptance}{copied}"
        f"\ndraft length ({policy}): {stats.average_draft_length:.2f} on average;"
        f" per round {' '.join(map(str, stats.drafted[:32]))}{' ...' if stats.rounds > 32 else ''}"
        f"\npeak memory: {result.peak_memory_gb:.3f} GB"
        f"\nbackend: {describe_backend(report['backend'])}"
    )


@app.command()
def latency(
    drafter: Annotated[
        str,
        typer.Option("--drafter", help="Drafter; PATH@COUNTS:N1,N2 also measures truncated heads."),
    ],
    out: Annotated[Path, typer.Option("--out", help="Where to write latency.json.")],
    target: DefaultableTarget = None,
    contexts: Annotated[
        str, typer.Option("--contexts", help="Context lengths to measure at.")
    ] = "64,256,1024",
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Timed runs per point.")] = 5,
    dtype: Annotated[str | None, typer.Option("--dtype")] = None,
    allow_tf32: AllowTf32 = False,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing file.")] = False,
) -> None:
    """Measure this machine: the cost of drafting (per head size) and of verifying k = 1..16
    tokens at a few context lengths, for the auto and confidence policies."""
    configure_tf32(allow_tf32)
    from rich.progress import Progress

    from woodcock.runtime.latency import (
        MAX_VERIFY,
        LatencyProfile,
        acceptance_needed_table,
        measure,
        write_profile,
    )
    from woodcock.runtime.machine import machine_facts, warn_slow_paths
    from woodcock.runtime.session import open_session

    if out.exists() and not force:
        raise DrafterError(f"{out}: already exists; pass --force to replace it")
    try:
        lengths = [int(c) for c in contexts.split(",")]
    except ValueError:
        lengths = [0]
    if min(lengths) < 1:
        raise DrafterError(
            f"--contexts {contexts!r}: expected comma-separated lengths of at least 1"
        )
    target, drafter = resolve_pair(target, drafter)
    session = open_session(target, drafter, dtype=dtype, many_heads=True)
    drafters = {"full": session.drafter_with_head(None)}
    for size in session.choice.head_sizes:
        drafters[str(size)] = session.drafter_with_head(size)
    per_drafter = 1 if session.spec.is_block else 8
    total = (len(lengths) * MAX_VERIFY + len(drafters) * per_drafter) * repeats
    with Progress(transient=True) as progress:
        task = progress.add_task("measuring", total=total)
        profile = measure(
            session.target,
            drafters,
            contexts=lengths,
            repeats=repeats,
            advance=lambda: progress.advance(task),
        )
    dtype_name = session.dtype_name
    facts = machine_facts(dtype_name)
    write_profile(
        out,
        {
            "machine": facts,
            "backend": backend_report(),
            "target": target,
            "drafter": drafter,
            "dtype": dtype_name,
            **profile,
        },
    )
    warn_slow_paths(facts)
    verify = profile["verify_seconds"][str(lengths[0])]
    typer.echo(
        f"wrote {out} ({describe_backend(backend_report())}): verify 1 token"
        f" {verify[0] * 1e3:.1f} ms, 16 tokens {verify[-1] * 1e3:.1f} ms"
        f" (context {lengths[0]}); draft "
        + ", ".join(
            f"{label} {ts[0] * 1e3:.1f} ms" for label, ts in profile["draft_seconds"].items()
        )
    )
    head = next(iter(profile["draft_seconds"]))
    typer.echo(
        f"acceptance needed at every draft position (context {lengths[0]}, head {head}), against"
        " one-token steps:"
    )
    for row in acceptance_needed_table(LatencyProfile.load(out), lengths[0], head=head):
        typer.echo("  " + row)


@app.command()
def bench(
    drafters: Annotated[
        list[str] | None,
        typer.Option(
            "--drafter",
            help="Drafter (as for generate); give it more than once to compare drafters in one"
            " run.",
        ),
    ] = None,
    target: DefaultableTarget = None,
    policies: Annotated[
        list[str] | None,
        typer.Option(
            "--policy",
            help="As for generate (default auto); give it more than once to compare policies. A"
            " policy that does not apply to a drafter (confidence to EAGLE-3) is left out for it.",
        ),
    ] = None,
    domains: Annotated[
        str | None,
        typer.Option(
            "--domains",
            help="Comma-separated prompt domains (default: the shipped sets' chat, code, math and"
            " multilingual, or every domain of --prompt-file).",
        ),
    ] = None,
    prompt_file: Annotated[
        Path | None,
        typer.Option(
            "--prompt-file",
            help='Your own prompts instead of the shipped sets: JSONL, one {"domain": ...,'
            ' "prompt": ...} a line.',
        ),
    ] = None,
    prompts: Annotated[int, typer.Option("--prompts", min=1, help="Prompts per domain.")] = 10,
    max_tokens: MaxTokens = 256,
    chat: Annotated[bool, typer.Option("--chat/--no-chat")] = True,
    dtype: Annotated[str | None, typer.Option("--dtype")] = None,
    lookup: LookupOption = True,
    allow_tf32: AllowTf32 = False,
    compare_lookup: Annotated[
        bool,
        typer.Option(
            "--compare-lookup", help="Run every drafter and policy with prompt lookup and without."
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    chart: Annotated[Path | None, typer.Option("--chart", help="Write a PNG chart.")] = None,
) -> None:
    """Plain mlx-lm greedy decoding against woodcock on the same prompts, interleaved in one
    process (each prompt: plain decoding once, then every drafter, policy and lookup setting
    asked for): speed per domain, tokens per round, acceptance, and whether outputs are
    identical: where not, whether the first divergence is a tie the backend's rounding decides
    (exit code 0) or a real difference (exit code 1)."""
    configure_tf32(allow_tf32)
    from rich.console import Console
    from rich.progress import Progress

    from woodcock.bench import (
        TABLE_NOTES,
        render_comparison,
        render_table,
        run_bench,
        summary_rows,
        write_chart,
    )
    from woodcock.prompts import load_prompt_file, load_prompts
    from woodcock.runtime.machine import machine_facts, warn_slow_paths

    chosen = domains.split(",") if domains is not None else None
    if prompt_file is not None:
        selected = load_prompt_file(prompt_file, chosen, limit_per_domain=prompts)
    else:
        selected = load_prompts(chosen, limit_per_domain=prompts)
    lookups = (True, False) if compare_lookup else (lookup,)
    runs = _bench_runs(target, drafters or [None], policies or ["auto"], lookups, dtype)
    with Progress(console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("benchmarking", total=len(selected) * len(runs))
        results = run_bench(
            runs,
            selected,
            max_tokens=max_tokens,
            chat=chat,
            progress=lambda: progress.advance(task),
        )
    labelled = [
        (run.label, summary_rows(result)) for run, result in zip(runs, results, strict=True)
    ]
    facts = machine_facts(runs[0].session.dtype_name)
    if chart is not None:
        write_chart(labelled, str(chart))
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "max_tokens": max_tokens,
                    "runs": [
                        {
                            "drafter": run.drafter,
                            "policy": run.policy,
                            "lookup": run.lookup,
                            "rows": rows,
                        }
                        for run, (_, rows) in zip(runs, labelled, strict=True)
                    ],
                    "machine": facts,
                    "backend": backend_report(),
                },
                indent=2,
            )
        )
    else:
        for label, rows in labelled:
            typer.echo(f"{label}\n{render_table(rows)}\n")
        if len(runs) > 1:
            baseline = labelled[0][1][-1]["baseline_tps"]
            typer.echo(f"plain mlx-lm decoding: {baseline:.1f} tok/s")
            typer.echo(render_comparison(labelled) + "\n")
        blas = (facts.get("blas") or {}).get("library") or "unknown"
        threads = facts.get("openblas_num_threads") if blas == "openblas" else None
        typer.echo(TABLE_NOTES)
        typer.echo(
            f"{max_tokens} new tokens, greedy, batch 1; {describe_backend(backend_report())},"
            f" BLAS {blas}"
            + (f" on {threads} threads" if threads else "")
        )
    warn_slow_paths(facts)
    if any(rows[-1]["different"] for _, rows in labelled):
        raise typer.Exit(1)


def _bench_runs(target, drafters, policies, lookups, dtype) -> list:
    """Every (drafter, policy, lookup) asked for, in that order, each a BenchRun; the target is
    loaded once and shared. A confidence policy is left out for a drafter without blocks."""
    import dataclasses

    from woodcock.bench import BenchRun
    from woodcock.runtime.latency import LatencyProfile
    from woodcock.runtime.policy import parse_policy
    from woodcock.runtime.session import open_session

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
            with_file = _with_latency_file(policy, session, *pair)
            # the profile an adaptive policy decides with, else this machine's, prices the ideal
            kind, _, given_file = with_file.partition(":")
            adaptive = kind in ("auto", "confidence")
            profile = LatencyProfile.load(given_file if adaptive else _latency_file(session, *pair))

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


@app.command()
def serve(
    drafter: Annotated[
        str | None,
        typer.Option(
            "--drafter",
            help="Drafter (as for generate; default: the shipped drafter of the default target).",
        ),
    ] = None,
    target: DefaultableTarget = None,
    policy: Annotated[
        str, typer.Option("--policy", help="Draft length, as for generate.")
    ] = "auto",
    host: Annotated[str, typer.Option("--host", help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[
        int, typer.Option("--port", min=0, max=65535, help="Port to listen on (0: any free one).")
    ] = 8080,
    queue_size: Annotated[
        int,
        typer.Option(
            "--queue-size",
            min=1,
            help="Requests that may wait behind the running one; more are answered 503 with"
            " Retry-After.",
        ),
    ] = 8,
    prefix_cache: Annotated[
        bool,
        typer.Option(
            "--prefix-cache/--no-prefix-cache",
            help="Keep the cached rows of the prefix a prompt shares with the previous request"
            " (target and drafter) instead of prefilling every prompt whole.",
        ),
    ] = True,
    no_drafter: Annotated[
        bool,
        typer.Option("--no-drafter", help="Decode plainly with mlx-lm, without a drafter."),
    ] = False,
    max_tokens: Annotated[
        int,
        typer.Option(
            "--max-tokens", "-m", min=1, help="Tokens per answer when a request names no limit."
        ),
    ] = 512,
    dtype: Annotated[
        str | None,
        typer.Option("--dtype", help="float32 (default on CPU), bfloat16 or float16."),
    ] = None,
    lookup: LookupOption = True,
    allow_tf32: AllowTf32 = False,
) -> None:
    """Serve the pair over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions,
    streamed or not, /v1/models, /health, /metrics) with speculative decoding; one request at a
    time from a bounded queue."""
    from woodcock.serve import serve as run_server

    configure_tf32(allow_tf32)
    run_server(
        target,
        drafter,
        policy,
        host=host,
        port=port,
        queue_size=queue_size,
        prefix_cache=prefix_cache,
        lookup=lookup,
        dtype=dtype,
        plain=no_drafter,
        max_tokens=max_tokens,
    )


@app.command()
def demo(
    dest: Annotated[Path, typer.Argument(help="Directory to create (target/ and drafter/).")],
    force: Annotated[bool, typer.Option("--force", help="Replace an existing output.")] = False,
) -> None:
    """Build a tiny offline target (an mlx-lm model with a tokenizer) and a hand-written EAGLE-3
    drafter that mostly agrees with it, to try `woodcock generate` without any download."""
    from woodcock.converters.target_binding import rename_target
    from woodcock.demo import bigram_drafter, write_tiny_target
    from woodcock.formats import native
    from woodcock.staging import staged_directory

    with staged_directory(dest, force=force) as out:
        write_tiny_target(out / "target")
        drafter = bigram_drafter(out / "target")
        # the drafter records where its target lives once the directory has its final name
        drafter = rename_target(drafter, str(Path(dest).resolve() / "target"))
        native.write(drafter, out / "drafter")
    # a fixed draft length: on a pair this small drafting costs about what verifying does, so
    # `auto` may well decode plainly, which would hide what the demo is for
    typer.echo(
        f"wrote {dest}/target (mlx-lm model) and {dest}/drafter (EAGLE-3, woodcock format); try:\n"
        f"  woodcock generate --target {dest}/target --drafter {dest}/drafter"
        ' --prompt "The quick brown" --no-chat --policy fixed:4'
    )


def _with_latency_file(policy: str, session, target: str, drafter: str) -> str:
    """`auto` / `confidence` given without a latency file: this machine's cached profile for the
    pair (measured now, once, if there is none)."""
    if policy not in ("auto", "confidence"):
        return policy
    return f"{policy}:{_latency_file(session, target, drafter)}"


def _latency_file(session, target: str, drafter: str) -> Path:
    """This machine's cached latency profile for the pair, measured now if there is none.
    Progress goes to stderr: stdout is the text."""
    from rich.console import Console
    from rich.progress import Progress

    from woodcock.runtime.latency import cached_profile

    with Progress(console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("measuring this machine's latency (once)", total=None)
        return cached_profile(
            session,
            target,
            drafter,
            progress=lambda done, total: bar.update(task, completed=done, total=total),
        )


def main(argv: list[str] | None = None) -> None:
    from woodcock.staging import reporting_removed_leftovers

    try:
        with reporting_removed_leftovers(_say_removed_leftovers):
            status = app(args=argv, prog_name="woodcock", standalone_mode=False)
    except DrafterError as e:
        if _debug:
            raise
        _fail(str(e), 2)
    except typer.TyperException as e:  # the command line itself: an unknown option, a bad value
        if not hasattr(e, "format_message"):
            raise
        if type(e).__name__ == "NoArgsIsHelpError":  # `woodcock` alone: the help
            typer.echo(e.format_message())
            sys.exit(2)
        ctx = getattr(e, "ctx", None)
        hint = f" (see {ctx.command_path} --help)" if ctx is not None else ""
        _fail(" ".join(e.format_message().split()) + hint, getattr(e, "exit_code", 2))
    except typer.Abort:
        sys.exit(1)
    except Exception as e:
        if _debug:
            raise
        detail = str(e).splitlines()[0] if str(e) else ""
        print(
            f"woodcock: internal error: {type(e).__name__}: {detail} (rerun with --debug for the"
            " traceback)",
            file=sys.stderr,
        )
        sys.exit(1)
    if isinstance(status, int) and status:
        sys.exit(status)


def _say_removed_leftovers(paths: list[Path]) -> None:
    from woodcock.staging import leftovers_message

    print(f"woodcock: {leftovers_message(paths)}", file=sys.stderr)


def _fail(message: str, code: int) -> None:
    print(f"woodcock: error: {message}", file=sys.stderr)
    sys.exit(code)
