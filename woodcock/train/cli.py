"""`woodcock distill` and `woodcock train` (a Typer app whose commands merge into the main one:
`app.add_typer(woodcock.train.cli.app)`). MLX is imported only when a command runs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from woodcock.cli_options import DefaultableTarget, MaxTokens, parse_taps

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)


def _warn_slow_paths() -> None:
    from woodcock.runtime.machine import machine_facts, warn_slow_paths

    warn_slow_paths(machine_facts("float32"))


@app.command()
def distill(
    prompts: Annotated[
        Path, typer.Option("--prompts", help='JSONL file, one {"id", "prompt"} per line.')
    ],
    out: Annotated[Path, typer.Option("--out", help="Output directory (answers.jsonl).")],
    target: DefaultableTarget = None,
    max_tokens: MaxTokens = 256,
    batch: Annotated[int, typer.Option("--batch", min=1, help="Answers decoded together.")] = 8,
    chat: Annotated[bool, typer.Option("--chat/--no-chat", help="Apply the chat template.")] = True,
    system: Annotated[str | None, typer.Option("--system", help="System prompt (chat).")] = None,
) -> None:
    """Make the target answer the prompts (greedy, batched). Resumable: prompts already answered
    in OUT are skipped, new answers are appended to OUT/answers.jsonl as they finish."""
    from rich.progress import MofNCompleteColumn, Progress, TimeRemainingColumn

    from woodcock.train.distill import distill as run_distill

    _warn_slow_paths()
    columns = (*Progress.get_default_columns()[:2], MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, transient=True) as bar:
        task = bar.add_task("answering", total=None)

        def progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        report = run_distill(
            target,
            prompts,
            out,
            max_tokens=max_tokens,
            batch=batch,
            chat=chat,
            system=system,
            progress=progress,
        )
    typer.echo(
        f"{out}: {report.answered} answered now, {report.skipped} already answered, of"
        f" {report.prompts} prompts; {report.answer_tokens} answer tokens in"
        f" {report.seconds:.1f} s ({report.tokens_per_second:.1f} tokens/s)"
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


@app.command()
def train(
    ctx: typer.Context,
    data: Annotated[Path, typer.Option("--data", help="A `woodcock distill` output directory.")],
    out: Annotated[Path, typer.Option("--out", help="Drafter directory to write (woodcock).")],
    target: DefaultableTarget = None,
    steps: Annotated[int, typer.Option("--steps", help="Optimizer steps.")] = 300,
    ttt_steps: Annotated[
        int, typer.Option("--ttt-steps", help="Unrolled draft steps (training-time test).")
    ] = 3,
    lr: Annotated[float, typer.Option("--lr", help="Peak learning rate.")] = 3e-4,
    min_lr_ratio: Annotated[
        float, typer.Option("--min-lr-ratio", help="Final learning rate / peak (cosine).")
    ] = 0.1,
    warmup: Annotated[
        int | None, typer.Option("--warmup", help="Warm-up steps (default: 5 % of --steps).")
    ] = None,
    weight_decay: Annotated[float, typer.Option("--weight-decay")] = 0.01,
    clip: Annotated[float, typer.Option("--clip", help="Gradient-norm clipping.")] = 1.0,
    batch: Annotated[int, typer.Option("--batch", help="Sequences per step.")] = 8,
    max_len: Annotated[
        int, typer.Option("--max-len", help="Tokens per sequence (prompt + answer), cut beyond.")
    ] = 384,
    head_size: Annotated[
        int | None,
        typer.Option(
            "--head-size",
            help="Draft vocabulary: the N most frequent tokens (default 8192 for eagle3; for"
            " dflash/dspark the whole vocabulary, with the target's head).",
        ),
    ] = None,
    holdout: Annotated[
        float, typer.Option("--holdout", help="Share of the samples held out.")
    ] = 0.05,
    taps: Annotated[
        str | None, typer.Option("--taps", help="Target layer ids (default 2,N/2,N-3).")
    ] = None,
    init: Annotated[
        str | None,
        typer.Option(
            "--init",
            help="Start from this drafter's weights (its taps and head rows) instead of random.",
        ),
    ] = None,
    eval_every: Annotated[
        int, typer.Option("--eval-every", help="Hold-out evaluation every N steps.")
    ] = 200,
    checkpoint_every: Annotated[
        int, typer.Option("--checkpoint-every", help="Checkpoint every N steps.")
    ] = 50,
    checkpoints: Annotated[
        Path | None, typer.Option("--checkpoints", help="Checkpoint directory (default OUT.ckpt).")
    ] = None,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue from the last checkpoint.")
    ] = False,
    finish: Annotated[
        bool,
        typer.Option(
            "--finish",
            help="With --resume: stop there, write the drafter from the last checkpoint.",
        ),
    ] = False,
    force: Annotated[
        bool, typer.Option("--force", help="Replace OUT / start the checkpoints over.")
    ] = False,
    algorithm: Annotated[
        str, typer.Option("--algorithm", help="eagle3 (chain), dflash or dspark (block).")
    ] = "eagle3",
    block_size: Annotated[
        int, typer.Option("--block-size", help="dflash/dspark: slots per block.")
    ] = 8,
    layers: Annotated[
        int, typer.Option("--layers", help="dflash/dspark: decoder layers (Qwen3-style).")
    ] = 2,
    markov_rank: Annotated[
        int, typer.Option("--markov-rank", help="dspark: Markov head rank (0: none).")
    ] = 256,
    markov_head: Annotated[
        str, typer.Option("--markov-head", help="dspark: vanilla, gated or rnn.")
    ] = "vanilla",
    confidence_head: Annotated[
        bool,
        typer.Option("--confidence-head/--no-confidence-head", help="dspark: confidence head."),
    ] = True,
    sample_from_anchor: Annotated[
        bool | None,
        typer.Option(
            "--sample-from-anchor/--no-sample-from-anchor",
            help="dflash/dspark: the anchor slot drafts too (default: dspark yes, dflash no).",
        ),
    ] = None,
    anchors: Annotated[
        int, typer.Option("--anchors", help="dflash/dspark: blocks per sequence per step.")
    ] = 16,
    decay_gamma: Annotated[
        float, typer.Option("--decay-gamma", help="dflash/dspark: slot k weighs exp(-k/gamma).")
    ] = 4.0,
    confidence_weight: Annotated[
        float,
        typer.Option("--confidence-weight", help="dspark: weight of the confidence BCE."),
    ] = 1.0,
) -> None:
    """Train a drafter on the target's hidden states over distilled answers: EAGLE-3 (one
    layer shaped like the target's, EAGLE-3.1 post-norm feedback, truncated head), or a DFlash
    / DSpark block drafter (Qwen3 layers shaped like the target's, the target's embedding and
    head); writes the woodcock format with hold-out metrics in its provenance."""
    from rich.progress import MofNCompleteColumn, Progress, TimeRemainingColumn

    from woodcock.train.options import TrainOptions
    from woodcock.train.train import train as run_train

    _warn_slow_paths()
    options = TrainOptions(
        target=target,
        data=data,
        out=out,
        steps=steps,
        ttt_steps=ttt_steps,
        lr=lr,
        min_lr_ratio=min_lr_ratio,
        warmup=warmup,
        weight_decay=weight_decay,
        clip=clip,
        batch=batch,
        max_len=max_len,
        head_size=head_size,
        holdout=holdout,
        taps=parse_taps(taps),
        init=init,
        eval_every=eval_every,
        checkpoint_every=checkpoint_every,
        checkpoints=checkpoints,
        seed=seed,
        resume=resume,
        finish=finish,
        force=force,
        command=_typed_command(ctx),
        algorithm=algorithm,
        block_size=block_size,
        layers=layers,
        markov_rank=markov_rank,
        markov_head=markov_head,
        confidence_head=confidence_head,
        sample_from_anchor=sample_from_anchor,
        anchors=anchors,
        decay_gamma=decay_gamma,
        confidence_weight=confidence_weight,
    )
    columns = (*Progress.get_default_columns()[:2], MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, transient=True) as bar:
        tasks: dict[str, int] = {}

        def progress(phase: str, done: int, total: int) -> None:
            if phase not in tasks:
                tasks[phase] = bar.add_task(phase, total=total)
            bar.update(tasks[phase], completed=done, total=total)

        report = run_train(options, progress=progress)
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
        f"wrote {out}: {report.steps} steps"
        + (f" (resumed at {report.resumed_from})" if report.resumed_from else "")
        + this_run
        + summary
    )
