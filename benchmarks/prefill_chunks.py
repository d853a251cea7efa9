"""How long one prompt's prefill takes with each way of cutting it into forwards (not a test).

The runtime prefills a prompt in forwards of `woodcock.runtime.prefill.prefill_sizes()`: 512
tokens a forward on a GPU, 256 and then 128 once the keys are many on the CPU. This times
`woodcock.runtime.decode._prefill` (what `generate`, `bench` and `serve` run before the first
token) on the target with both, alternating, at a few prompt lengths: random token ids into an
empty cache, after a warm-up, the median of the repeats.

    python benchmarks/prefill_chunks.py [--target T] [--dtype float32]
        [--lengths 128,512,1024,2048,4096] [--repeats 3] [--json out.json]
"""

# ruff: noqa: I001  (woodcock is imported before mlx so that the CPU backend picks up OpenBLAS)
from __future__ import annotations

import argparse
import json
import time
from statistics import median

import woodcock  # noqa: F401
import mlx.core as mx
from prefill_batch import load_model, machine

from woodcock.runtime.decode import _prefill
from woodcock.runtime.prefill import CPU_SIZES, GPU_SIZES, PrefillSizes
from woodcock.runtime.target import MlxTarget

CUTS = {"gpu": GPU_SIZES, "cpu": CPU_SIZES}


def prefill_seconds(target: MlxTarget, ids: mx.array, sizes: PrefillSizes) -> float:
    target.reset()
    start = time.perf_counter()
    _prefill(target, ids, sizes=sizes)  # evaluates every chunk
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="mlx-lm model (default: the default target)")
    parser.add_argument("--dtype", help="float32, bfloat16 or float16 (default: as woodcock's)")
    parser.add_argument("--lengths", default="128,512,1024,2048,4096", help="prompt tokens")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the rows here too")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    if args.repeats < 1 or min(lengths) < 1:
        parser.error("--repeats and every --lengths value must be at least 1")
    model, dtype_name = load_model(args.target, args.dtype)
    target = MlxTarget(model, ())
    vocab = model.args.vocab_size
    for sizes in CUTS.values():  # a GPU compiles its kernels for a shape on first use
        prefill_seconds(target, mx.arange(min(lengths)) % vocab, sizes)
    rows = []
    for length in lengths:
        ids = mx.random.randint(0, vocab, (length,), key=mx.random.key(length))
        seconds = {name: [] for name in CUTS}
        for repeat in range(args.repeats):
            order = list(CUTS) if repeat % 2 == 0 else list(reversed(CUTS))
            for name in order:
                seconds[name].append(prefill_seconds(target, ids, CUTS[name]))
        row = {"tokens": length}
        for name, sizes in CUTS.items():
            row[f"{name}_forwards"] = len(sizes.spans(length))
            row[f"{name}_ms"] = 1000 * median(seconds[name])
        row["cpu_speedup"] = row["gpu_ms"] / row["cpu_ms"]
        rows.append(row)
    name = args.target or "the default target"
    print(f"{name}, {dtype_name}, {machine()}; median of {args.repeats}, alternating")
    print("| tokens | 512 a forward | ms | 256, then 128 (the CPU's) | ms | faster |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['tokens']} | {r['gpu_forwards']} forwards | {r['gpu_ms']:.0f} |"
            f" {r['cpu_forwards']} forwards | {r['cpu_ms']:.0f} | {r['cpu_speedup']:.2f}x |"
        )
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"machine": machine(), "dtype": dtype_name, "rows": rows}, file, indent=2)


if __name__ == "__main__":
    main()
