"""`woodcock latency`, the auto policy and `woodcock bench` on the offline demo pair, with short
settings (speed is measured by these commands, never asserted here)."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import run_cli

from woodcock.bench import ideal_seconds
from woodcock.cli import main
from woodcock.runtime.decode import Stats
from woodcock.runtime.latency import (
    LatencyProfile,
    acceptance_needed_table,
    non_decreasing,
    timed_sweeps,
    write_profile,
)
from woodcock.runtime.ngram import MAX_COPY


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "demo"
    try:
        main(["demo", str(path)])
    except SystemExit as e:
        assert not e.code
    np.savez(path / "counts.npz", counts=np.arange(320, 0, -1))
    return path


def test_latency_profile_and_auto_policy(demo, capsys, tmp_path):
    out = tmp_path / "profiles" / "latency.json"  # a folder made for it
    drafter = f"{demo / 'drafter'}@{demo / 'counts.npz'}:64,128"
    code, stdout, err = run_cli(["latency", "--target", str(demo / "target"), "--drafter", drafter, "--out", str(out), "--contexts", "16,48", "--repeats", "1"], capsys)
    assert code == 0, err
    data = json.loads(out.read_text())
    assert set(data["verify_seconds"]) == {"16", "48"} and all(len(v) == 16 for v in data["verify_seconds"].values())
    assert set(data["draft_seconds"]) == {"full", "64", "128"} and all(len(v) == 8 for v in data["draft_seconds"].values())
    assert data["machine"] and data["dtype"] == "float32"
    for curve in (*data["verify_seconds"].values(), *data["draft_seconds"].values()):
        assert curve == sorted(curve)
    profile = LatencyProfile.load(out)
    assert profile.best_length([0.9] * 8, 32) >= 1
    assert "acceptance needed at every draft position (context 16, head full)" in stdout
    assert stdout.splitlines()[-3].split()[:2] == ["speed-up", "K=1"]
    code, _, err = run_cli(["latency", "--target", str(demo / "target"), "--drafter", drafter, "--out", str(out)], capsys)
    assert code == 2 and "already exists" in err
    code, stdout, err = run_cli(["latency", "--target", str(demo / "target"), "--drafter", drafter, "--out", str(tmp_path)], capsys)
    assert code == 2 and err.strip() == f"woodcock: error: {tmp_path}: is a directory; expected the path of a file to write"
    assert not stdout  # refused before measuring
    assert sorted(p.name for p in out.parent.iterdir()) == ["latency.json"]  # nothing left aside

    base = ["generate", "--target", str(demo / "target"), "--prompt", "The quick brown", "--max-tokens", "40", "--no-chat", "--json"]
    fixed = json.loads(run_cli(base + ["--drafter", str(demo / "drafter")], capsys)[1])
    auto = json.loads(run_cli(base + ["--drafter", f"{demo / 'drafter'}@{demo / 'counts.npz'}:128", "--policy", f"auto:{out}"], capsys)[1])
    assert auto["text"] == fixed["text"]
    # how much auto drafts depends on this machine's timings (on the tiny demo pair drafting
    # costs about what verifying does, so plain steps may win); its bounds do not
    assert auto["policy"] == f"auto:{out}" and max(auto["draft_lengths"]) <= MAX_COPY


def test_auto_policy_without_a_file_measures_once_and_keeps_the_profile(demo, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    args = ["generate", "--target", str(demo / "target"), "--drafter", str(demo / "drafter"), "--prompt", "The quick brown", "--max-tokens", "24", "--no-chat", "--json"]
    first = json.loads(run_cli(args, capsys)[1])
    (profile,) = (tmp_path / "woodcock" / "latency").glob("*.json")
    assert first["policy"] == f"auto:{profile}"
    data = json.loads(profile.read_text())
    assert list(data["verify_seconds"]) == ["256"] and len(data["verify_seconds"]["256"]) == 16
    assert list(data["draft_seconds"]) == ["full"] and len(data["draft_seconds"]["full"]) == 7
    assert LatencyProfile.load(profile).max_verify == 16
    written = profile.stat().st_mtime_ns
    second = json.loads(run_cli(args + ["--policy", "auto"], capsys)[1])
    assert profile.stat().st_mtime_ns == written and second["policy"] == first["policy"]
    assert max(second["draft_lengths"]) <= 15
    fixed = json.loads(run_cli(args + ["--policy", "fixed:2"], capsys)[1])
    assert first["text"] == second["text"] == fixed["text"]
    # a damaged cache entry is measured again
    profile.write_text(profile.read_text()[:50])
    assert json.loads(run_cli(args, capsys)[1])["text"] == first["text"]
    assert LatencyProfile.load(profile).max_verify == 16
    # another head is another profile
    run_cli(args[:4] + [f"{demo / 'drafter'}@{demo / 'counts.npz'}:64"] + args[5:], capsys)
    assert len(list((tmp_path / "woodcock" / "latency").glob("*.json"))) == 2
    assert not list((tmp_path / "woodcock" / "latency").glob(".*"))


def test_auto_policy_needs_a_profile_outside_the_command():
    from woodcock.errors import DrafterError
    from woodcock.runtime.policy import parse_policy

    with pytest.raises(DrafterError, match=r"--policy auto: needs a latency file"):
        parse_policy("auto", SimpleNamespace(num_drafts=None))  # a chain drafter


def test_bench_table_json_and_chart(demo, capsys, tmp_path):
    chart = tmp_path / "charts" / "bench.png"  # a folder made for it
    args = ["bench", "--target", str(demo / "target"), "--drafter", str(demo / "drafter"), "--domains", "chat,code", "--prompts", "1", "--max-tokens", "16", "--no-chat"]
    code, out, err = run_cli(args + ["--chart", str(chart)], capsys)
    assert code == 0, err
    assert "greedy outputs identical to plain mlx-lm decoding on 2 of 2 prompts" in out
    assert out.splitlines()[0] == f"{demo / 'drafter'}, policy auto, with lookup"
    assert "plain mlx-lm decoding:" not in out  # one run: no comparison table
    setting = out.splitlines()[-1]
    assert setting.startswith("16 new tokens, greedy, batch 1; ") and " backend, BLAS " in setting
    for column in ("baseline tok/s", "woodcock tok/s", "speedup", "ideal", "of ideal", "tok/round", "copied", "acceptance by position"):
        assert column in out
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, out, err = run_cli(args + ["--chart", str(chart)], capsys)
    assert code == 2 and err.strip() == f"woodcock: error: {chart}: already exists; pass --force to replace it"
    assert not out  # refused before measuring
    chart.write_bytes(b"old")
    code, out, err = run_cli(args + ["--json", "--chart", str(chart), "--force"], capsys)
    assert code == 0, err
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and sorted(p.name for p in chart.parent.iterdir()) == ["bench.png"]
    (run,) = json.loads(out)["runs"]
    assert run["drafter"] == str(demo / "drafter") and run["policy"] == "auto"
    assert [row["domain"] for row in run["rows"]] == ["chat", "code", "all"]
    assert run["rows"][-1]["identical"] == 2 and run["lookup"] is True
    assert all(0 <= row["copied_rounds"] + row["extended_rounds"] <= row["rounds"] for row in run["rows"])
    for row in run["rows"]:
        assert row["ideal_speedup"] > 0
        assert row["measured_over_ideal"] == pytest.approx(row["speedup"] / row["ideal_speedup"])
    code, out, err = run_cli(args + ["--json", "--no-lookup"], capsys)
    assert code == 0, err
    (run,) = json.loads(out)["runs"]
    assert run["lookup"] is False and run["rows"][-1]["copied_rounds"] == run["rows"][-1]["extended_rounds"] == 0


@pytest.fixture(scope="module")
def demo_dspark(demo):
    """A random DSpark drafter for the demo target."""
    from woodcock.loading import save_drafter
    from woodcock.synthetic import random_drafter, tiny_spec

    config = json.loads((demo / "target" / "config.json").read_text())
    spec = tiny_spec(
        "dspark",
        style="qwen3",
        hidden_size=config["hidden_size"],
        vocab_size=config["vocab_size"],
        target_layers=config["num_hidden_layers"],
        block_size=4,
    )
    save_drafter(random_drafter(spec, seed=5), demo / "dspark")
    return demo / "dspark"


def test_bench_compares_drafters_policies_and_lookup_against_one_baseline(demo, demo_dspark, capsys, tmp_path):
    profile = tmp_path / "latency.json"
    write_profile(profile, {"machine": {}, "draft_kind": "block", "verify_seconds": {"64": [0.01 * (1 + k / 8) for k in range(16)]}, "draft_seconds": {"full": [0.004] * 4}})
    args = ["bench", "--target", str(demo / "target"), "--drafter", str(demo / "drafter"), "--drafter", str(demo_dspark), "--domains", "chat,code", "--prompts", "1", "--max-tokens", "12", "--no-chat", "--policy", "fixed:2", "--policy", f"confidence:{profile}", "--compare-lookup"]
    code, out, err = run_cli(args + ["--json", "--chart", str(tmp_path / "chart.png")], capsys)
    assert code == 0, err
    runs = json.loads(out)["runs"]
    # confidence does not apply to the EAGLE-3 drafter: left out for it, kept for DSpark
    expected = [(str(demo / "drafter"), "fixed:2", True), (str(demo / "drafter"), "fixed:2", False)]
    for policy in ("fixed:2", f"confidence:{profile}"):
        expected += [(str(demo_dspark), policy, True), (str(demo_dspark), policy, False)]
    assert [(r["drafter"], r["policy"], r["lookup"]) for r in runs] == expected
    totals = [run["rows"][-1] for run in runs]
    assert all(t["identical"] == t["prompts"] == 2 for t in totals)
    # plain decoding ran once a prompt: every run is set against the same baseline
    assert len({t["baseline_tps"] for t in totals}) == 1
    assert all(run["rows"][-1]["copied_rounds"] == 0 for run in runs if not run["lookup"])
    assert (tmp_path / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, out, err = run_cli(args, capsys)
    assert code == 0, err
    lines = out.splitlines()
    start = lines.index(next(line for line in lines if line.startswith("plain mlx-lm decoding: ")))
    assert lines[start + 1].split()[:2] == ["run", "woodcock"]
    compared = lines[start + 3 : start + 3 + len(expected)]
    assert [line.split(",")[0] for line in compared] == [d for d, _, _ in expected]
    assert all(line.rstrip().endswith("2 / 2") for line in compared)


def test_bench_refuses_a_policy_no_drafter_takes(demo, capsys, tmp_path):
    args = ["bench", "--target", str(demo / "target"), "--drafter", str(demo / "drafter"), "--prompts", "1", "--max-tokens", "4", "--no-chat", "--policy", "fixed:2", "--policy", "confidence"]
    code, out, err = run_cli(args, capsys)
    assert code == 2 and "--policy confidence is for block drafters (DFlash, DSpark)" in err, err
    assert len(err.strip().splitlines()) == 1


def test_ngram_drafter_through_generate_and_bench(demo, capsys):
    code, out, err = run_cli(["bench", "--target", str(demo / "target"), "--drafter", "ngram", "--domains", "code", "--prompts", "1", "--max-tokens", "16", "--no-chat"], capsys)
    assert code == 0, err
    assert "identical to plain mlx-lm decoding on 1 of 1" in out


def test_the_ideal_prices_each_round_at_the_profiles_cost():
    profile = LatencyProfile(
        verify_seconds={0: [1.0, 1.5, 2.0, 2.5, 3.0], 100: [2.0, 3.0, 4.0, 5.0, 6.0]},
        draft_seconds={"full": [0.25, 0.5, 0.75]},
        draft_kind="chain",
    )
    stats = Stats(prompt_tokens=50)
    rounds = [  # drafts verified, accepted, copied, extended, drafts made
        (2, 2, False, 0, 2),  # context 50: verify 3 rows 3.0 + draft 2 0.5; plain 1.50 + 1.51 + 1.52
        (4, 1, True, 0, 0),  # context 53: verify 5 rows 4.59 + nothing drafted; plain 1.53 + 1.54
        (3, 0, False, 2, 1),  # context 55: verify 4 rows 3.875 + the drafter's 1 draft 0.25; plain 1.55
        (0, 0, False, 0, 0),  # context 56: a plain step 1.56
        (1, 0, False, 0, 3),  # context 57: verify 2 rows 2.355 + 3 drafts 0.75, 2 cut; plain 1.57
        (0, 0, False, 0, 2),  # context 58: 2 drafts 0.5, both cut: a plain step 1.58
    ]
    for drafted, accepted, copied, extended, made in rounds:
        stats.drafted.append(drafted)
        stats.accepted.append(accepted)
        stats.copied.append(copied)
        stats.extended.append(extended)
        stats.drafts_made.append(made)
    plain, spent = ideal_seconds(stats, profile, "full")
    assert plain == pytest.approx((1.50 + 1.51 + 1.52) + (1.53 + 1.54) + 1.55 + 1.56 + 1.57 + 1.58)
    assert spent == pytest.approx(
        (3.0 + 0.5) + 4.59 + (3.875 + 0.25) + 1.56 + (2.355 + 0.75) + (1.58 + 0.5)
    )


def test_a_profile_written_by_hand_is_read_non_decreasing_and_never_negative(tmp_path):
    from woodcock.errors import DrafterError

    path = tmp_path / "latency.json"
    dipping = [0.1 * k for k in range(1, 9)] + [0.3] * 8  # falls after 8 rows
    data = {"machine": {}, "draft_kind": "chain", "draft_seconds": {"full": [0.01, 0.005]}}
    write_profile(path, {**data, "verify_seconds": {"32": dipping}})
    profile = LatencyProfile.load(path)
    costs = [profile.verify_cost(k, 32) for k in range(1, 40)]
    assert costs == sorted(costs) and min(costs) > 0
    assert profile.draft_cost(2) >= profile.draft_cost(1)
    write_profile(path, {**data, "verify_seconds": {"32": [0.1, -0.2]}})
    with pytest.raises(DrafterError, match="expected finite, non-negative seconds"):
        LatencyProfile.load(path)


def test_acceptance_needed_solves_expected_tokens_per_round_against_the_cost(tmp_path):
    path = tmp_path / "latency.json"
    # verifying costs 0.1 s for up to 4 rows, 0.2 s beyond; drafting 0.01 s per token
    verify = [0.1] * 4 + [0.2] * 12
    data = {"machine": {}, "draft_kind": "chain", "verify_seconds": {"64": verify}}
    write_profile(path, {**data, "draft_seconds": {"full": [0.01 * k for k in range(1, 9)]}})
    profile = LatencyProfile.load(path)
    # K=1: (1 + a) / 0.11 = 1.5 / 0.1 -> a = 0.65
    assert profile.acceptance_needed(1.5, 1, 64) == pytest.approx(0.65)
    # K=2: 1 + a + a^2 = 2 * 0.12 / 0.1 = 2.4 -> a = (-1 + sqrt(1 + 4 * 1.4)) / 2
    assert profile.acceptance_needed(2.0, 2, 64) == pytest.approx((-1 + 6.6**0.5) / 2)
    assert profile.acceptance_needed(2.0, 1, 64) is None  # two tokens cost more than two steps
    assert profile.acceptance_needed(0.5, 1, 64) == pytest.approx(0.0, abs=1e-9)  # any drafter
    # K=4 verifies five rows (0.2 s): 1 + a + ... + a^4 = 1.5 * 0.24 / 0.1 = 3.6
    a = profile.acceptance_needed(1.5, 4, 64)
    assert sum(a**j for j in range(5)) == pytest.approx(3.6)
    header, faster, fastest = acceptance_needed_table(profile, 64, max_length=4)
    assert header.split() == ["speed-up", "K=1", "K=2", "K=3", "K=4"]
    assert faster.split()[:2] == ["1.5x", "0.65"] and fastest.split()[:2] == ["2x", "-"]


def test_non_decreasing_pools_dips_and_keeps_a_rising_curve():
    assert non_decreasing([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    assert non_decreasing([1.0, 3.0, 2.0, 4.0]) == [1.0, 2.5, 2.5, 4.0]
    assert non_decreasing([5.0, 1.0, 0.0]) == [2.0, 2.0, 2.0]
    assert non_decreasing([0.08, 0.099, 0.106, 0.114, 0.133, 0.117, 0.126, 0.117]) == pytest.approx(
        [0.08, 0.099, 0.106, 0.114, 0.12325, 0.12325, 0.12325, 0.12325]
    )
    assert non_decreasing([]) == []


def test_timed_sweeps_interleave_the_runs():
    order = []
    runs = [lambda i=i: order.append(i) for i in range(3)]
    ticks = []
    medians = timed_sweeps(runs, warmup=1, repeats=2, advance=lambda: ticks.append(1))
    assert order == [0, 1, 2, 0, 1, 2, 0, 1, 2] and len(ticks) == 6 and len(medians) == 3


def test_bench_runs_a_prompt_file_a_user_brings(demo, capsys, tmp_path):
    prompts = tmp_path / "mine.jsonl"
    rows = [{"domain": "poems", "prompt": "The quick brown"}, {"domain": "facts", "prompt": "fox jumps", "note": "ignored"}]
    rows += [{"domain": "poems", "prompt": "over the lazy"}]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows) + "\n")
    args = ["bench", "--target", str(demo / "target"), "--drafter", str(demo / "drafter"), "--prompt-file", str(prompts), "--max-tokens", "8", "--no-chat", "--policy", "fixed:2", "--json"]
    code, out, err = run_cli(args, capsys)
    assert code == 0, err
    (run,) = json.loads(out)["runs"]
    assert [(row["domain"], row["prompts"]) for row in run["rows"]] == [("poems", 2), ("facts", 1), ("all", 3)]
    code, out, err = run_cli(args + ["--domains", "facts"], capsys)
    assert [(row["domain"], row["prompts"]) for row in json.loads(out)["runs"][0]["rows"]] == [("facts", 1), ("all", 1)]
    code, out, err = run_cli(args + ["--prompts", "1"], capsys)
    assert [(row["domain"], row["prompts"]) for row in json.loads(out)["runs"][0]["rows"]] == [("poems", 1), ("facts", 1), ("all", 2)]


@pytest.mark.parametrize(
    "text,message",
    [
        ("not json\n", "mine.jsonl:1: not valid JSON"),
        ('{"domain": "x"}\n', "mine.jsonl:1: 'prompt' must be a non-empty string"),
        ('["a"]\n', "mine.jsonl:1: expected an object"),
        ("\n\n", "mine.jsonl: no prompts"),
    ],
)
def test_a_broken_prompt_file_is_refused_with_one_line(demo, capsys, tmp_path, text, message):
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text(text)
    args = ["bench", "--target", str(demo / "target"), "--drafter", str(demo / "drafter"), "--prompt-file", str(prompts), "--no-chat"]
    code, out, err = run_cli(args, capsys)
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1, err
