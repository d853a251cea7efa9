"""The library functions the commands call, without the command line: the demo pair, one
generation and its report, the latency profile of a pair, the bench runs and their report."""

import json

import numpy as np
import pytest

from woodcock.bench import TABLE_NOTES, bench_runs, benchmark
from woodcock.demo import write_demo
from woodcock.errors import DrafterError
from woodcock.generation import generate_report
from woodcock.loading import load_drafter
from woodcock.runtime import latency
from woodcock.runtime.eagle3 import Eagle3Drafter
from woodcock.runtime.latency import (
    QUICK_DRAFT,
    QUICK_VERIFY,
    LatencyProfile,
    measure,
    measure_pair,
    policy_with_profile,
    profile_summary,
)
from woodcock.runtime.session import open_session, runtime_drafter

REPORT_FIELDS = {
    "text", "finish_reason", "prompt_tokens", "prompt_tps", "generation_tokens",
    "generation_tps", "rounds", "tokens_per_round", "acceptance_by_position", "copied_rounds",
    "copied_tokens_per_round", "extended_rounds", "policy", "average_draft_length",
    "draft_lengths", "draft_seconds", "verify_seconds", "peak_memory_gb", "backend",
}  # fmt: skip


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path = tmp_path_factory.mktemp("reports") / "demo"
    write_demo(path)
    return str(path / "target"), str(path / "drafter")


def test_write_demo_refuses_an_existing_directory_unless_forced(pair):
    target, drafter = pair
    root = drafter.rsplit("/", 1)[0]
    assert load_drafter(drafter).spec.target.name_or_path == target
    with pytest.raises(DrafterError, match="already exists"):
        write_demo(root)


def test_generate_report_fields_text_and_streamed_pieces(pair):
    pieces = []
    report = generate_report(
        *pair, "The quick brown", policy="fixed:4", max_tokens=16, chat=False,
        on_text=pieces.append,
    )  # fmt: skip
    fields = report.fields
    assert set(fields) == REPORT_FIELDS
    assert "".join(pieces) == fields["text"] and fields["generation_tokens"] == 16
    assert fields["policy"] == "fixed:4" and len(fields["draft_lengths"]) == fields["rounds"]
    json.dumps(fields)  # what --json prints
    text = report.render_text()
    assert text.startswith("\n==========\nprompt: ") and "draft length (fixed:4): " in text
    assert fields["backend"]["backend"] == "cpu" and text.endswith("\nbackend: cpu backend")
    assert report.lookup and "\nprompt lookup: " in text
    plain = generate_report(
        *pair, "The quick brown", policy="fixed:1", max_tokens=16, chat=False, lookup=False
    )
    assert plain.fields["text"] == fields["text"]  # greedy: the target's own tokens
    assert not plain.lookup and "prompt lookup" not in plain.render_text()


def test_policy_with_profile_measures_once_and_leaves_other_policies(pair):
    session = open_session(*pair)
    assert policy_with_profile("fixed:3", session, *pair) == "fixed:3"
    assert policy_with_profile("auto:given.json", session, *pair) == "auto:given.json"
    steps = []
    first = policy_with_profile("auto", session, *pair, progress=lambda *step: steps.append(step))
    kind, _, path = first.partition(":")
    profile = LatencyProfile.load(path)
    assert kind == "auto" and profile.max_verify == 16
    assert steps[-1] == ((len(QUICK_VERIFY) + QUICK_DRAFT) * 3,) * 2  # only these are timed
    again = []
    assert policy_with_profile("auto", session, *pair, progress=lambda *s: again.append(s)) == first
    assert not again  # kept in the user cache


def test_measure_interpolates_the_verification_lengths_it_does_not_time(pair, monkeypatch):
    session = open_session(*pair)
    squares = lambda runs, **_: [float(i * i) for i in range(len(runs))]  # noqa: E731
    monkeypatch.setattr(latency, "timed_sweeps", squares)
    drafters = {"full": session.drafter}
    profile = measure(session.target, drafters, contexts=(8,), verify_lengths=(1, 2, 4, 8))
    # timed: k = 1, 2, 4, 8 -> 0, 1, 4, 9
    assert profile["verify_seconds"]["8"] == [0, 1, 2.5, 4, 5.25, 6.5, 7.75, 9]


def test_measure_pair_writes_the_profile_and_its_summary(pair, tmp_path):
    out = tmp_path / "latency.json"
    steps = []
    written = measure_pair(
        *pair, out, contexts=(24, 8), repeats=1, progress=lambda *step: steps.append(step)
    )
    assert json.loads(out.read_text())["verify_seconds"] == written["verify_seconds"]
    assert list(written["verify_seconds"]) == ["24", "8"] and list(written["draft_seconds"]) == [
        "full"
    ]
    assert [done for done, _ in steps] == list(range(1, len(steps) + 1))
    assert steps[-1] == (steps[-1][1], steps[-1][1]) == ((2 * 16 + 8), (2 * 16 + 8))
    summary = profile_summary(out).splitlines()
    assert summary[0].startswith(f"wrote {out} (cpu backend): verify 1 token ") and "(context 24)" in summary[0]
    assert summary[1].startswith("acceptance needed at every draft position (context 24, head full)")
    assert all(line.startswith("  ") for line in summary[2:]) and len(summary) > 2


def test_bench_runs_leave_out_a_policy_for_other_drafters_and_refuse_one_none_takes(pair):
    target, drafter = pair
    runs = bench_runs(target, [drafter], ["fixed:2"], (True, False), None)
    assert [(run.policy, run.lookup) for run in runs] == [("fixed:2", True), ("fixed:2", False)]
    assert runs[0].session.model is runs[1].session.model
    assert runs[0].label == f"{drafter}, policy fixed:2, with lookup"
    with pytest.raises(DrafterError, match="--policy confidence is for block drafters"):
        bench_runs(target, [drafter], ["fixed:2", "confidence"], (True,), None)


def test_benchmark_report(pair, tmp_path):
    prompts = tmp_path / "mine.jsonl"
    rows = [{"domain": "poems", "prompt": "The quick brown"}, {"domain": "facts", "prompt": "fox"}]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    steps = []
    report = benchmark(
        pair[0], [pair[1]], ["fixed:2"], prompt_file=prompts, max_tokens=8, chat=False,
        compare_lookup=True, progress=lambda *step: steps.append(step),
    )  # fmt: skip
    assert report.identical and steps[-1] == (4, 4)
    data = report.as_json()
    assert data["max_tokens"] == 8 and data["machine"] == report.machine
    assert [(run["policy"], run["lookup"]) for run in data["runs"]] == [
        ("fixed:2", True),
        ("fixed:2", False),
    ]
    assert [row["domain"] for row in data["runs"][0]["rows"]] == ["poems", "facts", "all"]
    text = report.render_text()
    assert text.startswith(f"{pair[1]}, policy fixed:2, with lookup\n")
    assert "plain mlx-lm decoding: " in text and TABLE_NOTES in text
    assert text.splitlines()[-1].startswith("8 new tokens, greedy, batch 1; ")


def test_runtime_drafter_of_the_ir_with_or_without_a_truncated_head(pair):
    session = open_session(*pair)
    full = runtime_drafter(session.ir, session.shared)
    assert isinstance(full, Eagle3Drafter)
    head = np.arange(64)
    truncated = runtime_drafter(session.ir, session.shared, head_ids=head)
    assert np.array_equal(np.array(truncated.head_target_ids), head)
