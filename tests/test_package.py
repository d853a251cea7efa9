import subprocess
import sys
from pathlib import Path

import pytest

import woodcock

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["formats", "converters"])
@pytest.mark.parametrize("cwd", [REPO, Path("/")])
def test_folders_do_not_import_as_top_level_packages(name, cwd):
    result = subprocess.run(
        [sys.executable, "-c", f"import {name}"], cwd=cwd, capture_output=True, text=True
    )
    assert result.returncode != 0
    assert "Error" in result.stderr


def test_folders_import_under_woodcock():
    import woodcock.converters.layer_ids
    import woodcock.formats.woodcock

    assert woodcock.formats.woodcock.NAME == "woodcock"
    assert woodcock.converters.layer_ids.OFFSETS["layer_output"] == 1


def test_console_script_version():
    exe = Path(sys.executable).with_name("woodcock")
    result = subprocess.run([exe, "--version"], capture_output=True, text=True)
    assert result.returncode == 0
    assert result.stdout.strip() == f"woodcock {woodcock.__version__}"
