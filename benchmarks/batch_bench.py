"""Batched speculative rounds in process (not a test): N chat prompts decoded together through
woodcock.runtime.decode.batched_round, as `woodcock serve --max-batch N` decodes them, with each
draft policy and the drafters drafting together (one forward a step) or one after another, run
after run in one process.

    python benchmarks/batch_bench.py [--target T --drafter D] [--clients 4] [--max-tokens 128]
        [--policy plain --policy fixed:1 ...] [--repeats 2] [--json out.json]

Each run prefills the N prompts (the first N of the shipped chat set through the chat template)
one by one, puts them in one batch and runs rounds; a sequence leaves once it has max-tokens
tokens (EOS does not stop one, so every run decodes the same tokens); only the rounds are
timed, and the tokens a round emits past a sequence's max-tokens are not counted. Proposals are
cut at the server's LONGEST_BATCHED_PROPOSAL while several sequences run; `plain` drafts nothing
(the server's plain batched steps). Reported per configuration, best of the repeats: tokens a
second, rounds, milliseconds a round and of it drafting, and whether every sequence's tokens
equal the plain run's (greedy: they must, up to a rounding tie of the batched forward).
"""

# ruff: noqa: I001  (woodcock is imported before mlx so that the CPU backend picks up OpenBLAS)
from __future__ import annotations

import argparse
import json
import platform
import time

import woodcock  # noqa: F401
import mlx.core as mx

from woodcock.default_target import resolve_pair
from woodcock.prompts import load_prompts
from woodcock.runtime import decode
from woodcock.runtime.backend import describe, report
from woodcock.runtime.batch import SequenceBatch
from woodcock.runtime.decode import SpeculativeSequence, batched_round
from woodcock.runtime.generate import encode_prompt
from woodcock.runtime.machine import cpu_model
from woodcock.runtime.policy import FixedPolicy
from woodcock.runtime.session import open_session
from woodcock.serve.batching import LONGEST_BATCHED_PROPOSAL, own_state


class DraftTimer:
    """Wraps decode.propose_all to time each round's drafting; `together=False` makes every
    drafter draft alone."""

    def __init__(self, together: bool):
        self.together, self.seconds = together, 0.0

    def __enter__(self):
        self.propose_all, self.modules = decode.propose_all, decode.DRAFTING_TOGETHER

        def timed(*args):
            start = time.perf_counter()
            tokens = self.propose_all(*args)
            mx.eval(tokens)
            self.seconds += time.perf_counter() - start
            return tokens

        decode.propose_all = timed
        if not self.together:
            decode.DRAFTING_TOGETHER = ()
        return self

    def __exit__(self, *exc):
        decode.propose_all, decode.DRAFTING_TOGETHER = self.propose_all, self.modules


def run(session, prompts, policy: str, together: bool, max_tokens: int) -> dict:
    target = session.target
    batch = SequenceBatch(target, len(prompts))
    k = 0 if policy == "plain" else int(policy.split(":")[1])
    sequences, tokens = [], []
    for prompt in prompts:
        lookup = own_state(session.lookup) if session.lookup is not None else None
        sequence = SpeculativeSequence(
            prompt, target, own_state(session.drafter), policy=FixedPolicy(k), lookup=lookup
        )
        tokens.append([step[0] for step in sequence.start()])
        sequence.rows = batch.add(target.cache)
        sequences.append(sequence)
    longest = 0 if k == 0 else LONGEST_BATCHED_PROPOSAL
    rounds, running = 0, list(zip(sequences, tokens, strict=True))
    with DraftTimer(together) as timer:
        start = time.perf_counter()
        while running:
            # a request alone drafts as the policy says, as the server's Batcher lets it
            cut = None if len(running) == 1 and k else longest
            for (_, mine), steps in zip(
                running, batched_round(batch, [s for s, _ in running], cut), strict=True
            ):
                mine += [step[0] for step in steps]
            rounds += 1
            for sequence, mine in list(running):
                if len(mine) >= max_tokens:  # it leaves, as a finished request does
                    batch.remove(sequence.rows)
                    running.remove((sequence, mine))
        seconds = time.perf_counter() - start
    return {
        "policy": policy,
        "drafting": "-" if k == 0 else "together" if together else "one after another",
        "tokens_per_second": len(prompts) * max_tokens / seconds,
        "rounds": rounds,
        "ms_per_round": 1000 * seconds / rounds,
        "draft_ms_per_round": 1000 * timer.seconds / rounds,
        "tokens": [t[:max_tokens] for t in tokens],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", help="mlx-lm model (default: the default target)")
    parser.add_argument("--drafter", help="drafter (default: the default target's shipped one)")
    parser.add_argument("--clients", type=int, default=4, help="sequences in the batch")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--policy", action="append", help="plain or fixed:K (repeatable)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", help="write the rows here too")
    args = parser.parse_args()
    policies = args.policy or ["plain", "fixed:1", "fixed:2", "fixed:3"]
    for policy in policies:
        if policy != "plain" and not (policy.startswith("fixed:") and policy[6:].isdigit()):
            parser.error(f"--policy {policy!r}: expected plain or fixed:K")
    target, drafter = resolve_pair(args.target, args.drafter)
    session = open_session(target, drafter)
    chat = [p.prompt for p in load_prompts(["chat"], limit_per_domain=args.clients)]
    prompts = [encode_prompt(session.tokenizer, chat[i % len(chat)]) for i in range(args.clients)]
    configurations = [(p, True) for p in policies] + [(p, False) for p in policies if p != "plain"]
    best: dict[tuple[str, bool], dict] = {}
    run(session, prompts, policies[-1], True, 8)  # warm-up
    for _ in range(args.repeats):
        for policy, together in configurations:
            row = run(session, prompts, policy, together, args.max_tokens)
            key = (policy, together)
            if key not in best or row["tokens_per_second"] > best[key]["tokens_per_second"]:
                best[key] = row
    reference = best[(policies[0], True)]["tokens"]
    rows = []
    for row in best.values():
        row["identical"] = sum(a == b for a, b in zip(row.pop("tokens"), reference, strict=True))
        rows.append(row)
    machine = f"{cpu_model() or platform.machine()}, {describe(report())}"
    pair = f"{args.target or 'the default target'} + {args.drafter or 'its shipped drafter'}"
    print(
        f"{args.clients} sequences, {args.max_tokens} tokens each, {pair}, {machine};"
        f" best of {args.repeats}; identical to {policies[0]}'s tokens"
    )
    print("| policy | drafting | tokens/s | rounds | ms/round | drafting ms/round | identical |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['policy']} | {r['drafting']} | {r['tokens_per_second']:.1f} | {r['rounds']} |"
            f" {r['ms_per_round']:.0f} | {r['draft_ms_per_round']:.1f} |"
            f" {r['identical']}/{args.clients} |"
        )
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"machine": machine, "rows": rows}, file, indent=2)


if __name__ == "__main__":
    main()
