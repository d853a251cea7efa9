"""Answer tokens a second of greedy batched generation, as `woodcock distill` runs it
(woodcock.runtime.greedy_batch), against mlx-lm's `BatchGenerator` on the same prompts, model
and batch size, run after run in one process (not a test). Each batch size: both generators
answer the same prompts, prefill included; the answers are compared token for token.

    python benchmarks/distill_bench.py [--target T] [--batch 8 --batch 64] [--prompts 64]
        [--max-tokens 64] [--random-weights] [--dtype float32] [--json out.json]

Prompts: the shipped benchmark prompts, all domains in turn, through the chat template.
--random-weights redraws the target's weights (same shapes), so that no answer stops early and
every run decodes prompts x max-tokens tokens, as a speed measurement on a model one does not
have wants.
"""

# ruff: noqa: I001  (woodcock is imported before mlx so that the CPU backend picks up OpenBLAS)
from __future__ import annotations

import argparse
import json
import platform
import time

import woodcock  # noqa: F401
import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.generate import BatchGenerator

from woodcock.default_target import resolve_target
from woodcock.prompts import load_prompts
from woodcock.runtime.backend import configure_tf32, describe, report
from woodcock.runtime.generate import encode_prompt
from woodcock.runtime.greedy_batch import greedy_answers
from woodcock.runtime.target import MlxTarget
from woodcock.target_checkpoint import load_mlx_target


def mlx_lm_answers(model, prompts, *, batch, max_tokens, stop_ids) -> dict[int, list[int]]:
    generator = BatchGenerator(
        model,
        max_tokens=max_tokens,
        stop_tokens=[[t] for t in stop_ids],
        completion_batch_size=batch,
        prefill_batch_size=batch,
    )
    try:
        uids = generator.insert(prompts, [max_tokens] * len(prompts))
        index = {uid: i for i, uid in enumerate(uids)}
        answers: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
        while responses := generator.next_generated():
            for r in responses:
                answers[index[r.uid]].append(int(r.token))
    finally:
        generator.close()
    return answers


def woodcock_answers(target, prompts, *, batch, max_tokens, stop_ids) -> dict[int, list[int]]:
    found = greedy_answers(target, prompts, batch=batch, max_tokens=max_tokens, stop_ids=stop_ids)
    return {answer.index: answer.tokens for answer in found}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=None, help="Default: the default target.")
    parser.add_argument("--batch", type=int, action="append", help="Repeatable; default 8.")
    parser.add_argument("--prompts", type=int, default=64, help="Prompts answered per run.")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--random-weights", action="store_true")
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default=None,
        help="Default: float32 on the CPU, the checkpoint's own elsewhere.",
    )
    parser.add_argument("--repeats", type=int, default=1, help="Runs of each generator.")
    parser.add_argument("--json", default=None, help="Also write the rows here.")
    args = parser.parse_args()
    configure_tf32(False)  # as `woodcock distill` runs without --allow-tf32

    source = args.target or resolve_target(None)
    model, tokenizer = load_mlx_target(source)
    dtype = args.dtype or ("float32" if mx.default_device() == mx.cpu else None)
    if dtype:
        model.set_dtype(getattr(mx, dtype))
    if args.random_weights:
        mx.random.seed(0)
        model.update(
            tree_map(lambda p: mx.random.normal(p.shape, p.dtype) * 0.02, model.parameters())
        )
    mx.eval(model.parameters())
    target = MlxTarget(model, (), name=str(source))
    texts = [p.prompt for p in load_prompts()]
    prompts = [encode_prompt(tokenizer, texts[i % len(texts)]) for i in range(args.prompts)]
    stop_ids = [] if args.random_weights else sorted(tokenizer.eos_token_ids)
    kwargs = {"max_tokens": args.max_tokens, "stop_ids": stop_ids}
    print(
        f"{describe(report())}; {platform.machine()}; {args.prompts} prompts"
        f" ({sum(map(len, prompts))} tokens), max {args.max_tokens} tokens,"
        f" {dtype or 'own'} weights"
        f"{', random' if args.random_weights else ''}",
        flush=True,
    )

    rows = []
    for batch in args.batch or [8]:
        runs = {"mlx_lm.BatchGenerator": mlx_lm_answers, "woodcock.greedy_batch": woodcock_answers}
        seconds = {name: [] for name in runs}
        answers = {}
        for _ in range(args.repeats):
            for name, run in runs.items():
                start = time.perf_counter()
                answers[name] = run(
                    model if name.startswith("mlx_lm") else target, prompts, batch=batch, **kwargs
                )
                seconds[name].append(time.perf_counter() - start)
        tokens = {name: sum(map(len, found.values())) for name, found in answers.items()}
        theirs, ours = answers.values()
        identical = sum(theirs[i] == ours[i] for i in range(len(prompts)))
        for name in runs:
            best = min(seconds[name])
            rows.append(
                {
                    "batch": batch,
                    "generator": name,
                    "answer_tokens": tokens[name],
                    "seconds": best,
                    "tokens_per_second": tokens[name] / best,
                    "identical": identical,
                    "prompts": len(prompts),
                }
            )
            print(
                f"batch {batch:4d}  {name:24s} {tokens[name]:7d} tokens  {best:8.2f} s"
                f"  {tokens[name] / best:9.1f} tok/s  identical {identical}/{len(prompts)}",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**report(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
