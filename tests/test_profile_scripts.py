"""benchmarks/round_profile.py, benchmarks/head_noise.py, benchmarks/prefill_batch.py and
benchmarks/prefill_chunks.py, steps of the GPU check, run on the CPU with the demo pair: a GPU
lease is too short to find a broken script there; benchmarks/family_sweep.py on one family;
benchmarks/blas_matmuls.py at one row count."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from woodcock.demo import write_demo

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def run_script(name: str, *args: str) -> dict:
    out = Path(args[args.index("--json") + 1])
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / name), *args], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_round_profile_and_head_noise_on_the_demo_pair(tmp_path):
    write_demo(tmp_path / "demo")
    target = str(tmp_path / "demo" / "target")
    found = run_script(
        "round_profile.py",
        *("--target", target, "--drafter", str(tmp_path / "demo" / "drafter"), "--no-chat"),
        *("--rounds", "3", "--repeats", "1", "--json", str(tmp_path / "round.json")),
    )
    assert found["identical"] and found["tokens_per_round"] >= 1
    phases = ["draft build", "draft wait", "verify build", "verify wait", "commit"]
    rounds = ["round as run", "round drafts early", "round staged", "round scores read"]
    rounds += ["round, phases forced"]
    plain = ["plain step build", "plain step wait", "plain step", "mlx-lm generate_step"]
    assert set(found["ms"]) == set(phases + rounds + plain)
    assert all(value > 0 for value in found["ms"].values())
    counts = found["operations"]
    assert counts["verify"] > counts["plain step"] > 0 and counts["draft"] > 0

    noise = run_script(
        "head_noise.py", "--target", target, "--no-chat", "--json", str(tmp_path / "head.json")
    )
    assert noise["dtype"] == "bfloat16"
    # the CPU computes a bf16 row alike alone and among others, and the model's head is its own
    assert noise["hidden"] == noise["logits"] == noise["fp32_head_logits"] == 0
    assert noise["own_head_difference"] == 0 and noise["logit_step"] > 0
    assert noise["greedy_positions"] == 128
    assert noise["greedy_near_ties"] >= noise["greedy_not_argmax"]  # every tie is flagged
    choices = ("argmax", "near_ties", "greedy_tokens")
    assert all(noise[f"ms_{c}_{rows}_rows"] > 0 for c in choices for rows in (1, 4, 32))
    assert all(
        noise[f"ms_{head}_head_{rows}_rows"] > 0 for head in ("model", "fp32") for rows in (1, 4)
    )


def test_prefill_batch_on_the_demo_target(tmp_path):
    write_demo(tmp_path / "demo")
    found = run_script(
        "prefill_batch.py",
        *("--target", str(tmp_path / "demo" / "target"), "--rows", "3", "--lengths", "4,9"),
        *("--repeats", "1", "--dtype", "bfloat16", "--json", str(tmp_path / "prefill.json")),
    )
    assert found["dtype"] == "bfloat16" and [r["tokens"] for r in found["rows"]] == [4, 9]
    for row in found["rows"]:
        assert row["alone_ms"] > 0 and row["together_ms"] > 0 and row["in_turn_mean"] == 2
        assert row["together_mean"] == pytest.approx(row["together_ms"] / row["alone_ms"])


def test_prefill_chunks_on_the_demo_target(tmp_path):
    write_demo(tmp_path / "demo")
    found = run_script(
        "prefill_chunks.py",
        *("--target", str(tmp_path / "demo" / "target"), "--lengths", "9,300"),
        *("--repeats", "2", "--json", str(tmp_path / "chunks.json")),
    )
    assert found["dtype"] == "float32" and [r["tokens"] for r in found["rows"]] == [9, 300]
    assert [(r["gpu_forwards"], r["cpu_forwards"]) for r in found["rows"]] == [(1, 1), (1, 2)]
    for row in found["rows"]:
        assert row["gpu_ms"] > 0 and row["cpu_ms"] > 0
        assert row["cpu_speedup"] == pytest.approx(row["gpu_ms"] / row["cpu_ms"])


@pytest.mark.slow
def test_family_sweep_tells_identical_from_refused(tmp_path):
    found = run_script(
        "family_sweep.py",
        *("--families", "internlm2", "--tokens", "8", "--draft-lengths", "4"),
        *("--json", str(tmp_path / "sweep.json")),
    )
    runs = found["families"]["internlm2"]
    assert len(runs) == 9
    for r in runs:  # its head is `output`: the drafters that share it are refused
        assert r["outcome"] == ("identical" if r["kind"] == "lookup" else "refused"), r


def test_blas_matmuls_times_both_blas_kinds(tmp_path):
    from woodcock.runtime.openblas import find_openblas

    found = run_script(
        "blas_matmuls.py", "--rows", "2", "--repeats", "1", "--json", str(tmp_path / "b.json")
    )
    assert [row["shape"] for row in found["rows"]] == ["mlp 2", "head 2"]
    for row in found["rows"]:
        assert row["openblas_ms"] > 0 and row["linked_ms"] > 0
        assert row["speedup"] == pytest.approx(row["linked_ms"] / row["openblas_ms"])
    assert found["blas"]["linked"]["library"] != "openblas"
    if sys.platform == "linux" and find_openblas().exists():
        assert found["blas"]["openblas"]["library"] == "openblas"
