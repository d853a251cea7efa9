"""Would a batched prefill bring concurrent first tokens closer? (not a test)

`woodcock serve --max-batch N` prefills the requests that arrive together in turn, each alone,
and streams each one's first token before the next prefill: the k-th waits k lone prefills, a
mean of (N + 1) / 2. Prefilling all N in one forward gives every one its first token after
that forward. This times both on the target, at a few prompt lengths: one prompt of T tokens,
and N prompts of T tokens in one forward, each as the server prefills a prompt (one forward of
the model over the T tokens into a fresh cache, the head on the last position alone:
woodcock.runtime.target.head_on_last_position), after warm-up, median of the repeats.

    python benchmarks/prefill_batch.py [--target T] [--dtype float32] [--rows 4]
        [--lengths 32,64,96] [--repeats 5] [--json out.json]
"""

# ruff: noqa: I001  (woodcock is imported before mlx so that the CPU backend picks up OpenBLAS)
from __future__ import annotations

import argparse
import json
import platform
import time
from statistics import median

import woodcock  # noqa: F401
import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from woodcock.default_target import resolve_target
from woodcock.runtime.backend import describe, report
from woodcock.runtime.machine import cpu_model
from woodcock.runtime.session import default_dtype
from woodcock.runtime.target import head_on_last_position


def prefill_seconds(model, ids: mx.array, repeats: int) -> float:
    """Median seconds to prefill ids [rows, T] into a fresh cache."""

    def once() -> float:
        cache = make_prompt_cache(model)
        start = time.perf_counter()
        with head_on_last_position(model):
            mx.eval(model(ids, cache=cache))
        return time.perf_counter() - start

    for _ in range(2):  # a GPU compiles its kernels for a shape on first use
        once()
    return median(once() for _ in range(repeats))


def load_model(target: str | None, dtype: str | None):
    """(model, the name of its floating-point dtype): the target (default: the default target),
    cast to `dtype` (default: as woodcock's)."""
    model, _ = load(resolve_target(target))
    cast = default_dtype(dtype)
    if cast is not None:
        model.set_dtype(cast)
    floating = (
        w for _, w in tree_flatten(model.parameters()) if mx.issubdtype(w.dtype, mx.floating)
    )
    return model, str(next(floating).dtype).removeprefix("mlx.core.")


def machine() -> str:
    return f"{cpu_model() or platform.machine()}, {describe(report())}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="mlx-lm model (default: the default target)")
    parser.add_argument("--dtype", help="float32, bfloat16 or float16 (default: as woodcock's)")
    parser.add_argument("--rows", type=int, default=4, help="prompts prefilled together")
    parser.add_argument("--lengths", default="32,64,96", help="prompt lengths in tokens")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="write the rows here too")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    if args.rows < 2 or min(lengths) < 1:
        parser.error("--rows must be at least 2 and every --lengths value at least 1")
    model, dtype_name = load_model(args.target, args.dtype)
    vocab = model.args.vocab_size
    rows = []
    for length in lengths:
        ids = mx.random.randint(0, vocab, (args.rows, length), key=mx.random.key(length))
        alone = prefill_seconds(model, ids[:1], args.repeats)
        together = prefill_seconds(model, ids, args.repeats)
        rows.append(
            {
                "tokens": length,
                "alone_ms": 1000 * alone,
                "together_ms": 1000 * together,
                # mean first token over the N requests, in lone prefills
                "in_turn_mean": (args.rows + 1) / 2,
                "together_mean": together / alone,
            }
        )
    name = args.target or "the default target"
    print(f"{name}, {dtype_name}, {machine()}; median of {args.repeats}")
    print(f"| tokens | 1 prompt ms | {args.rows} together ms | mean first token, in lone prefills:"
          " in turn | together |")  # fmt: skip
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['tokens']} | {r['alone_ms']:.1f} | {r['together_ms']:.1f} |"
            f" {r['in_turn_mean']:.2f} | {r['together_mean']:.2f} |"
        )
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"machine": machine(), "dtype": dtype_name, "rows": rows}, file, indent=2)


if __name__ == "__main__":
    main()
