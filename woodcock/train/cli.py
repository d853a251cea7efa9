"""`woodcock distill` and `woodcock train` (a Typer app whose commands merge into the main one:
`app.add_typer(woodcock.train.cli.app)`). MLX, the progress bars and the training library are
imported only when a command runs: `woodcock --help` stays fast. `woodcock train`'s options are
the fields of `TrainOptions`."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from dataclasses import MISSING
from inspect import Parameter, Signature
from pathlib import Path
from typing import Annotated, Any, get_type_hints

import typer

from woodcock.cli_options import AllowTf32, DefaultableTarget, MaxTokens
from woodcock.train.options import FLAG, Flag, Progress, TrainOptions

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
LOG_EVERY = 60.0  # seconds between progress lines when the output is not a terminal


@contextlib.contextmanager
def progress_display(
    every: float = LOG_EVERY, clock: Callable[[], float] = time.monotonic
) -> Iterator[Progress]:
    """(phase, done, total) reports: a live bar on a terminal; elsewhere (a log file: a run of
    hours in the background) a line on stderr at a phase's first report, at most every `every`
    seconds after, and when it completes, with its rate and the time left."""
    from rich.console import Console

    if Console().is_terminal:
        from rich.progress import MofNCompleteColumn, TimeRemainingColumn
        from rich.progress import Progress as Bar

        columns = (*Bar.get_default_columns()[:2], MofNCompleteColumn(), TimeRemainingColumn())
        with Bar(*columns, transient=True) as bar:
            tasks: dict[str, int] = {}

            def update(phase: str, done: int, total: int) -> None:
                if phase not in tasks:
                    tasks[phase] = bar.add_task(phase, total=total)
                bar.update(tasks[phase], completed=done, total=total)

            yield update
        return
    first: dict[str, tuple[float, int]] = {}  # phase -> (when, done) at its first report
    said: dict[str, float] = {}  # phase -> when its last line was written

    def write_line(phase: str, done: int, total: int) -> None:
        now = clock()
        start, done_then = first.setdefault(phase, (now, done))
        if phase in said and done < total and now - said[phase] < every:
            return
        said[phase] = now
        line = f"{phase}: {done:,} of {total:,}"
        if now > start and done > done_then:
            rate = (done - done_then) / (now - start)
            line += f", {rate * 60:,.1f} a minute, {_duration((total - done) / rate)} left"
        typer.echo(line, err=True)

    yield write_line


def _duration(seconds: float) -> str:
    minutes = round(seconds / 60)
    return f"{minutes // 60} h {minutes % 60:02d} min" if minutes >= 60 else f"{minutes} min"


def _warn_slow_paths() -> None:
    from woodcock.runtime.machine import machine_facts, warn_slow_paths

    warn_slow_paths(machine_facts("float32"))


@app.command()
def distill(
    prompts: Annotated[
        Path,
        typer.Option(
            "--prompts",
            help='JSONL file, one {"id", "prompt"} per line, or {"id", "messages"}: a'
            " conversation so far, user and assistant turns alternating, ending with the user's.",
        ),
    ],
    out: Annotated[Path, typer.Option("--out", help="Output directory (answers.jsonl).")],
    target: DefaultableTarget = None,
    max_tokens: MaxTokens = 256,
    batch: Annotated[int, typer.Option("--batch", min=1, help="Answers decoded together.")] = 8,
    chat: Annotated[bool, typer.Option("--chat/--no-chat", help="Apply the chat template.")] = True,
    system: Annotated[str | None, typer.Option("--system", help="System prompt (chat).")] = None,
    allow_tf32: AllowTf32 = False,
) -> None:
    """Make the target answer the prompts (greedy, batched). Resumable: prompts already answered
    in OUT are skipped, new answers are appended to OUT/answers.jsonl as they finish."""
    from woodcock.runtime import backend
    from woodcock.train.distill import distill as run_distill

    backend.configure_tf32(allow_tf32)  # a row's answer then does not depend on the rows beside it

    _warn_slow_paths()
    with progress_display() as show:
        report = run_distill(
            target,
            prompts,
            out,
            max_tokens=max_tokens,
            batch=batch,
            chat=chat,
            system=system,
            progress=lambda done, total: show("answered", done, total),
        )
    typer.echo(
        f"{out}: {report.answered} answered now, {report.skipped} already answered, of"
        f" {report.prompts} prompts; {report.answer_tokens} answer tokens in"
        f" {report.seconds:.1f} s ({report.tokens_per_second:.1f} tokens/s);"
        f" {backend.describe(backend.report())}"
    )


def _typed_command(ctx: typer.Context) -> list[str]:
    """The command as typed (options in their canonical spelling, defaults left out)."""
    words = ["woodcock", ctx.info_name or "train"]
    for param in ctx.command.params:
        source = ctx.get_parameter_source(param.name)
        if getattr(source, "name", None) != "COMMANDLINE":  # typer vendors its own click
            continue
        value = ctx.params[param.name]
        if getattr(param, "is_flag", False):
            words.append(
                param.opts[0] if value or not param.secondary_opts else param.secondary_opts[0]
            )
        else:
            words += [param.opts[0], str(value)]
    return words


def _options_from(options: type) -> Callable[[Callable], Callable]:
    """Give a command one option per field of the `options` dataclass made with `option`
    (woodcock.train.options), after its `ctx`."""
    hints = get_type_hints(options)
    parameters = [Parameter("ctx", Parameter.KEYWORD_ONLY, annotation=typer.Context)]
    for field, flag in _flagged_fields(options):
        if flag.shared is not None:
            annotation = flag.shared
        else:
            name = "--" + field.name.replace("_", "-")
            declaration = f"{name}/--no-{name[2:]}" if flag.negatable else name
            kind = str | None if flag.parse else hints[field.name]
            annotation = Annotated[kind, typer.Option(declaration, help=flag.help)]
        default = Parameter.empty if field.default is MISSING else field.default
        parameters.append(
            Parameter(field.name, Parameter.KEYWORD_ONLY, annotation=annotation, default=default)
        )

    def command(function: Callable) -> Callable:
        function.__signature__ = Signature(parameters)
        return function

    return command


def _flagged_fields(options: type) -> list[tuple[dataclasses.Field, Flag]]:
    return [(f, f.metadata[FLAG]) for f in dataclasses.fields(options) if FLAG in f.metadata]


def _field_values(options: type, values: dict[str, Any]) -> dict[str, Any]:
    """A command's option values as fields of `options` (text parsed where a Flag says)."""
    parsers = {f.name: flag.parse for f, flag in _flagged_fields(options) if flag.parse}
    return {
        name: parsers[name](value) if name in parsers else value for name, value in values.items()
    }


@app.command()
@_options_from(TrainOptions)
def train(ctx: typer.Context, **values: Any) -> None:
    """Train a drafter on the target's hidden states over distilled answers: EAGLE-3 (one
    layer shaped like the target's, EAGLE-3.1 post-norm feedback, truncated head), or a DFlash
    / DSpark block drafter (Qwen3 layers shaped like the target's, the target's embedding and
    head); writes the woodcock format with hold-out metrics in its provenance."""
    from woodcock.runtime import backend
    from woodcock.train.train import train as run_train

    _warn_slow_paths()
    options = TrainOptions(**_field_values(TrainOptions, values), command=_typed_command(ctx))
    with progress_display() as show:
        report = run_train(options, progress=show)
    if not report.wrote:
        return  # rank 0 of a distributed run says what it wrote
    this_run = (
        f", final loss {report.losses[-1]:.4f}, {report.train_tokens_per_second:.0f} training"
        " tokens/s"
        if report.losses
        else " (no steps in this run)"
    )
    if options.is_block:
        last, first = report.holdout, report.holdout_initial
        accuracy = " ".join(f"{a:.3f}" for a in last["holdout_accuracy"])
        summary = (
            f"\nhold-out acceptance length {last['holdout_acceptance_length']:.3f} (at step 0:"
            f" {first['holdout_acceptance_length']:.3f}), accuracy by draft slot: {accuracy}"
        )
        if "holdout_confidence_mean" in last:
            summary += (
                f"\nhold-out mean confidence {last['holdout_confidence_mean']:.3f}, mean alpha"
                f" {last['holdout_alpha_mean']:.3f}"
            )
    else:
        agreement = " ".join(f"{a:.3f}" for a in report.holdout_agreement)
        initial = " ".join(f"{a:.3f}" for a in report.holdout_agreement_initial)
        summary = f"\nhold-out agreement by draft step: {agreement} (at step 0: {initial})"
    typer.echo(
        f"wrote {options.out}: {report.steps} steps"
        + (f" (resumed at {report.resumed_from})" if report.resumed_from else "")
        + this_run
        # training takes MLX's own TF32 default: no step of it has to match another exactly
        + f"; {backend.describe(backend.report())}"
        + summary
    )
