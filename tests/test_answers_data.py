"""The default target's answers kept for training (data/smollm2-135m-answers): well formed, as
`woodcock distill` writes them, and read whole by the trainer."""

from __future__ import annotations

import json
import lzma
import shutil
from pathlib import Path

from woodcock.train.data import load_samples

DATA = Path(__file__).resolve().parents[1] / "data" / "smollm2-135m-answers"
TARGET_VOCAB = 49152


def answer_lines() -> list[str]:
    lines = []
    for part in sorted(DATA.glob("answers-*.jsonl.xz")):
        text = lzma.decompress(part.read_bytes()).decode()
        assert text.endswith("\n"), f"{part}: a part ends with a whole line"
        lines += text.splitlines()
    return lines


def test_the_answers_are_greedy_answers_the_trainer_reads(tmp_path):
    meta = json.loads((DATA / "distill.json").read_text())
    assert meta["decoding"] == "greedy" and meta["chat"] is True and meta["system"] is None
    assert meta["target"].startswith("SmolLM2-135M-Instruct")
    limit, stops = meta["max_tokens"], set(meta["eos_ids"])
    lines = answer_lines()
    rows = [json.loads(line) for line in lines]
    assert len({row["id"] for row in rows}) == len(rows) > 0
    for row in rows:
        answer = row["answer_ids"]
        assert 1 <= len(answer) <= limit and not stops & set(answer[:-1]), row["id"]
        if row["finish_reason"] == "stop":
            assert answer[-1] in stops, row["id"]
        else:
            assert row["finish_reason"] == "length" and len(answer) == limit, row["id"]
    shutil.copyfile(DATA / "distill.json", tmp_path / "distill.json")
    (tmp_path / "answers.jsonl").write_text("".join(f"{line}\n" for line in lines))
    longest = max(len(row["prompt_ids"]) + len(row["answer_ids"]) for row in rows)
    samples = load_samples(tmp_path, longest, vocab_size=TARGET_VOCAB)
    assert [s.id for s in samples] == [row["id"] for row in rows]
