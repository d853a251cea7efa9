"""The `woodcock` command. Errors: one line on stderr and exit code 2; --debug shows tracebacks."""

from __future__ import annotations

import json
import sys
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
