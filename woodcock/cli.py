"""The `woodcock` command. Errors: one line on stderr and exit code 2; --debug shows tracebacks."""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer

from woodcock import __version__
from woodcock.cli_options import AllowTf32, DefaultableTarget, MaxTokens, parse_taps
from woodcock.default_target import resolve_drafter, resolve_pair
from woodcock.errors import DrafterError
from woodcock.runtime.backend import configure_tf32
from woodcock.staging import check_output_file, leftovers_message, reporting_removed_leftovers
from woodcock.train.cli import app as training_app
from woodcock.vocab_count import app as vocab_app

# Each command imports its library module (and rich, for progress) when it runs: together they
# load MLX, torch, every drafter format and the HTTP server, which `woodcock --help` and the
# other commands do not need.

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
    path: Annotated[
        str, typer.Argument(help="Drafter directory, Hugging Face id or a shipped drafter's name.")
    ],
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

    report = describe(resolve_drafter(path), taps=parse_taps(taps))
    typer.echo(json.dumps(report, indent=2) if as_json else render_text(report))


@app.command()
def convert(
    source: Annotated[
        str, typer.Argument(help="Drafter directory, Hugging Face id or a shipped drafter's name.")
    ],
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
    retap: Annotated[
        str | None,
        typer.Option(
            "--retap",
            help="Replace the recorded taps (canonical ids), as many as the drafter reads: to"
            " undo a layer-id convention error that `woodcock doctor` found.",
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
        resolve_drafter(source),
        dest,
        to=to,
        source_format=source_format,
        target=target,
        dtype=dtype,
        taps=parse_taps(taps),
        retap=parse_taps(retap, "--retap"),
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
    path: Annotated[
        str, typer.Argument(help="Drafter directory, Hugging Face id or a shipped drafter's name.")
    ],
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
    from woodcock.parity import parity as run_parity
    from woodcock.parity import render_text
    from woodcock.target_checkpoint import load_target_tensors

    configure_tf32(False)  # a tolerance of 1e-4 is for fp32 matmuls, not TF32's
    drafter = load_drafter(resolve_drafter(path))
    tensors = load_target_tensors(target) if target is not None else None
    report = run_parity(drafter, tensors, steps=steps)
    typer.echo(json.dumps(report, indent=2) if as_json else render_text(report))
    if not report["ok"]:
        raise typer.Exit(1)


@app.command()
def doctor(
    drafter: Annotated[
        str | None,
        typer.Option(
            "--drafter",
            help="Drafter directory, Hugging Face id or a shipped drafter's name (default: the"
            " shipped drafter of the default target).",
        ),
    ] = None,
    target: DefaultableTarget = None,
    taps: Annotated[
        str | None,
        typer.Option(
            "--taps", help="Canonical tap ids, for formats that do not record them (SafeAILab)."
        ),
    ] = None,
    retap: Annotated[
        str | None,
        typer.Option(
            "--retap",
            help="Canonical tap ids to use instead of the recorded ones (tests a suspected"
            " off-by-one before `convert --retap`).",
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

    configure_tf32(False)  # the target's logits as generate computes them
    target, drafter = resolve_pair(target, drafter)
    with Console(stderr=True).status("doctor") as status:
        report = diagnose(
            target,
            drafter,
            taps=parse_taps(taps),
            retap=parse_taps(retap, "--retap"),
            progress=lambda step: status.update(step),
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
    from woodcock.generation import generate_report
    from woodcock.runtime.generate import check_system_prompt

    if (prompt is None) == (prompt_file is None):
        raise DrafterError("give exactly one of --prompt and --prompt-file")
    if prompt_file is not None:
        try:
            text = prompt_file.read_text(encoding="utf-8")
        except OSError as e:
            raise DrafterError(f"{prompt_file}: cannot be read ({e.strerror})") from None
        except UnicodeDecodeError:
            raise DrafterError(f"{prompt_file}: not UTF-8 text") from None
    else:
        text = sys.stdin.read() if prompt == "-" else prompt
    if not text:
        raise DrafterError(f"{prompt_file or '--prompt'}: the prompt is empty")
    if stop and not all(stop):
        raise DrafterError("--stop '': expected a non-empty stop string")
    check_system_prompt(system, chat=chat)

    def show(segment: str) -> None:
        print(segment, end="", flush=True)

    with _progress_bar(MEASURING_ONCE) as measuring:
        report = generate_report(
            target,
            drafter,
            text,
            policy=policy,
            max_tokens=max_tokens,
            chat=chat,
            system=system,
            temperature=temp,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            seed=seed,
            stop=stop or (),
            dtype=dtype,
            lookup=lookup,
            on_text=None if as_json else show,
            measuring=measuring,
        )
    typer.echo(json.dumps(report.fields, indent=2) if as_json else report.render_text())


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
    from woodcock.runtime.latency import measure_pair, profile_summary

    check_output_file(out, force=force)
    try:
        lengths = [int(c) for c in contexts.split(",")]
    except ValueError:
        lengths = [0]
    if min(lengths) < 1:
        raise DrafterError(
            f"--contexts {contexts!r}: expected comma-separated lengths of at least 1"
        )
    with _progress_bar("measuring", on_stdout=True) as progress:
        measure_pair(
            target, drafter, out, contexts=lengths, repeats=repeats, dtype=dtype, progress=progress
        )
    typer.echo(profile_summary(out))


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
    force: Annotated[
        bool, typer.Option("--force", help="Replace an existing --chart file.")
    ] = False,
) -> None:
    """Plain mlx-lm greedy decoding against woodcock on the same prompts, interleaved in one
    process (each prompt: plain decoding once, then every drafter, policy and lookup setting
    asked for): speed per domain, tokens per round, acceptance, and whether outputs are
    identical: where not, whether the first divergence is a tie the backend's rounding decides
    (exit code 0) or a real difference (exit code 1)."""
    configure_tf32(allow_tf32)
    from woodcock.bench import benchmark

    if chart is not None:
        check_output_file(chart, force=force)
    from woodcock.runtime.machine import warn_slow_paths

    with (
        _progress_bar(MEASURING_ONCE) as measuring,
        _progress_bar("benchmarking") as progress,
    ):
        report = benchmark(
            target,
            drafters or [None],
            policies or ["auto"],
            domains=domains.split(",") if domains is not None else None,
            prompt_file=prompt_file,
            prompts=prompts,
            max_tokens=max_tokens,
            chat=chat,
            dtype=dtype,
            lookup=lookup,
            compare_lookup=compare_lookup,
            chart=chart,
            measuring=measuring,
            progress=progress,
        )
    typer.echo(json.dumps(report.as_json(), indent=2) if as_json else report.render_text())
    warn_slow_paths(report.machine)
    if report.different:
        raise typer.Exit(1)


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
            help="Requests that may wait behind the running ones; more are answered 503 with"
            " Retry-After.",
        ),
    ] = 8,
    max_batch: Annotated[
        int,
        typer.Option(
            "--max-batch",
            min=1,
            help="Requests that decode together, each with its own speculation, verified in one"
            " batched forward (1: one at a time).",
        ),
    ] = 1,
    prefix_cache: Annotated[
        bool,
        typer.Option(
            "--prefix-cache/--no-prefix-cache",
            help="Keep the cached rows of the prefix a prompt shares with an earlier request"
            " (target and drafter) instead of prefilling every prompt whole.",
        ),
    ] = True,
    prefix_cache_gb: Annotated[
        float | None,
        typer.Option(
            "--prefix-cache-gb",
            min=0,
            help="Most GB of KV rows (target and drafter) kept for recent conversations; a"
            " request reuses the one sharing its longest prefix, the least recently used go"
            " first (default 1). 0: no prefix cache, as --no-prefix-cache.",
        ),
    ] = None,
    request_timeout: Annotated[
        float | None,
        typer.Option(
            "--request-timeout",
            min=0,
            help="Seconds a request may take from its arrival, queue wait included; then it is"
            " cancelled: answered 504, or a stream ends with an error event. Default: no limit.",
        ),
    ] = None,
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
    """Serve the pair over OpenAI's API (/v1/chat/completions, /v1/completions) and Anthropic's
    (/v1/messages, /v1/messages/count_tokens), streamed or not, plus /v1/models, /health and
    /metrics, with speculative decoding; one request at a time, or up to --max-batch together,
    from a bounded queue."""
    from woodcock.serve import serve as run_server

    configure_tf32(allow_tf32)

    run_server(
        target,
        drafter,
        policy,
        host=host,
        port=port,
        queue_size=queue_size,
        max_batch=max_batch,
        prefix_cache=prefix_cache,
        prefix_cache_gb=prefix_cache_gb,
        request_timeout=request_timeout,
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
    from woodcock.demo import write_demo

    write_demo(dest, force=force)
    # a fixed draft length: on a pair this small drafting costs about what verifying does, so
    # `auto` may well decode plainly, which would hide what the demo is for
    typer.echo(
        f"wrote {dest}/target (mlx-lm model) and {dest}/drafter (EAGLE-3, woodcock format); try:\n"
        f"  woodcock generate --target {dest}/target --drafter {dest}/drafter"
        ' --prompt "The quick brown" --no-chat --policy fixed:4'
    )


MEASURING_ONCE = "measuring this machine's latency (once)"


@contextmanager
def _progress_bar(description: str, *, on_stdout: bool = False):
    """A transient progress bar for work that reports (done, total), shown from its first report
    until done reaches total; on stderr unless on_stdout, as stdout carries the output."""
    from rich.console import Console
    from rich.progress import Progress

    shown = None  # (bar, task)

    def update(done: int, total: int) -> None:
        nonlocal shown
        if shown is None:
            bar = Progress(console=None if on_stdout else Console(stderr=True), transient=True)
            bar.start()
            shown = bar, bar.add_task(description, total=total)
        bar, task = shown
        bar.update(task, completed=done, total=total)
        if done >= total:
            bar.stop()
            shown = None

    try:
        yield update
    finally:
        if shown is not None:
            shown[0].stop()


def main(argv: list[str] | None = None) -> None:
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
        if isinstance(e, OSError) and e.filename is not None:  # a path the user gave
            _fail(f"{e.filename}: {e.strerror}", 2)
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
    print(f"woodcock: {leftovers_message(paths)}", file=sys.stderr)


def _fail(message: str, code: int) -> None:
    print(f"woodcock: error: {message}", file=sys.stderr)
    sys.exit(code)
