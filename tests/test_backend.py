"""The TF32 policy (exact fp32 verifies on GPU backends unless asked), the backend the commands
report, and OpenBLAS staying quiet where MLX computes on a GPU."""

import json
import warnings
from types import SimpleNamespace

import pytest
from helpers import run_cli

from woodcock.cli import main
from woodcock.runtime import backend, openblas
from woodcock.runtime.backend import TF32_VARIABLE, Tf32, configure_tf32, describe


@pytest.fixture(autouse=True)
def _fresh_policy(monkeypatch):
    monkeypatch.setattr(backend, "_configured", None)
    monkeypatch.delenv(TF32_VARIABLE, raising=False)


def test_tf32_is_off_by_default_on_with_the_flag_and_the_users_own_value_kept(monkeypatch):
    import os

    assert configure_tf32(False) == Tf32("0", "default") and os.environ[TF32_VARIABLE] == "0"
    assert configure_tf32(None) == Tf32("0", "default")  # a library call keeps it
    assert configure_tf32(True) == Tf32("1", "--allow-tf32") and os.environ[TF32_VARIABLE] == "1"
    assert configure_tf32(None).source == "--allow-tf32"
    assert configure_tf32(False) == Tf32("0", "default")  # the next command without the flag
    monkeypatch.setenv(TF32_VARIABLE, "1")  # exported by the user
    assert configure_tf32(False) == Tf32("1", "environment") and configure_tf32(None).enabled
    assert os.environ[TF32_VARIABLE] == "1"
    assert configure_tf32(True).source == "--allow-tf32"


def test_mlx_reads_the_value_as_atoi_does():
    assert [Tf32(v, "environment").enabled for v in ("0", "1", "2", " 1x", "abc", "")] == [
        False, True, True, True, False, False,
    ]  # fmt: skip


def test_describe_names_the_backend_and_on_a_gpu_tf32():
    assert describe({"backend": "cpu", "tf32": False, "tf32_source": "default"}) == "cpu backend"
    assert describe({"backend": "cuda", "tf32": False, "tf32_source": "default"}) == (
        "cuda backend, TF32 off (default)"
    )
    assert describe({"backend": "cuda", "tf32": True, "tf32_source": "--allow-tf32"}) == (
        "cuda backend, TF32 on (--allow-tf32)"
    )
    assert describe({"backend": "metal", "tf32": True, "tf32_source": "environment"}) == (
        f"metal backend, TF32 on ({TF32_VARIABLE} from the environment)"
    )


def test_generate_reports_the_backend_and_the_tf32_it_ran_with(tmp_path, capsys):
    try:
        main(["demo", str(tmp_path / "demo")])
    except SystemExit as e:
        assert not e.code
    capsys.readouterr()
    args = ["generate", "--target", str(tmp_path / "demo" / "target"), "--drafter", str(tmp_path / "demo" / "drafter"), "--prompt", "The quick", "--max-tokens", "4", "--no-chat", "--policy", "fixed:2"]  # fmt: skip
    code, out, err = run_cli(args + ["--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["backend"] == {"backend": "cpu", "tf32": False, "tf32_source": "default"}
    code, out, err = run_cli(args + ["--json", "--allow-tf32"], capsys)
    assert json.loads(out)["backend"]["tf32_source"] == "--allow-tf32"
    code, out, err = run_cli(args, capsys)
    assert code == 0 and out.splitlines()[-1] == "backend: cpu backend"


def test_distill_reports_the_backend_and_takes_the_tf32_flag(tmp_path, capsys, monkeypatch):
    from helpers import write_corpus_prompts

    try:
        main(["demo", str(tmp_path / "demo")])
    except SystemExit as e:
        assert not e.code
    prompts = write_corpus_prompts(tmp_path / "prompts.jsonl", 2)
    args = ["distill", "--target", str(tmp_path / "demo" / "target"), "--prompts", str(prompts), "--max-tokens", "3", "--no-chat"]  # fmt: skip
    capsys.readouterr()
    code, out, err = run_cli(args + ["--out", str(tmp_path / "a")], capsys)
    assert code == 0, err
    assert out.rstrip().endswith("tokens/s); cpu backend") and "2 answered now" in out
    # not a terminal: progress as lines a log keeps, the first and the last at least
    lines = err.splitlines()
    assert "answered: 0 of 2" in lines and lines[-1].startswith("answered: 2 of 2, ")
    assert backend.current_tf32() == Tf32("0", "default")
    code, out, err = run_cli(args + ["--out", str(tmp_path / "b"), "--allow-tf32"], capsys)
    assert code == 0 and backend.current_tf32().source == "--allow-tf32"


@pytest.mark.parametrize("device", ["cpu", "gpu"])
def test_openblas_says_nothing_when_mlx_computes_on_a_gpu(monkeypatch, tmp_path, device):
    """MLX imported before woodcock with OpenBLAS installed: the warning is for the CPU only."""
    library = tmp_path / "libopenblas.so.0"
    library.touch()
    core = SimpleNamespace(cpu="cpu", default_device=lambda: device)
    monkeypatch.setitem(__import__("sys").modules, "mlx.core", core)
    monkeypatch.setattr(openblas, "find_openblas", lambda machine=None: library)
    monkeypatch.setattr(openblas, "_global_symbol", lambda name: False)
    monkeypatch.setattr(openblas.platform, "system", lambda: "Linux")
    monkeypatch.delenv(openblas.OPT_OUT, raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        openblas.warn_if_too_late()
    assert len(caught) == (1 if device == "cpu" else 0)
