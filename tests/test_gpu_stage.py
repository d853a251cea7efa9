"""benchmarks/gpu_stage.py on a small repository of the project's layout: the calls it prints,
run one after another in a copy of what each would carry, leave the GPU machine with the wheels
installed, the drafters and data in place, and the checkout restored here afterwards."""

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_stage.py"


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), *args], check=True, capture_output=True, text=True
    ).stdout


def stage(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=repo, capture_output=True, text=True
    )


def fake_mlx_wheel(folder: Path) -> None:
    """A wheel of a package named mlx whose core module answers what install.sh asks."""
    folder.mkdir()
    info = "mlx-0.0.1.dist-info"
    files = {
        "mlx/__init__.py": "",
        "mlx/core.py": "__version__ = '0.0.1'\n\ndef default_device():\n    return 'staged'\n",
        f"{info}/METADATA": "Metadata-Version: 2.1\nName: mlx\nVersion: 0.0.1\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(folder / "mlx-0.0.1-py3-none-any.whl", "w") as wheel:
        for name, text in files.items():
            wheel.writestr(name, text)


@pytest.fixture
def checkout(tmp_path):
    repo = tmp_path / "repo"
    for folder in ("woodcock", "formats", "converters", "drafters", "benchmarks/prompts"):
        (repo / folder).mkdir(parents=True)
        (repo / folder / "__init__.py").write_text("")
    for name in ("pyproject.toml", ".gitignore"):
        shutil.copyfile(ROOT / name, repo / name)
    (repo / "drafters" / "tiny").mkdir()
    (repo / "drafters" / "tiny" / "model.safetensors").write_bytes(os.urandom(3_000_000))
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "layout")
    return repo


def carried_copy(repo: Path, remote: Path, carry: list[str]) -> None:
    """What a call puts on the machine: the tree's travelling files, then the carried paths."""
    names = git(repo, "ls-files", "-z", "--cached", "--others", "--exclude-standard")
    for name in [*filter(None, names.split("\0")), *carry]:
        if (repo / name).is_file():
            (remote / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(repo / name, remote / name)


@pytest.mark.slow
def test_the_printed_calls_install_everything_and_restore_puts_the_drafters_back(
    checkout, tmp_path
):
    weights = (checkout / "drafters" / "tiny" / "model.safetensors").read_bytes()
    fake_mlx_wheel(tmp_path / "wheels")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "prompts.jsonl.xz").write_bytes(b"prompts")
    packed = stage(
        checkout,
        *("pack", "--wheels", str(tmp_path / "wheels"), "--data", str(tmp_path / "data")),
        *("--call-bytes", str(2 * 1024 * 1024 + 1_200_000)),
    )
    assert packed.returncode == 0, packed.stderr
    calls = re.findall(r"carry \[(.*)\]  command: (.*)", packed.stdout)
    assert len(calls) == 3  # 3 MB of drafter at 1.2 MB a call
    assert not (checkout / "drafters").exists()
    assert "drafters/" not in git(checkout, "ls-files")

    shims = tmp_path / "bin"
    shims.mkdir()
    (shims / "python3").symlink_to(sys.executable)
    remote = tmp_path / "remote"
    env = {**os.environ, "PATH": f"{shims}:{os.environ['PATH']}"}
    env["WOODCOCK_STAGE"] = str(tmp_path / "stage")
    check = (
        'python3 -c "import pathlib, woodcock.drafters, mlx.core;'
        " print(pathlib.Path(woodcock.drafters.__file__).resolve().parent);"
        ' print(mlx.core.__file__)"'
    )

    def on_machine(command: str) -> subprocess.CompletedProcess:
        script = command.replace("<script>", check)
        return subprocess.run(
            ["bash", "-c", script], cwd=remote, env=env, capture_output=True, text=True
        )

    broken_once = False
    later = ('".gpu/lease/install.sh"', calls[-1][1])  # a second script on the same machine
    for carry, command in [*calls, later]:
        carry = re.findall(r'"([^"]+)"', carry)
        remote.mkdir(exist_ok=True)
        carried_copy(checkout, remote, carry)
        if not broken_once and "install.sh" in command:
            # a part spoilt on the way is refused, and the next try still installs
            spoilt = tmp_path / "stage" / "p1"
            good = spoilt.read_bytes()
            spoilt.write_bytes(bytes([good[0] ^ 1]) + good[1:])
            done = on_machine(command)
            assert done.returncode != 0 and "the parts do not join" in done.stdout
            spoilt.write_bytes(good)
            broken_once = True
        done = on_machine(command)
        assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.split("\n")
    assert lines[0] == "mlx 0.0.1 on staged"
    assert lines[1] == str((remote / "drafters").resolve())
    assert lines[2].startswith(str(tmp_path / "stage" / "site"))
    assert (remote / "drafters" / "tiny" / "model.safetensors").read_bytes() == weights
    assert (tmp_path / "stage" / "data" / "prompts.jsonl.xz").read_bytes() == b"prompts"

    again = stage(checkout, "pack", "--wheels", str(tmp_path / "wheels"))
    assert again.returncode == 2 and "run `restore` first" in again.stderr
    restored = stage(checkout, "restore")
    assert restored.returncode == 0, restored.stderr
    assert git(checkout, "status", "--porcelain") == ""
    assert not (checkout / ".gpu" / "lease").exists()
    assert (checkout / "drafters" / "tiny" / "model.safetensors").read_bytes() == weights
    nothing = stage(checkout, "restore")
    assert nothing.returncode == 2 and "nothing to restore" in nothing.stderr


def test_a_lease_is_not_packed_over_uncommitted_drafters(checkout, tmp_path):
    fake_mlx_wheel(tmp_path / "wheels")
    (checkout / "drafters" / "tiny" / "model.safetensors").write_bytes(b"changed")
    refused = stage(checkout, "pack", "--wheels", str(tmp_path / "wheels"))
    assert refused.returncode == 2 and "drafters/: uncommitted changes" in refused.stderr
    assert (checkout / "drafters" / "tiny" / "model.safetensors").read_bytes() == b"changed"
    assert not (checkout / ".gpu" / "lease").exists()
