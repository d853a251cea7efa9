"""Random values for the numeric and path options of every command: a value a command cannot use
ends in exit code 2 and one `woodcock: error:` line, never a traceback, and writes nothing."""

import math

import pytest
from helpers import run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

FUZZ = settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

# (command words before the option, the option, (kind, lowest, highest) it accepts)
NUMERIC = [
    (["generate", "--prompt", "x"], "--max-tokens", ("int", 1, None)),
    (["generate", "--prompt", "x"], "--temp", ("float", 0.0, None)),
    (["generate", "--prompt", "x"], "--top-p", ("float", 0.0, 1.0)),
    (["generate", "--prompt", "x"], "--min-p", ("float", 0.0, 1.0)),
    (["generate", "--prompt", "x"], "--top-k", ("int", 0, None)),
    (["generate", "--prompt", "x"], "--seed", ("int", 0, None)),
    (["bench"], "--prompts", ("int", 1, None)),
    (["bench"], "--max-tokens", ("int", 1, None)),
    (["latency", "--drafter", "d", "--out", "OUT/l.json"], "--repeats", ("int", 1, None)),
    (["parity", "d"], "--steps", ("int", 1, None)),
    (["convert", "d", "OUT/c", "--to", "woodcock"], "--truncate-vocab", ("int", 1, None)),
    (["distill", "--prompts", "p.jsonl", "--out", "OUT/d"], "--batch", ("int", 1, None)),
    (["distill", "--prompts", "p.jsonl", "--out", "OUT/d"], "--max-tokens", ("int", 1, None)),
    (["serve"], "--port", ("int", 0, 65535)),
    (["serve"], "--queue-size", ("int", 1, None)),
    (["serve"], "--max-tokens", ("int", 1, None)),
    (["train", "--data", "d", "--out", "OUT/t"], "--steps", ("int", 1, None)),
    (["train", "--data", "d", "--out", "OUT/t"], "--batch", ("int", 1, None)),
    (["train", "--data", "d", "--out", "OUT/t"], "--lr", ("float", 0.0, None)),
    (["train", "--data", "d", "--out", "OUT/t"], "--holdout", ("float", 0.0, 1.0)),
    (["vocab", "count", "d", "--target", "t", "--out", "OUT/v"], "--holdout", ("float", 0.0, 1.0)),
]


def _out_of_range(kind, low, high):
    """Values the option must refuse: below its range, above it, not a number, or not finite."""
    number = st.integers if kind == "int" else st.floats
    bad = [st.sampled_from(["abc", "", "1e", "--", "0x", "1,2"])]
    if kind == "float":
        bad.append(st.sampled_from(["nan", "inf", "-inf"] if high is not None else ["nan"]))
    if low is not None:
        below = number(max_value=low - 1) if kind == "int" else number(max_value=low - 1e-3)
        bad.append(below.map(str))
    if high is not None:
        above = number(min_value=high + 1) if kind == "int" else number(min_value=high + 1e-3)
        bad.append(above.map(lambda v: str(v) if not (isinstance(v, float) and math.isinf(v)) else "1e400"))
    return st.one_of(*bad)


@pytest.mark.parametrize("words,option,accepts", NUMERIC, ids=lambda v: v if isinstance(v, str) else None)
def test_numeric_options_out_of_range_exit_2_with_one_line(words, option, accepts, tmp_path_factory, capsys):
    @FUZZ
    @given(value=_out_of_range(*accepts))
    def check(value):
        out_dir = tmp_path_factory.mktemp("fuzz") / "out"
        argv = [w.replace("OUT", str(out_dir)) for w in words] + [f"{option}={value}"]
        code, out, err = run_cli(argv, capsys)
        lines = [line for line in err.splitlines() if line and not line.startswith("woodcock: warning:")]
        assert code == 2, (argv, out, err)
        assert len(lines) == 1 and lines[0].startswith("woodcock: error: "), (argv, err)
        assert "Traceback" not in err and not out_dir.exists()

    check()


@FUZZ
@given(
    name=st.text(
        st.characters(codec="utf-8", exclude_categories=("Cc", "Cs", "Zl", "Zp"), exclude_characters="/"),
        min_size=1,
        max_size=40,
    )
)
def test_paths_that_name_nothing_exit_2_with_one_line(name, tmp_path_factory, capsys):
    missing = tmp_path_factory.mktemp("fuzz") / f"missing-{name}"
    out_dir = missing.parent / "out"
    for argv in (
        ["inspect", str(missing)],
        ["convert", str(missing), str(out_dir), "--to", "speculators"],
        ["parity", str(missing)],
        ["bench", "--prompt-file", str(missing)],
        ["generate", "--prompt-file", str(missing)],
    ):
        code, out, err = run_cli(argv, capsys)
        lines = [line for line in err.splitlines() if line and not line.startswith("woodcock: warning:")]
        assert code == 2, (argv, out, err)
        assert len(lines) == 1 and lines[0].startswith("woodcock: error: "), (argv, err)
        assert not out_dir.exists()
