"""benchmarks/gpu_drafters.py, the script a GPU lease runs, on the CPU: staged here, run end to
end on the demo target (--small), its pieces joined back here."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import write_corpus_prompts

from woodcock.demo import write_demo
from woodcock.loading import load_drafter
from woodcock.train.distill import distill, read_answers

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_drafters.py"


def script(*args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=cwd
    )


@pytest.mark.slow
def test_staged_run_and_joined_back(tmp_path):
    work = tmp_path / "work"
    write_demo(work / "demo")
    target = work / "demo" / "target"
    prompts = write_corpus_prompts(tmp_path / "prompts.jsonl", 14)
    answered = tmp_path / "answered"
    # answers made here first: the run continues them with the same recipe
    head = tmp_path / "head.jsonl"
    head.write_text("".join(prompts.read_text().splitlines(keepends=True)[:5]))
    distill(str(target), head, answered, max_tokens=12, batch=4)

    staged = tmp_path / "staged"
    done = script(
        "stage", "--prompts", str(prompts), "--answers", str(answered), "--out", str(staged)
    )
    assert done.returncode == 0, done.stderr
    assert "5 answers and 9 of 9 pending prompts" in done.stdout

    out = tmp_path / "out"
    done = script("run", "--small", "--data", str(staged), "--out", str(out), "--work", str(work))
    assert done.returncode == 0, done.stderr
    summary = json.loads((out / "summary.json").read_text())
    failed = [s for s in summary["steps"] if s["exit"] != 0]
    assert not failed, failed
    assert summary["distill"]["staged"]["answers"] == 5 and summary["distill"]["answers"] == 14
    probes = {"probe-dspark-2", "probe-dspark-4", "probe-dspark-4-anchors8", "probe-eagle3-4"}
    assert set(summary["probes"]) == probes
    assert all(found["tokens_per_second"] > 0 for found in summary["probes"].values())
    assert summary["runs"]["dspark"]["anchors"] in (None, 8)
    for run in summary["runs"].values():
        assert run["steps_done"] == run["steps_planned"] and run["drafter"]
    assert len(summary["bench"]["runs"]) == 2
    # at most 8 files come back from a lease
    assert len(list(out.iterdir())) <= 8

    done = script("join", str(out), "--dest", str(tmp_path / "back"))
    assert done.returncode == 0, done.stderr
    back = tmp_path / "back"
    for name in ("dspark", "eagle3"):
        drafter = load_drafter(back / "drafters" / f"woodcock-{name}")
        assert drafter.spec.algorithm.name == name
        assert {str(v.dtype) for v in drafter.weights.values()} == {"bfloat16"}
    with gzip.open(back / "answers" / "answers-made.jsonl.gz", "rt") as f:
        made = [json.loads(line) for line in f]
    everything = read_answers(work / "distill")
    assert made == everything[5:] and len(made) == 9
    assert {row["id"] for row in everything} == {f"p{i}" for i in range(14)}

    # a damaged piece is refused, and nothing is unpacked
    piece = next(out.glob("results.tar.*"))
    piece.write_bytes(piece.read_bytes()[:-1] + b"x")
    done = script("join", str(out), "--dest", str(tmp_path / "again"))
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0
    assert f"{piece}: sha256 differs" in done.stderr and not (tmp_path / "again").exists()
