"""What one block proposal of a DFlash / DSpark drafter costs, part by part (not a test): the
decoder layers over [anchor, MASK x (B-1)] after a cached context, the LM head over the draft
slots, and the slot-by-slot Markov bias and sampling; against one plain decoding step of the
target. Greedy, batch 1, the runtime's own code (`woodcock.runtime.block.BlockDrafter`).

    python benchmarks/block_parts.py --drafter smollm2-135m-dspark [--context 300] [--repeats 30]

The context rows are random tapped states (their values do not change the cost). Each part is
timed alone, evaluated, median of --repeats runs after 3 warm-up runs.
"""

# ruff: noqa: I001  (woodcock is imported before mlx so that the CPU backend picks up OpenBLAS)
from __future__ import annotations

import argparse
import statistics
import time

import woodcock  # noqa: F401
import mlx.core as mx

from woodcock.default_target import resolve_pair
from woodcock.runtime.session import open_session


def median_ms(run, repeats: int) -> float:
    for _ in range(3):
        mx.eval(run())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(run())
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", required=True, help="A block drafter (as for generate).")
    parser.add_argument("--target", default=None, help="Default: the default target.")
    parser.add_argument("--context", type=int, default=300, help="Context rows cached.")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()

    session = open_session(*resolve_pair(args.target, args.drafter), lookup=False)
    drafter, target = session.drafter, session.target
    if getattr(drafter, "num_drafts", None) is None:
        parser.error(f"--drafter {args.drafter}: not a block drafter")
    width = len(session.spec.taps.layer_ids) * session.spec.target.hidden_size
    drafter.reset()
    drafter.add_context(mx.arange(args.context) % 1000, mx.random.normal((args.context, width)))
    k = drafter.num_drafts
    first = 0 if drafter.algorithm.sample_from_anchor else 1
    hidden = drafter.block_hidden()
    base = drafter.logits(hidden[first : first + k])
    mx.eval(hidden, base)

    def greedy(row):
        return mx.argmax(row)

    target.reset()
    prompt = mx.arange(args.context) % 1000
    mx.eval(target.forward(prompt))

    def one_target_step():
        out = target.forward(prompt[:1])
        mx.eval(out)
        target.rollback(1)  # every step runs at the same context length
        return out

    parts = [
        (f"layers ({len(session.spec.layers)}) over the block", drafter.block_hidden),
        (f"LM head, {k} slots", lambda: drafter.logits(hidden[first : first + k])),
        (
            f"Markov bias and sampling, {k} slots",
            lambda: drafter.draft_slots(hidden, base, k, greedy)[:2],
        ),
        (f"whole proposal, {k} drafts", lambda: drafter.propose(k, greedy)),
    ]
    step = median_ms(one_target_step, args.repeats)
    print(
        f"{args.drafter}: block {drafter.algorithm.block_size}, {k} drafts,"
        f" draft vocabulary {session.spec.draft_vocab_size}, context {args.context}"
    )
    print(f"{'part':<42}{'ms':>8}{'target steps':>14}")
    for name, run in parts:
        ms = median_ms(run, args.repeats)
        print(f"{name:<42}{ms:>8.2f}{ms / step:>14.2f}")
    print(f"{'one target decoding step':<42}{step:>8.2f}{1.0:>14.2f}")


if __name__ == "__main__":
    main()
