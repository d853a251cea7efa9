"""Commands killed with SIGKILL lose nothing: the previous output stays whole, nothing
half-written takes its place, the next run removes what the killed one left and says so, and
`distill` / `train` continue to the result an uninterrupted run gives.

Kill points: when a file that marks a phase appears (a staging directory, the first answers,
the feature cache, a checkpoint), after a delay drawn from a seeded generator, and at seeded
random times over a run's measured duration."""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from woodcock.demo import CORPUS, write_tiny_target
from woodcock.errors import DrafterError
from woodcock.formats import native
from woodcock.loading import load_drafter
from woodcock.staging import reporting_removed_leftovers, staged_directory
from woodcock.synthetic import random_drafter, tiny_spec
from woodcock.tensorfile import read_safetensors
from woodcock.train.distill import ANSWERS, read_answers

WOODCOCK = Path(sys.executable).with_name("woodcock")
REMOVED = re.compile(
    r"^woodcock: removed (\d+) leftover partial output\(s\) of killed runs: (.*)$", re.M
)
POLL_SECONDS = 0.0005
RUN_TIMEOUT = 120

TRAIN_ARGS = [
    "--steps", "24", "--ttt-steps", "2", "--head-size", "64", "--batch", "3", "--lr", "2e-3",
    "--holdout", "0.2", "--eval-every", "8", "--checkpoint-every", "4", "--max-len", "48",
]  # fmt: skip


# -- running and killing commands ---------------------------------------------------------------


def start(*args) -> subprocess.Popen:
    return subprocess.Popen(
        [str(WOODCOCK), *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def run(*args, code: int = 0) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [str(WOODCOCK), *map(str, args)], capture_output=True, text=True, timeout=RUN_TIMEOUT
    )
    assert done.returncode == code, (args, done.returncode, done.stdout, done.stderr)
    return done


def timed_run(*args) -> tuple[subprocess.CompletedProcess, float]:
    began = time.perf_counter()
    done = run(*args)
    return done, time.perf_counter() - began


def kill(process: subprocess.Popen) -> bool:
    """SIGKILL `process`; whether the signal ended it (else it had finished by itself, possibly
    between the check and the signal)."""
    if process.poll() is None:
        process.send_signal(signal.SIGKILL)
    _, stderr = process.communicate(timeout=RUN_TIMEOUT)
    if process.returncode == -signal.SIGKILL:
        return True
    assert process.returncode == 0, stderr
    return False


def kill_when(process: subprocess.Popen, ready, delay: float = 0.0) -> bool:
    """Kill `process` `delay` seconds after `ready()` first holds; whether it was running then."""
    deadline = time.monotonic() + RUN_TIMEOUT
    while not ready():
        if process.poll() is not None or time.monotonic() > deadline:
            return kill(process)
        time.sleep(POLL_SECONDS)
    time.sleep(delay)
    return kill(process)


def kill_after(process: subprocess.Popen, seconds: float) -> bool:
    try:
        process.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        pass
    return kill(process)


# -- what is on disk ----------------------------------------------------------------------------


def digest(path: Path) -> dict[str, str]:
    """sha256 of every file under `path`, by relative name."""
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def leftovers(dest: Path) -> list[Path]:
    """Hidden siblings a staged write of `dest` makes (`.NAME.partial-*`, `.NAME.retired-*`)."""
    return sorted(p for p in dest.parent.iterdir() if p.name.startswith(f".{dest.name}."))


def reported_removed(stderr: str) -> list[Path]:
    lines = REMOVED.findall(stderr)
    assert len(lines) <= 1, stderr
    if not lines:
        return []
    count, paths = lines[0]
    removed = [Path(p) for p in paths.split(", ")]
    assert int(count) == len(removed)
    return sorted(removed)


def new_partial_exists(dest: Path, earlier: set[Path]):
    """Whether a staging directory of `dest` other than the `earlier` ones has appeared."""
    prefix = f".{dest.name}.partial-"
    return lambda: any(
        name.startswith(prefix) and dest.parent / name not in earlier
        for name in os.listdir(dest.parent)
    )


# -- the library: live writers and dead ones ---------------------------------------------------


def python(script: str, *args) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script), *map(str, args)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def previous_output(dest: Path) -> dict[str, str]:
    dest.mkdir()
    (dest / "weights.bin").write_bytes(os.urandom(4096))
    (dest / "config.json").write_text('{"complete": true}\n')
    return digest(dest)


def test_a_killed_writer_leaves_a_leftover_that_the_next_run_removes_and_reports(tmp_path):
    dest = tmp_path / "out"
    before = previous_output(dest)
    writer = python(
        """
        import os, signal, sys
        from pathlib import Path
        from woodcock.staging import staged_directory
        with staged_directory(Path(sys.argv[1]), force=True) as out:
            (out / "weights.bin").write_bytes(b"half" * 100)
            os.kill(os.getpid(), signal.SIGKILL)
        """,
        dest,
    )
    writer.communicate(timeout=RUN_TIMEOUT)
    assert writer.returncode == -signal.SIGKILL
    assert digest(dest) == before
    left = leftovers(dest)
    assert len(left) == 1 and (left[0] / "weights.bin").exists()

    reports = []
    with reporting_removed_leftovers(reports.append):
        with staged_directory(dest, force=True) as out:
            (out / "config.json").write_text('{"replaced": true}\n')
    assert reports == [left]
    assert leftovers(dest) == [] and list(digest(dest)) == ["config.json"]


def test_a_live_writer_is_never_taken_for_a_leftover(tmp_path):
    dest = tmp_path / "out"
    writer = python(
        """
        import sys
        from pathlib import Path
        from woodcock.staging import staged_directory
        with staged_directory(Path(sys.argv[1])) as out:
            (out / "weights.bin").write_bytes(b"being written")
            print("staged", flush=True)
            sys.stdin.readline()
        """,
        dest,
    )
    assert writer.stdout.readline() == "staged\n"
    reports = []
    with reporting_removed_leftovers(reports.append):
        with pytest.raises(DrafterError, match=f"is being written by pid {writer.pid}"):
            with staged_directory(dest):
                pass
    (staging,) = leftovers(dest)
    assert (staging / "weights.bin").read_bytes() == b"being written" and reports == []

    writer.send_signal(signal.SIGKILL)
    writer.communicate(timeout=RUN_TIMEOUT)
    with reporting_removed_leftovers(reports.append):
        with staged_directory(dest) as out:
            (out / "mine").write_text("whole")
    assert reports == [[staging]] and leftovers(dest) == []
    assert (dest / "mine").read_text() == "whole"


def test_a_kill_between_the_two_renames_puts_the_previous_output_back(tmp_path):
    """Where no atomic swap exists, replacing takes two renames; a run killed between them has
    moved the previous output aside, and the next run puts it back before anything else."""
    dest = tmp_path / "out"
    before = previous_output(dest)
    writer = python(
        """
        import os, signal, sys
        from pathlib import Path
        from woodcock import staging
        dest = Path(sys.argv[1])
        staging._exchange = lambda a, b: False
        rename = os.rename
        def rename_then_die(source, target):
            rename(source, target)
            if Path(source) == dest:
                os.kill(os.getpid(), signal.SIGKILL)
        os.rename = rename_then_die
        with staging.staged_directory(dest, force=True) as out:
            (out / "weights.bin").write_bytes(b"new")
        """,
        dest,
    )
    writer.communicate(timeout=RUN_TIMEOUT)
    assert writer.returncode == -signal.SIGKILL
    assert not dest.exists()
    left = leftovers(dest)
    assert {p.name.split("-")[0] for p in left} == {".out.partial", ".out.retired"}

    reports = []
    with reporting_removed_leftovers(reports.append):
        with pytest.raises(DrafterError, match="already exists; pass --force"):
            with staged_directory(dest):
                pass
    assert reports == [sorted(left, key=lambda p: ".retired-" not in p.name)]
    assert digest(dest) == before and leftovers(dest) == []


# -- the commands -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("kill")
    target = write_tiny_target(root / "target")
    # large enough (12 MB) that writing it takes a while to kill in
    drafter = random_drafter(tiny_spec(hidden_size=256, vocab_size=8192), seed=3)
    native.write(drafter, root / "drafter")
    words = " ".join(CORPUS).split()
    with open(root / "prompts.jsonl", "w") as f:
        for i in range(32):
            j = (5 * i) % (len(words) - 4)
            f.write(json.dumps({"id": f"p{i}", "prompt": " ".join(words[j : j + 1 + i % 4])}))
            f.write("\n")
    return {"root": root, "target": target, "drafter": root / "drafter", "weights": drafter}


def test_convert_killed_keeps_the_previous_output_and_the_next_run_cleans_up(work, tmp_path):
    dest = tmp_path / "out"
    convert = ("convert", work["drafter"], dest, "--to", "speculators")
    run(*convert)
    before = digest(dest)
    _, seconds = timed_run(*convert, "--force")
    assert digest(dest) == before  # a conversion writes the same bytes every time

    rng = random.Random(11)
    for at in sorted(rng.uniform(0.2, 1.0) * seconds for _ in range(2)):
        kill_after(start(*convert, "--force"), at)
        assert digest(dest) == before  # the previous output, or its identical successor
    # Last, so that no later run can clean up after it: killed as its own staging appears.
    earlier = set(leftovers(dest))
    killed_writing = kill_when(
        start(*convert, "--force"), new_partial_exists(dest, earlier), delay=0.0
    )
    assert killed_writing, "the conversion ended before its staging directory could be seen"
    assert digest(dest) == before
    left = leftovers(dest)
    assert left, "the kill while writing left nothing behind"

    done = run(*convert, "--force")
    assert reported_removed(done.stderr) == left
    assert leftovers(dest) == [] and digest(dest) == before
    loaded = load_drafter(dest)
    for name, array in work["weights"].weights.items():
        assert np.array_equal(np.asarray(loaded.weights[name]), array), name
    assert reported_removed(run(*convert, "--force").stderr) == []  # nothing left to say


def test_racing_converts_one_wins_whole(work, tmp_path):
    expected = tmp_path / "expected"
    run("convert", work["drafter"], expected, "--to", "speculators")
    for round_ in range(2):
        dest = tmp_path / f"raced-{round_}"
        racers = [start("convert", work["drafter"], dest, "--to", "speculators") for _ in "ab"]
        outcomes = [(p.wait(timeout=RUN_TIMEOUT), *p.communicate()) for p in racers]
        assert sorted(code for code, _, _ in outcomes) == [0, 2], outcomes
        (loser_error,) = [err for code, _, err in outcomes if code == 2]
        assert re.fullmatch(
            rf"woodcock: error: {re.escape(str(dest))}: (already exists; pass --force to replace"
            r" it|is being written by pid \d+; wait for it to finish|appeared while this output"
            r" was being written; pass --force to replace it)\n",
            loser_error,
        ), loser_error
        assert digest(dest) == digest(expected) and leftovers(dest) == []

    # both replacing: each either replaces the output whole or is refused, never a mix
    racers = [start("convert", work["drafter"], dest, "--to", "speculators", "--force")]
    racers.append(start("convert", work["drafter"], dest, "--to", "speculators", "--force"))
    codes = sorted(p.wait(timeout=RUN_TIMEOUT) for p in racers)
    for p in racers:
        p.communicate()
    assert codes in ([0, 0], [0, 2])
    assert digest(dest) == digest(expected) and leftovers(dest) == []


def answers_by_id(data: Path) -> dict[str, dict]:
    rows = read_answers(data)  # raises on any bad line but a torn last one
    by_id = {row["id"]: row for row in rows}
    assert len(by_id) == len(rows), "an answer written twice"
    return by_id


def answered_count(data: Path) -> int:
    path = data / ANSWERS
    return path.read_bytes().count(b"\n") if path.exists() else 0


def test_distill_killed_then_resumed_gives_the_same_answers(work, tmp_path):
    def distill(out):
        return (
            "distill", "--target", work["target"], "--prompts", work["root"] / "prompts.jsonl",
            "--out", out, "--max-tokens", "40", "--batch", "4", "--no-chat",
        )  # fmt: skip

    whole, seconds = timed_run(*distill(tmp_path / "whole"))
    expected = answers_by_id(tmp_path / "whole")
    assert len(expected) == 32

    cut = tmp_path / "cut"
    rng = random.Random(12)
    # First while answering, at a seeded count, so that every later kill has answers left to cut.
    threshold = rng.randrange(4, 12)
    assert kill_when(
        start(*distill(cut)), lambda: answered_count(cut) >= threshold, delay=0.0
    ), "distill finished before it could be killed while answering"
    answered_before = answered_count(cut)
    assert 0 < answered_before < 32
    kill_after(start(*distill(cut)), rng.uniform(0.3, 0.9) * seconds)
    answered_before = answered_count(cut)
    kill_when(start(*distill(cut)), lambda: answered_count(cut) >= answered_before + 2, delay=0.0)
    partly = answers_by_id(cut)
    assert all(partly[i] == expected[i] for i in partly)  # nothing half-written in the answers

    done = run(*distill(cut))
    assert "already answered, of 32 prompts" in done.stdout
    assert answers_by_id(cut) == expected
    assert json.loads((cut / "distill.json").read_text())["max_tokens"] == 40


def drafter_weights(path: Path) -> dict[str, np.ndarray]:
    tensors, _ = read_safetensors(path / "model.safetensors")
    return {name: np.array(array) for name, array in tensors.items()}


def losses_by_step(checkpoints: Path) -> dict[int, float]:
    log = [json.loads(line) for line in (checkpoints / "log.jsonl").read_text().splitlines()]
    steps = [entry["step"] for entry in log]
    assert steps == sorted(set(steps)), "log lines repeated or out of order"
    return {entry["step"]: entry.get("loss") for entry in log}


def fresh_data(work, into: Path) -> Path:
    """A copy of the distilled answers without a feature cache, so training builds one."""
    into.mkdir()
    for name in (ANSWERS, "distill.json"):
        shutil.copy(work["answers"] / name, into / name)
    return into


@pytest.fixture(scope="module")
def answers(work):
    data = work["root"] / "answers"
    run(
        "distill", "--target", work["target"], "--prompts", work["root"] / "prompts.jsonl",
        "--out", data, "--max-tokens", "24", "--batch", "8", "--no-chat",
    )  # fmt: skip
    work["answers"] = data
    return data


def train_command(work, data, out, *extra):
    return ("train", "--target", work["target"], "--data", data, "--out", out, *TRAIN_ARGS, *extra)


@pytest.fixture(scope="module")
def trained_whole(work, answers, tmp_path_factory):
    """An uninterrupted run (which builds the feature cache every later run here reuses)."""
    root = tmp_path_factory.mktemp("whole")
    data = fresh_data(work, root / "data")
    run(*train_command(work, data, root / "drafter"))
    return data, drafter_weights(root / "drafter"), losses_by_step(root / "drafter.ckpt")


def assert_same_training(out, checkpoints, expected, expected_losses):
    got = drafter_weights(out)
    assert got.keys() == expected.keys()
    for name in expected:
        assert np.array_equal(got[name], expected[name]), name
    assert losses_by_step(checkpoints) == expected_losses


def test_train_killed_then_resumed_gives_the_same_weights_and_losses(work, trained_whole, tmp_path):
    data, expected, expected_losses = trained_whole
    out, ckpt = tmp_path / "cut", tmp_path / "cut.ckpt"
    latest = ckpt / "latest.json"

    def checkpointed(step):
        def ready():
            try:
                return json.loads(latest.read_text())["step"] >= step
            except (OSError, ValueError, KeyError):
                return False

        return ready

    rng = random.Random(13)
    _, seconds = timed_run(*train_command(work, data, tmp_path / "timed"))
    kill_after(start(*train_command(work, data, out)), rng.uniform(0.2, 0.6) * seconds)
    first = train_command(work, data, out, *(("--resume",) if latest.exists() else ()))
    assert kill_when(start(*first), checkpointed(4), delay=rng.uniform(0.0, 0.05))
    for step in (12, 20):
        assert kill_when(
            start(*train_command(work, data, out, "--resume")),
            checkpointed(step),
            delay=rng.uniform(0.0, 0.05),
        ), f"training ended before checkpoint {step} could be seen"
    if not out.exists():  # else the last kill came after the drafter was written whole
        done = run(*train_command(work, data, out, "--resume"))
        assert "(resumed at " in done.stdout
    assert_same_training(out, ckpt, expected, expected_losses)
    assert leftovers(out) == [] and not list(ckpt.glob(".*partial*"))


def test_train_killed_while_caching_features_gives_the_same_weights(work, trained_whole, tmp_path):
    whole_data, expected, expected_losses = trained_whole
    data = fresh_data(work, tmp_path / "data")
    (cache,) = whole_data.glob("features-*")
    shutil.copytree(cache, data / cache.name)
    # What a run killed after caching its fifth sample leaves: the cache truncates the rest.
    index = cache / "index.jsonl"
    kept = index.read_text().splitlines(keepends=True)[:5]
    (data / cache.name / "index.jsonl").write_text("".join(kept))
    run(*train_command(work, data, tmp_path / "drafter"))
    assert_same_training(tmp_path / "drafter", tmp_path / "drafter.ckpt", expected, expected_losses)


@pytest.fixture(scope="module")
def counting(work):
    """A target whose vocabulary (2M, config only) makes the counts files big enough to be
    killed while being written, and a corpus of token ids (no tokenizer needed)."""
    root = work["root"] / "counting"
    (root / "target").mkdir(parents=True)
    config = {"model_type": "qwen3", "num_hidden_layers": 2, "hidden_size": 64}
    (root / "target" / "config.json").write_text(json.dumps({**config, "vocab_size": 2_000_000}))
    rng = np.random.default_rng(0)
    with open(root / "corpus.jsonl", "w") as f:
        for _ in range(3000):
            f.write(json.dumps(rng.integers(0, 5000, 40).tolist()) + "\n")
    return root


def read_counts(out: Path) -> tuple[dict[str, np.ndarray], dict]:
    with np.load(out / "vocab_counts.npz") as arrays:
        counts = {name: arrays[name] for name in arrays.files}
    info = json.loads((out / "vocab_counts.json").read_text())
    return counts, info


def vocab_count(counting, out, *extra):
    return ("vocab", "count", counting / "corpus.jsonl", "--target", counting / "target",
            "--out", out, *extra)  # fmt: skip


def test_vocab_count_killed_keeps_the_previous_counts(counting, tmp_path):
    out = tmp_path / "counts"
    _, seconds = timed_run(*vocab_count(counting, out))
    counts, info = read_counts(out)
    assert info["tokens"]["train"] == int(counts["counts"].sum())
    rng = random.Random(14)
    for at in sorted(rng.uniform(0.3, 1.0) * seconds for _ in range(3)):
        kill_after(start(*vocab_count(counting, out, "--force")), at)
        now, now_info = read_counts(out)
        assert now_info == info
        for name in counts:
            assert np.array_equal(now[name], counts[name]), name


def test_vocab_count_removes_the_temporary_file_of_a_killed_run(counting, tmp_path):
    out = tmp_path / "counts"
    run(*vocab_count(counting, out))
    temporary = lambda: any(p.name.startswith(".vocab_counts.") for p in out.iterdir())  # noqa: E731
    if not kill_when(start(*vocab_count(counting, out, "--force")), temporary):
        pytest.skip("the counts were written before the kill could land")
    left = sorted(p for p in out.iterdir() if p.name.startswith("."))
    assert left
    done = run(*vocab_count(counting, out, "--force"))
    assert not any(p.name.startswith(".") for p in out.iterdir())
    assert reported_removed(done.stderr) == left


def test_an_output_staged_inside_another_staging_directory_does_not_wait_for_itself(tmp_path):
    """The demo writes its drafter inside its own staging directory: the lock its process holds
    there must not make the inner output wait for it."""
    run("demo", tmp_path / "demo")
    assert (tmp_path / "demo" / "drafter" / "woodcock.json").is_file()
