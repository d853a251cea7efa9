"""Would an fp32 final norm and head remove the path dependence of a bf16 target's verification?
(not a test): how far the one-row and the multi-row forward part at the last decoder layer's
output, at the logits the model computes, and at logits computed from those hidden states
through the final norm and head in fp32; and what the fp32 head costs. Also how often plain
greedy decoding's token is not the argmax of its logits (a tie of the rounded log-probabilities),
and what the greedy choice costs each way (woodcock.runtime.sampling).

    python benchmarks/head_noise.py [--target T] [--dtype bfloat16] [--allow-tf32] [--rows 4]
        [--no-chat] [--tokens 128] [--json FILE]

Windows of `rows` tokens at the end of a chat prompt, each from the same cache, forwarded in
one forward and row by row (as woodcock.runtime.divergence.rounding_noise does). Reported: max
|difference| of the hidden states, of the model's logits and of the fp32 head's logits, each
against one step of the model dtype at the logits' largest magnitude; whether the model's own
norm and head reproduce its logits (otherwise the fp32 figure says nothing about this model);
and milliseconds of the model's head and of the fp32 head, for one row and for `rows` rows.
Where the hidden states already part by more than the logits' noise, no head precision can
make the paths agree.
"""

# ruff: noqa: I001  (woodcock is imported before mlx so that the CPU backend picks up OpenBLAS)
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

from woodcock.runtime.backend import configure_tf32

configure_tf32("--allow-tf32" in sys.argv[1:])  # before MLX's first matmul

import mlx.core as mx  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402

from woodcock.default_target import resolve_pair  # noqa: E402
from woodcock.prompts import load_prompts  # noqa: E402
from woodcock.runtime.backend import describe, report  # noqa: E402
from woodcock.runtime.divergence import NOISE_WINDOWS  # noqa: E402
from woodcock.runtime.generate import encode_prompt  # noqa: E402
from woodcock.runtime.machine import cpu_model  # noqa: E402
from woodcock.runtime.sampling import greedy_tokens, near_ties, ulp  # noqa: E402
from woodcock.runtime.session import open_session  # noqa: E402
from woodcock.runtime.target import MlxTarget  # noqa: E402


class Heads:
    """The model's own final norm and head, and the same in fp32 from the same weights."""

    def __init__(self, model, target: MlxTarget):
        self.norm = model.model.norm
        lm_head = getattr(model, "lm_head", None)
        self.head = lm_head if lm_head is not None else model.model.embed_tokens.as_linear
        self.norm_weight = self.norm.weight.astype(mx.float32)
        self.head_weight = mx.array(target.shared_tensors()["lm_head.weight"])  # [V, H] fp32
        mx.eval(self.norm_weight, self.head_weight)

    def model_dtype(self, hidden: mx.array) -> mx.array:
        return self.head(self.norm(hidden))

    def fp32(self, hidden: mx.array) -> mx.array:
        normed = mx.fast.rms_norm(hidden.astype(mx.float32), self.norm_weight, self.norm.eps)
        return normed @ self.head_weight.T


def path_differences(target: MlxTarget, heads: Heads, sequence: list[int], rows: int) -> dict:
    """max |one forward of `rows` rows - the same rows one by one| of the hidden states, the
    model's logits and the fp32 head's logits, over up to NOISE_WINDOWS windows."""
    windows = min(NOISE_WINDOWS, (len(sequence) - 1) // rows)
    first = len(sequence) - windows * rows
    target.reset()
    mx.eval(target.forward(mx.array(sequence[:first], mx.int32)))
    worst = {"hidden": 0.0, "logits": 0.0, "fp32_head_logits": 0.0, "largest_logit": 0.0}
    own_head = 0.0
    for start in range(first, len(sequence), rows):
        window = mx.array(sequence[start : start + rows], mx.int32)
        together = target.forward(window)  # logits [rows, V], hidden [rows, H]
        mx.eval(together)
        target.rollback(rows)
        alone = [target.forward(window[i : i + 1]) for i in range(rows)]
        mx.eval(alone)
        paths = [together, tuple(mx.concatenate(parts) for parts in zip(*alone, strict=True))]
        (logits_a, hidden_a), (logits_b, hidden_b) = paths
        for name, a, b in (
            ("hidden", hidden_a, hidden_b),
            ("logits", logits_a, logits_b),
            ("fp32_head_logits", heads.fp32(hidden_a), heads.fp32(hidden_b)),
        ):
            difference = mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item()
            worst[name] = max(worst[name], difference)
        worst["largest_logit"] = max(worst["largest_logit"], mx.abs(logits_a).max().item())
        recomputed = heads.model_dtype(hidden_a).astype(mx.float32)
        own_head = max(own_head, mx.abs(recomputed - logits_a.astype(mx.float32)).max().item())
    return {**worst, "own_head_difference": own_head}


def greedy_ties(model, prompt: list[int], tokens: int) -> dict:
    """Over plain mlx-lm greedy decoding: the positions whose token is not the argmax of its
    logits (the rounded log-probabilities tied it with a lower id), and those `near_ties` flags
    (every such position must be among them)."""
    kept = []

    def keep(_, logits):
        kept.append(logits)
        return logits

    steps = generate_step(mx.array(prompt), model, max_tokens=tokens, logits_processors=[keep])
    rows = list(zip(kept, [token for token, _ in steps], strict=False))  # one step computed ahead
    return {
        "greedy_positions": len(rows),
        "greedy_not_argmax": sum(mx.argmax(logits).item() != token for logits, token in rows),
        "greedy_near_ties": sum(near_ties(logits).item() for logits, _ in rows),
    }


def head_milliseconds(head, hidden: mx.array, repeats: int = 20) -> float:
    mx.eval(head(hidden))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(head(hidden))
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", help="mlx-lm model (default: the default target)")
    parser.add_argument("--dtype", default="bfloat16", help="the target's dtype")
    parser.add_argument("--allow-tf32", action="store_true", help="TF32 fp32 matmuls on CUDA")
    parser.add_argument("--rows", type=int, default=4, help="rows of the multi-row forward")
    parser.add_argument("--no-chat", action="store_true", help="the prompt without a template")
    parser.add_argument("--tokens", type=int, default=128, help="greedy tokens to check for ties")
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    if args.rows < 2:
        parser.error("--rows: expected at least 2")
    session = open_session(*resolve_pair(args.target, "ngram"), dtype=args.dtype, lookup=False)
    model = session.model
    target = MlxTarget(model, (len(model.layers),))  # taps: the last layer's output
    heads = Heads(model, target)
    text = load_prompts(["chat"], limit_per_domain=1)[0].prompt
    sequence = encode_prompt(session.tokenizer, text, chat=not args.no_chat)
    while len(sequence) < NOISE_WINDOWS * args.rows + 8:
        sequence = sequence + sequence
    found = path_differences(target, heads, sequence, args.rows)
    found.update(
        greedy_ties(
            model, encode_prompt(session.tokenizer, text, chat=not args.no_chat), args.tokens
        )
    )
    found["logit_step"] = step = ulp(model.model.norm.weight.dtype, found["largest_logit"])
    hidden = mx.random.normal((args.rows, target.hidden_size)).astype(model.model.norm.weight.dtype)
    for rows in (1, args.rows):
        found[f"ms_model_head_{rows}_rows"] = head_milliseconds(heads.model_dtype, hidden[:rows])
        found[f"ms_fp32_head_{rows}_rows"] = head_milliseconds(heads.fp32, hidden[:rows])
    choices = {"argmax": lambda x: mx.argmax(x, axis=-1), "near_ties": near_ties}
    choices["greedy_tokens"] = greedy_tokens
    for rows in (1, args.rows, 32):
        logits = mx.random.normal((rows, target.vocab_size)).astype(hidden.dtype)
        for name, choice in choices.items():
            found[f"ms_{name}_{rows}_rows"] = head_milliseconds(choice, logits)
    machine = f"{cpu_model() or platform.machine()}, {describe(report())}"
    dtype = str(model.model.norm.weight.dtype).removeprefix("mlx.core.")
    print(
        f"{args.target or 'the default target'}, {dtype}, {args.rows}-row forward against"
        f" one-row steps, {len(sequence)} tokens, {machine}; max |difference| of"
    )
    print(f"  the last layer's output  {found['hidden']:.3g}")
    for name, label in (("logits", "the model's logits"), ("fp32_head_logits", "fp32 head logits")):
        print(
            f"  {label:<25}{found[name]:.3g}"
            f" ({found[name] / step if step else 0:.2f} steps of {step:.3g})"
        )
    print(f"  the model's own norm and head reproduce its logits to {found['own_head_difference']}")
    for rows in (1, args.rows):
        print(
            f"  head, {rows} row(s): model's {found[f'ms_model_head_{rows}_rows']:.3f} ms,"
            f" fp32 {found[f'ms_fp32_head_{rows}_rows']:.3f} ms"
        )
    for rows in (1, args.rows, 32):
        print(
            f"  the greedy choice, {rows} row(s): the logits' argmax"
            f" {found[f'ms_argmax_{rows}_rows']:.3f} ms, near_ties"
            f" {found[f'ms_near_ties_{rows}_rows']:.3f} ms, the log-probabilities' argmax"
            f" {found[f'ms_greedy_tokens_{rows}_rows']:.3f} ms"
        )
    print(
        f"  plain greedy decoding, {found['greedy_positions']} tokens: {found['greedy_not_argmax']}"
        " not the logits' argmax (rounded log-probabilities tied it with a lower id),"
        f" {found['greedy_near_ties']} flagged as near ties"
    )
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"machine": machine, "dtype": dtype, **found}, file, indent=2)


if __name__ == "__main__":
    main()
