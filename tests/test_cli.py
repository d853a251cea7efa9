import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import run_cli

from woodcock.loading import save_drafter
from woodcock.synthetic import random_drafter, tiny_spec

WOODCOCK = Path(sys.executable).with_name("woodcock")


@pytest.fixture
def drafter_dir(tmp_path):
    spec = tiny_spec(
        "eagle3", num_layers=2, draft_vocab_size=64, tap_norm="per_tap", norm_output=True
    )
    path = tmp_path / "eagle"
    save_drafter(random_drafter(spec, "BF16"), path)
    return path


def test_inspect_text(drafter_dir, capsys):
    code, out, err = run_cli(["inspect", str(drafter_dir)], capsys)
    assert code == 0, err
    assert "format      woodcock" in out
    assert "eagle3 (norm_before_residual=False, norm_output=True, speculative_tokens=3)" in out
    assert "[1, 2, 3] (after_layers) canonical; stored as [1, 2, 3] (after_layers)" in out
    assert "per-tap RMSNorm -> fc" in out
    assert "layer 0" in out and "input embed_and_hidden" in out and "layer 1" in out
    assert "64 of 96 target ids (mapped)" in out
    assert "BF16" in out
    assert "reduced draft vocabulary without token counts" in out


def test_inspect_json(drafter_dir, capsys):
    code, out, _ = run_cli(["inspect", "--json", str(drafter_dir)], capsys)
    assert code == 0
    report = json.loads(out)
    assert report["format"] == "woodcock"
    assert report["algorithm"]["name"] == "eagle3"
    assert report["taps"]["canonical"] == {"convention": "after_layers", "layer_ids": [1, 2, 3]}
    assert report["taps"]["stored"]["layer_ids"] == [1, 2, 3]
    assert report["vocab"]["draft_vocab_size"] == 64 and report["vocab"]["mapped"]
    assert report["parameters"]["shared"] == 96 * 32  # the embedding
    assert report["dtypes"] == {
        "BF16": len(
            tiny_spec(
                "eagle3", num_layers=2, draft_vocab_size=64, tap_norm="per_tap"
            ).tensor_shapes()
        )
    }


def test_inspect_damaged_copy_exits_2_with_one_line(drafter_dir, tmp_path):
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    for f in drafter_dir.iterdir():
        (damaged / f.name).write_bytes(f.read_bytes())
    weights = damaged / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    result = subprocess.run([WOODCOCK, "inspect", str(damaged)], capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr
    assert lines[0].startswith("woodcock: error: ") and "model.safetensors" in lines[0]


def test_debug_shows_the_traceback(tmp_path):
    result = subprocess.run(
        [WOODCOCK, "--debug", "inspect", str(tmp_path / "missing")], capture_output=True, text=True
    )
    assert result.returncode != 0
    assert "Traceback" in result.stderr and "DrafterError" in result.stderr


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: p / "missing", "no such file or directory"),
        (
            lambda p: (p / "empty").mkdir() or p / "empty",
            "no known drafter format; looked for woodcock.json",
        ),
        (lambda p: (p / "file").write_text("x") and p / "file", "expected a drafter directory"),
    ],
)
def test_inspect_bad_paths(tmp_path, capsys, make, message):
    code, out, err = run_cli(["inspect", str(make(tmp_path))], capsys)
    assert code == 2 and out == ""
    assert message in err and len(err.strip().splitlines()) == 1


def test_help_and_version(capsys):
    code, out, _ = run_cli(["--help"], capsys)
    assert code == 0 and "inspect" in out
    code, out, _ = run_cli(["--version"], capsys)
    assert code == 0 and out.startswith("woodcock ")
    code, _, err = run_cli(["inspect"], capsys)
    assert code == 2 and "Missing argument" in err


OUT_OF_RANGE = [
    (["generate", "--prompt", "x", "--max-tokens", "-3"], "'--max-tokens' / '-m'"),
    (["generate", "--prompt", "x", "--max-tokens", "abc"], "'--max-tokens' / '-m'"),
    (["generate", "--prompt", "x", "--temp", "-0.5"], "'--temp'"),
    (["generate", "--prompt", "x", "--temp", "nan"], "'--temp'"),
    (["generate", "--prompt", "x", "--top-p", "1.5"], "'--top-p'"),
    (["generate", "--prompt", "x", "--min-p", "-1"], "'--min-p'"),
    (["generate", "--prompt", "x", "--top-k", "-1"], "'--top-k'"),
    (["generate", "--prompt", "x", "--seed", "-1"], "'--seed'"),
    (["bench", "--prompts", "0"], "'--prompts'"),
    (["bench", "--max-tokens", "0"], "'--max-tokens' / '-m'"),
    (["latency", "--drafter", "d", "--out", "OUT/latency.json", "--repeats", "0"], "'--repeats'"),
    (
        ["latency", "--drafter", "d", "--out", "OUT/latency.json", "--contexts", "64,-1"],
        "--contexts",
    ),
    (["parity", "d", "--steps", "0"], "'--steps'"),
    (["convert", "d", "OUT/x", "--to", "woodcock", "--truncate-vocab", "0"], "'--truncate-vocab'"),
    (["distill", "--prompts", "p.jsonl", "--out", "OUT/d", "--batch", "0"], "'--batch'"),
    (["distill", "--prompts", "p.jsonl", "--out", "OUT/d", "--max-tokens", "0"], "'--max-tokens'"),
    (["train", "--data", "d", "--out", "OUT/t", "--lr", "nan"], "--lr nan"),
    (["train", "--data", "d", "--out", "OUT/t", "--steps", "0"], "--steps 0"),
    (["train", "--data", "d", "--out", "OUT/t", "--holdout", "1.0"], "--holdout 1.0"),
    (["train", "--data", "d", "--out", "OUT/t", "--weight-decay", "-1"], "--weight-decay -1"),
    (["train", "--data", "d", "--out", "OUT/t", "--warmup", "-2"], "--warmup -2"),
    (["train", "--data", "d", "--out", "OUT/t", "--min-lr-ratio", "2"], "--min-lr-ratio 2"),
    (
        ["vocab", "count", "d", "--target", "t", "--out", "OUT/v", "--holdout", "1.5"],
        "--holdout 1.5",
    ),
    (["generate", "--bogus"], "No such option: --bogus"),
    (["generate", "--prompt", "x", "--temp", "inf"], "--temp inf"),
    (["train", "--data", "d", "--out", "OUT/t", "--seed", "-1"], "--seed -1"),
    (["vocab", "count", "d", "--target", "t", "--out", "OUT/v", "--seed", "-1"], "--seed -1"),
    # an option of another kind of drafter is refused, not ignored
    (["train", "--data", "d", "--out", "OUT/t", "--block-size", "4"], "--block-size 4"),
    (
        ["train", "--data", "d", "--out", "OUT/t", "--algorithm", "dflash", "--markov-rank", "8"],
        "--markov-rank 8: an option of --algorithm dspark, not of dflash",
    ),
    (
        ["train", "--data", "d", "--out", "OUT/t", "--algorithm", "dspark", "--ttt-steps", "2"],
        "--ttt-steps 2",
    ),
    (
        ["distill", "--prompts", "p.jsonl", "--out", "OUT/d", "--no-chat", "--system", "s"],
        "--system",
    ),
    (["bench", "--compare-lookup", "--no-lookup"], "--compare-lookup"),
    (["serve", "--no-prefix-cache", "--prefix-cache-gb", "4"], "--prefix-cache-gb 4"),
]


@pytest.mark.parametrize(
    "argv,names", OUT_OF_RANGE, ids=lambda v: " ".join(v) if isinstance(v, list) else None
)
def test_values_out_of_range_exit_2_with_one_line_and_write_nothing(argv, names, tmp_path, capsys):
    out_dir = tmp_path / "out"
    argv = [a.replace("OUT", str(out_dir)) for a in argv]
    code, out, err = run_cli(argv, capsys)
    lines = [line for line in err.splitlines() if not line.startswith("woodcock: warning:")]
    assert code == 2, (out, err)
    assert len(lines) == 1 and lines[0].startswith("woodcock: error: "), err
    assert names in lines[0]
    assert not out_dir.exists()


def test_the_command_line_errors_of_the_installed_command_are_one_line(tmp_path):
    result = subprocess.run(
        [WOODCOCK, "generate", "--prompt", "x", "--max-tokens", "-3"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "woodcock: error: Invalid value for '--max-tokens' / '-m': Input should be greater than"
        " or equal to 1 (see woodcock generate --help)"
    ]


def test_a_target_directory_without_a_config_is_refused_with_one_line(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    drafter = tmp_path / "drafter"
    save_drafter(random_drafter(tiny_spec("eagle3"), "BF16"), drafter)
    code, out, err = run_cli(["generate", "--target", str(empty), "--drafter", str(drafter), "--prompt", "x"], capsys)
    assert code == 2
    assert err.strip() == f"woodcock: error: {empty / 'config.json'}: missing; expected an mlx-lm model directory"


def test_damaged_targets_and_empty_or_binary_prompts_are_refused_with_one_line(tmp_path, capsys, monkeypatch):
    from woodcock.demo import write_demo

    write_demo(tmp_path / "demo")
    target, drafter = tmp_path / "demo" / "target", str(tmp_path / "demo" / "drafter")
    truncated, listed = tmp_path / "truncated", tmp_path / "listed"
    shutil.copytree(target, truncated)
    shutil.copytree(target, listed)
    (truncated / "model.safetensors").write_bytes((target / "model.safetensors").read_bytes()[:100])
    (listed / "config.json").write_text("[1, 2]")
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00x")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "a", "prompt": "x"}\n')
    generate = ["generate", "--drafter", drafter, "--no-chat", "-m", "2"]
    (tmp_path / "a-file").write_text("kept")
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("Paris is the capital of France.\n")
    cases = [
        (generate + ["--target", str(target), "--prompt", "x", "--stop", ""], "--stop '': expected a non-empty"),
        (generate + ["--target", str(target), "--prompt", "x", "--system", "Be brief."], "--system: a system prompt needs the chat template"),
        (generate + ["--target", str(tmp_path / "a-file"), "--prompt", "x"], "a-file: is a file; expected an mlx-lm model directory"),
        (["vocab", "count", str(tmp_path / "corpus"), "--target", str(target), "--out", str(tmp_path / "a-file")], "a-file: File exists"),
        (generate + ["--target", str(truncated), "--prompt", "x"], f"{truncated}: mlx-lm cannot load it"),
        (generate + ["--target", str(listed), "--prompt", "x"], "config.json: expected a JSON object, found list"),
        (generate + ["--target", str(target), "--prompt", ""], "--prompt: the prompt is empty"),
        (generate + ["--target", str(target), "--prompt-file", str(tmp_path / "binary.txt")], "binary.txt: not UTF-8 text"),
        (
            ["distill", "--target", str(truncated), "--prompts", str(prompts), "--out", str(tmp_path / "d")],
            "mlx-lm cannot load it",
        ),
        (
            ["latency", "--target", str(target), "--drafter", drafter, "--out", str(tmp_path / "l.json"), "--contexts", "1000000"],
            "--contexts 1000000: expected at most 4080 (the target's context is 4096 tokens",
        ),
    ]
    for argv, message in cases:
        code, _, err = run_cli(argv, capsys)
        lines = [line for line in err.splitlines() if line.strip()]
        lines = [line for line in lines if not line.startswith("woodcock: warning:")]
        assert code == 2 and len(lines) == 1 and message in lines[0], (argv, err)
    assert not (tmp_path / "d").exists() and not (tmp_path / "l.json").exists()
    # a conversion in woodcock's own cache (the default target's) is named as one
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cached = tmp_path / "cache" / "woodcock" / "SmolLM2-135M-Instruct-0123"
    shutil.copytree(truncated, cached)
    code, _, err = run_cli(generate + ["--target", str(cached), "--prompt", "x"], capsys)
    assert code == 2 and "woodcock made it in its cache: remove it to convert it again" in err


def test_progress_off_a_terminal_is_a_line_a_minute_and_the_last(capsys):
    from woodcock.train.cli import progress_display

    now = [0.0]
    with progress_display(every=60.0, clock=lambda: now[0]) as show:
        for done, when in ((0, 0.0), (10, 30.0), (20, 60.0), (30, 90.0), (40, 120.0)):
            now[0] = when
            show("answered", done, 40)
        now[0] = 600.0
        show("training", 1, 3)
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "answered: 0 of 40",
        "answered: 20 of 40, 20.0 a minute, 1 min left",
        "answered: 40 of 40, 20.0 a minute, 0 min left",
        "training: 1 of 3",
    ]
