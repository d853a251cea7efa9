"""The `woodcock` command. Errors: one line on stderr and exit code 2; --debug shows tracebacks."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from woodcock import __version__
from woodcock.errors import DrafterError

app = typer.Typer(
    name="woodcock",
    help="Portable speculative-decoding drafters: inspect, convert and run them.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
_debug = False


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
) -> None:
    """Describe a drafter: format, algorithm, taps in both conventions, fusion, layers, head,
    vocabulary, parameters, dtypes and warnings."""
    from woodcock.inspection import describe, render_text

    report = describe(path)
    typer.echo(json.dumps(report, indent=2) if as_json else render_text(report))


def _parse_taps(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise DrafterError(
            f"--taps {text!r}: expected comma-separated layer ids, e.g. 2,18,33"
        ) from None


@app.command()
def convert(
    source: Annotated[str, typer.Argument(help="Drafter directory or Hugging Face id.")],
    dest: Annotated[str, typer.Argument(help="Output directory (must not exist, or --force).")],
    to: Annotated[str, typer.Option("--to", help="Output format: woodcock or speculators.")],
    source_format: Annotated[
        str | None, typer.Option("--from", help="Input format (default: detected).")
    ] = None,
    target: Annotated[
        str | None,
        typer.Option(
            "--target",
            help="Target model directory or id: records its facts, checks the taps and copies in"
            " the tensors the drafter shares with it.",
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
    force: Annotated[bool, typer.Option("--force", help="Replace an existing output.")] = False,
) -> None:
    """Convert a drafter between formats, losslessly or with an error saying why not."""
    from woodcock.converters.dtype import cast
    from woodcock.converters.target import attach_target, fill_shared
    from woodcock.formats.detect import format_named
    from woodcock.loading import load_drafter_with_format
    from woodcock.target_files import load_target_tensors, target_from_config

    writer = format_named(to)
    drafter, reader = load_drafter_with_format(source, source_format, taps=_parse_taps(taps))
    if target is not None:
        drafter = attach_target(drafter, target_from_config(target))
        drafter = fill_shared(drafter, load_target_tensors(target))
    if dtype is not None:
        drafter = cast(drafter, dtype)
    writer.write(drafter, Path(dest), force=force)
    spec = drafter.spec
    typer.echo(
        f"{source} ({reader.NAME}) -> {dest} ({writer.NAME}): {spec.algorithm.name},"
        f" {len(drafter.weights)} tensors, {drafter.parameter_counts()['own']:,} parameters"
    )


def main(argv: list[str] | None = None) -> None:
    try:
        app(args=argv, prog_name="woodcock")
    except DrafterError as e:
        if _debug:
            raise
        print(f"woodcock: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
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
