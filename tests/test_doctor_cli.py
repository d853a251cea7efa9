"""`woodcock doctor` through the command line: exit codes 0 / 1 / 2, text and JSON."""

import json

import pytest
from helpers import run_cli
from test_doctor import BREAKAGES, _correct_drafter, _write_layered_target

from woodcock.cli import app
from woodcock.formats import native

pytestmark = pytest.mark.skipif(
    "doctor"
    not in {command.name or command.callback.__name__ for command in app.registered_commands},
    reason="the doctor command is not registered in woodcock.cli",
)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("doctor-cli")
    (root / "target").mkdir()
    correct = _correct_drafter(root / "target", _write_layered_target(root / "target"))
    native.write(correct, root / "correct")
    native.write(BREAKAGES["random_embedding"](correct), root / "broken")
    return root


def test_a_healthy_drafter_exits_0(pair, capsys):
    code, out, _ = run_cli(
        ["doctor", "--target", str(pair / "target"), "--drafter", str(pair / "correct")], capsys
    )
    assert code == 0
    assert "healthy: no findings" in out and "\nbackend cpu backend\n" in out


def test_findings_exit_1_with_the_likely_causes(pair, capsys):
    code, out, _ = run_cli(
        ["doctor", "--target", str(pair / "target"), "--drafter", str(pair / "broken")], capsys
    )
    assert code == 1
    assert "embed_tokens.weight" in out and "likely causes" in out


def test_json_is_the_report(pair, capsys):
    argv = ["doctor", "--target", str(pair / "target"), "--drafter", str(pair / "broken"), "--json"]
    code, out, _ = run_cli(argv, capsys)
    report = json.loads(out)
    assert code == report["exit_code"] == 1
    assert report["likely_causes"][0]["variant"] == "target_embedding"
    assert report["backend"]["backend"] == "cpu"


def test_an_unusable_drafter_exits_2_with_one_line(pair, tmp_path, capsys):
    code, out, err = run_cli(
        ["doctor", "--target", str(pair / "target"), "--drafter", str(tmp_path)], capsys
    )
    assert code == 2 and out == ""
    lines = [line for line in err.splitlines() if not line.startswith("woodcock: warning")]
    assert len(lines) == 1 and lines[0].startswith("woodcock: error:")


def test_bad_taps_exit_2(pair, capsys):
    argv = ["doctor", "--target", str(pair / "target"), "--drafter", str(pair / "correct")]
    code, _, err = run_cli([*argv, "--taps", "one"], capsys)
    assert code == 2 and "--taps" in err
