"""`woodcock train` under `mlx.launch`: two processes on this machine (the ring backend over
loopback) train as one process does at the same global batch, resume from a checkpoint, and
rank 0 alone writes the log, the checkpoints and a drafter that loads."""

import json
import os
import random
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest
from helpers import distilled_tiny_target

from woodcock.formats import native
from woodcock.loading import load_drafter
from woodcock.train import train as T
from woodcock.train.options import TrainOptions

STEPS = 4
# 24 training samples in batches of 23: every epoch has a batch of one sample, which leaves
# the second process without a share of it
BATCH = 23
LAUNCH = "import sys; from mlx._distributed_utils.launch import main; sys.exit(main())"
WOODCOCK = "import sys; from woodcock.cli import main; sys.exit(main())"
ALGORITHMS = {
    "eagle3": dict(head_size=160),
    "dspark": dict(algorithm="dspark", block_size=4, markov_rank=64, anchors=8, taps=(1, 2, 3)),
}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return distilled_tiny_target(tmp_path_factory.mktemp("train_distributed"), max_tokens=40)


def options(work, out, algorithm: str, **changes) -> TrainOptions:
    settings = dict(
        target=str(work / "target"),
        steps=STEPS,
        batch=BATCH,
        lr=2e-3,
        holdout=0.2,
        eval_every=2,
        checkpoint_every=2,
        max_len=96,
        **ALGORITHMS[algorithm],
    )
    return TrainOptions(data=work / "data", out=out, **{**settings, **changes})


def command_line(opts: TrainOptions) -> list[str]:
    """`woodcock train`'s arguments for `opts`' data, target and recipe."""
    words = ["train", "--data", str(opts.data), "--out", str(opts.out)]
    for name in ("target", "steps", "batch", "lr", "holdout", "eval_every", "checkpoint_every",
                 "max_len", "head_size", "algorithm", "block_size", "markov_rank", "anchors"):  # fmt: skip
        value = getattr(opts, name)
        if value is not None:
            words += ["--" + name.replace("_", "-"), str(value)]
    if opts.taps:
        words += ["--taps", ",".join(map(str, opts.taps))]
    return words + (["--resume"] if opts.resume else [])


def free_port_pair() -> int:
    """A port p with p and p + 1 free on loopback: the ring backend's two ranks listen there."""
    for _ in range(200):
        port = random.randrange(20000, 60000)
        try:
            with socket.socket() as first, socket.socket() as second:
                first.bind(("127.0.0.1", port))
                second.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports on 127.0.0.1")


def launch_two(words: list[str]) -> str:
    """`mlx.launch --backend ring -n 2 woodcock ...`; its output (the launcher itself exits 0
    whatever its processes do)."""
    argv = [sys.executable, "-c", LAUNCH, "--backend", "ring", "-n", "2",
            "--starting-port", str(free_port_pair()), "--", sys.executable, "-c", WOODCOCK, *words]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,  # the ranks too, to stop them all if they hang
    ) as launcher:
        try:
            output, _ = launcher.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, signal.SIGKILL)
            output, _ = launcher.communicate()
            pytest.fail(f"mlx.launch did not finish:\n{output[-4000:]}")
    return output


def figures(record, name: str = "") -> dict[str, float]:
    """Every number of a log entry but its timings, by its path in the entry."""
    if isinstance(record, dict):
        items = record.items()
    elif isinstance(record, list):
        items = enumerate(record)
    else:
        return {name: float(record)}
    out = {}
    for key, value in items:
        if key not in ("seconds", "tokens_per_second"):
            out |= figures(value, f"{name}/{key}")
    return out


def read_log(opts: TrainOptions) -> list[dict]:
    lines = (opts.checkpoint_dir() / T.LOG).read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_two_processes_train_as_one(work, tmp_path, algorithm):
    """EAGLE-3 from the start; DSpark resumed from a one-process checkpoint at step 2, which
    every rank loads."""
    one = options(work, tmp_path / "one", algorithm)
    T.train(one)
    two = options(work, tmp_path / "two", algorithm)
    if algorithm == "dspark":

        class Stop(Exception):
            pass

        def stop_at_3(phase, done, total):
            if phase == "training" and done == 3:
                raise Stop

        with pytest.raises(Stop):
            T.train(two, progress=stop_at_3)
        two = options(work, tmp_path / "two", algorithm, resume=True)

    output = launch_two(command_line(two))

    assert output.count("wrote ") == 1, output[-4000:]  # rank 0 alone reports, and writes
    expected, got = read_log(one), read_log(two)
    assert [e["step"] for e in got] == list(range(STEPS + 1)), output[-4000:]
    for mine, theirs in zip(got, expected, strict=True):  # losses, metrics and evaluations
        assert figures(mine).keys() == figures(theirs).keys()
        assert figures(mine) == pytest.approx(figures(theirs), rel=1e-4, abs=1e-6)

    drafter, reference = load_drafter(two.out), load_drafter(one.out)
    assert drafter.spec == reference.spec
    for name, weight in reference.weights.items():
        np.testing.assert_allclose(drafter.weights[name], weight, rtol=1e-4, atol=1e-5)
    training = native.read_provenance(two.out)["training"]
    assert training["processes"] == 2 and training["steps"] == STEPS
    assert [p.name for p in two.checkpoint_dir().glob("step-*")] == [f"step-{STEPS:07d}"]
