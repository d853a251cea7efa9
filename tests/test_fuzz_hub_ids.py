"""Hugging Face ids that cannot be fetched (offline and not cached, unknown, gated), as a target
or as a drafter, in every command that resolves one: exit code 2 and one line that names the id
and says how to use a local directory instead, never a hub exception's traceback or an
"internal error"."""

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from woodcock.errors import DrafterError
from woodcock.loading import load_drafter, resolve_source

UNFETCHABLE = "woodcock-tests/no-such-model"
WOODCOCK = [sys.executable, "-c", "from woodcock.cli import main; main()"]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """A tiny target and drafter on disk (`woodcock demo`)."""
    root = tmp_path_factory.mktemp("hub-ids") / "demo"
    subprocess.run([*WOODCOCK, "demo", str(root)], check=True, capture_output=True)
    return root


def _offline(tmp_path) -> dict:
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        HF_HOME=str(tmp_path / "empty-hf-home"),
        XDG_CACHE_HOME=str(tmp_path / "xdg"),
    )
    env.pop("HF_HUB_CACHE", None)
    env.pop("HUGGINGFACE_HUB_CACHE", None)
    return env


def _run(args, tmp_path, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*WOODCOCK, *args],
        env=_offline(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd or tmp_path,
    )


def _assert_one_clear_line(result: subprocess.CompletedProcess) -> None:
    lines = [
        line for line in result.stderr.splitlines() if not line.startswith("woodcock: warning")
    ]
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1, result.stderr
    line = lines[0]
    assert line.startswith("woodcock: error: ") and "internal error" not in line
    assert UNFETCHABLE in line
    assert "not in the local Hugging Face cache" in line and "offline" in line
    assert "pass that directory" in line


# -- the commands whose resolvers already go through woodcock.loading.resolve_source ---------


def test_train_with_an_unfetchable_target(demo, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    lines = [f'{{"id": "{i}", "prompt": "{text}"}}' for i, text in enumerate(["Hi", "The", "A"])]
    prompts.write_text("\n".join(lines) + "\n")
    distilled = _run(
        [
            "distill",
            "--prompts",
            str(prompts),
            "--out",
            "answers",
            "--target",
            str(demo / "target"),
            "--max-tokens",
            "4",
        ],
        tmp_path,
    )
    assert distilled.returncode == 0, distilled.stderr
    args = ["train", "--data", "answers", "--out", "drafter", "--target", UNFETCHABLE]
    _assert_one_clear_line(_run([*args, "--steps", "1"], tmp_path))
    assert not (tmp_path / "drafter").exists()


def test_inspect_an_unfetchable_drafter(tmp_path):
    _assert_one_clear_line(_run(["inspect", UNFETCHABLE], tmp_path))


def test_convert_an_unfetchable_drafter_leaves_no_output(tmp_path):
    result = _run(["convert", UNFETCHABLE, "out", "--to", "speculators"], tmp_path)
    _assert_one_clear_line(result)
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []


def test_convert_with_an_unfetchable_target(demo, tmp_path):
    result = _run(
        ["convert", str(demo / "drafter"), "out", "--to", "speculators", "--target", UNFETCHABLE],
        tmp_path,
    )
    _assert_one_clear_line(result)
    assert not (tmp_path / "out").exists()


def test_parity_with_an_unfetchable_target(demo, tmp_path):
    _assert_one_clear_line(
        _run(["parity", str(demo / "drafter"), "--target", UNFETCHABLE], tmp_path)
    )


def test_generate_with_an_unfetchable_drafter(demo, tmp_path):
    result = _run(
        ["generate", "--target", str(demo / "target"), "--drafter", UNFETCHABLE, "--prompt", "Hi"],
        tmp_path,
    )
    _assert_one_clear_line(result)


# -- the commands that load an mlx-lm target -----------------------------------------------


def test_generate_with_an_unfetchable_target(demo, tmp_path):
    result = _run(
        ["generate", "--target", UNFETCHABLE, "--drafter", str(demo / "drafter"), "--prompt", "Hi"],
        tmp_path,
    )
    _assert_one_clear_line(result)


def test_bench_with_an_unfetchable_target(demo, tmp_path):
    result = _run(
        ["bench", "--target", UNFETCHABLE, "--drafter", str(demo / "drafter"), "--prompts", "1"],
        tmp_path,
    )
    _assert_one_clear_line(result)


def test_latency_with_an_unfetchable_target(demo, tmp_path):
    args = ["latency", "--target", UNFETCHABLE, "--drafter", str(demo / "drafter")]
    _assert_one_clear_line(_run([*args, "--out", "latency.json"], tmp_path))


def test_distill_with_an_unfetchable_target(tmp_path):
    (tmp_path / "prompts.jsonl").write_text('{"id": "a", "prompt": "Hi"}\n')
    args = ["distill", "--prompts", "prompts.jsonl", "--out", "answers", "--target", UNFETCHABLE]
    _assert_one_clear_line(_run(args, tmp_path))


# -- why an id could not be fetched ----------------------------------------------------------


def _hub_error(cls, message):
    response = types.SimpleNamespace(headers={}, request=None)
    return cls(message, response=response)


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        ("gated", "gated Hugging Face repository"),
        ("unknown", "no Hugging Face repository of that name"),
        ("offline", "not in the local Hugging Face cache"),
        ("network", "repository failed: ConnectionError: connection reset"),
    ],
)
def test_the_reason_is_named(monkeypatch, error, reason):
    import huggingface_hub
    from huggingface_hub import errors

    raised = {
        "gated": lambda: _hub_error(errors.GatedRepoError, "401 restricted"),
        "unknown": lambda: _hub_error(errors.RepositoryNotFoundError, "404"),
        "offline": lambda: errors.LocalEntryNotFoundError("not cached"),
        "network": lambda: ConnectionError("connection reset"),
    }[error]()

    def snapshot_download(repo_id, **_):
        raise raised

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    with pytest.raises(DrafterError) as caught:
        resolve_source(UNFETCHABLE)
    message = str(caught.value)
    assert message.startswith(f"{UNFETCHABLE}: not a local directory")
    assert reason in message and "\n" not in message
    assert "--local-dir" in message


def test_an_existing_local_directory_is_never_looked_up(monkeypatch, tmp_path):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda **_: pytest.fail("looked up"))
    local = tmp_path / "org" / "name"
    local.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_source("org/name") == Path("org/name")


def test_a_path_marked_local_is_never_looked_up(monkeypatch, tmp_path):
    """`./org/name` is a local path even where it does not exist (a typo), and so is a Path,
    whose text drops the `./`: a source resolved once is not looked up the second time."""
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda **_: pytest.fail("looked up"))
    monkeypatch.chdir(tmp_path)
    assert resolve_source("./org/name") == Path("org/name")
    assert resolve_source(Path("org/name")) == Path("org/name")
    with pytest.raises(DrafterError, match="^org/name: no such file or directory$"):
        load_drafter("./org/name")


def test_a_mistyped_local_path_is_not_sent_to_the_hub(tmp_path):
    result = _run(["inspect", f"./{UNFETCHABLE}"], tmp_path)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"woodcock: error: {UNFETCHABLE}: no such file or directory"
    ]
