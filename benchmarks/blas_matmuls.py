"""How much faster OpenBLAS makes MLX's fp32 matmuls on a Linux CPU (not a test).

Importing woodcock opens the system's OpenBLAS before MLX loads (`woodcock.runtime.openblas`);
`WOODCOCK_OPENBLAS=0` keeps the BLAS the `mlx-cpu` wheel links against. This times `x @ w.T`
for the default target's shapes (hidden 576 into its MLP's 1,536 and into the 49,152-token
head) at several row counts, in a child process of each kind, the kinds alternating, and
reports the median of the repeats and which BLAS each child's MLX called.

    python benchmarks/blas_matmuls.py [--rows 1,4,16,32,256] [--repeats 3] [--json out.json]
"""

# ruff: noqa: I001  (woodcock is imported before mlx so that the CPU backend picks up OpenBLAS)
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from statistics import median

HIDDEN = 576
OUTPUTS = {"mlp": 1536, "head": 49152}
KINDS = {"openblas": None, "linked": "0"}  # WOODCOCK_OPENBLAS for each child
CALLS = 20  # matmuls timed in a child, after one to warm up


def child(rows: list[int]) -> dict:
    """Milliseconds a matmul in this process, by shape, and the BLAS MLX calls here."""
    import woodcock  # noqa: F401  (opens OpenBLAS unless WOODCOCK_OPENBLAS=0)
    import mlx.core as mx

    from woodcock.runtime.machine import blas

    timings = {}
    for name, width in OUTPUTS.items():
        weight = mx.random.normal((width, HIDDEN))
        for count in rows:
            x = mx.random.normal((count, HIDDEN))
            mx.eval(x, weight, x @ weight.T)
            start = time.perf_counter()
            for _ in range(CALLS):
                mx.eval(x @ weight.T)
            timings[f"{name} {count}"] = (time.perf_counter() - start) / CALLS * 1e3
    called = blas()
    return {"ms": timings, "blas": {"library": called["library"], "path": called["path"]}}


def run_child(kind: str, rows: list[int]) -> dict:
    env = dict(os.environ)
    env.pop("WOODCOCK_OPENBLAS", None)
    if KINDS[kind] is not None:
        env["WOODCOCK_OPENBLAS"] = KINDS[kind]
    argv = [sys.executable, __file__, "--child", "--rows", ",".join(map(str, rows))]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,16,32,256")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the results here too")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    if args.child:
        print(json.dumps(child(rows)))
        return
    runs: dict[str, list[dict]] = {kind: [] for kind in KINDS}
    for _ in range(args.repeats):
        for kind in KINDS:
            runs[kind].append(run_child(kind, rows))
    shapes = list(runs["openblas"][0]["ms"])
    result = {
        "blas": {kind: runs[kind][0]["blas"] for kind in KINDS},
        "rows": [
            {
                "shape": shape,
                **{f"{kind}_ms": median(r["ms"][shape] for r in runs[kind]) for kind in KINDS},
            }
            for shape in shapes
        ],
    }
    for row in result["rows"]:
        row["speedup"] = row["linked_ms"] / row["openblas_ms"]
    print(f"BLAS called: {result['blas']}")
    print("| matmul (rows) | linked BLAS ms | OpenBLAS ms | speed-up |")
    print("| --- | --- | --- | --- |")
    for row in result["rows"]:
        print(
            f"| {row['shape']} | {row['linked_ms']:.2f} | {row['openblas_ms']:.2f} |"
            f" {row['speedup']:.1f}x |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
