import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import json_strings

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
    import woodcock.formats.native

    assert woodcock.formats.native.NAME == "woodcock"
    assert woodcock.converters.layer_ids.OFFSETS["layer_output"] == 1


def test_console_script_version():
    exe = Path(sys.executable).with_name("woodcock")
    result = subprocess.run([exe, "--version"], capture_output=True, text=True)
    assert result.returncode == 0
    assert result.stdout.strip() == f"woodcock {woodcock.__version__}"


# an absolute POSIX path after a quote, a space, an opening bracket or `=`; or a Windows drive
MACHINE_PATH = re.compile(r"""(?:^|[\s"'(=\[])(?:/(?:[\w.-]+/)+[\w.-]*|[A-Za-z]:\\)""")


def shipped_text_files():
    for path in sorted((REPO / "drafters").rglob("*")):
        if path.is_file() and path.suffix in {".json", ".md", ".py", ".txt"}:
            yield path


def test_the_scan_finds_machine_paths():
    for line in ['"dir": "/srv/runs/distill"', "in /home/user/.cache/x", "C:\\Users\\me", "(/var/tmp/a)"]:
        assert MACHINE_PATH.search(line), line
    for line in [
        '"dir": "../distill"',
        "drafters/smollm2-135m-eagle3/README.md",
        "~/.cache/woodcock",
        "1/2",
    ]:
        assert not MACHINE_PATH.search(line), line


def test_shipped_drafters_name_no_path_of_the_machine_they_were_made_on():
    files = list(shipped_text_files())
    assert any(path.name == "woodcock.json" for path in files)
    for path in files:
        text = path.read_text(encoding="utf-8")
        found = MACHINE_PATH.search(text)
        assert found is None, f"{path.relative_to(REPO)}: {found.group().strip()!r}"
        if path.suffix == ".json":
            absolute = [s for s in json_strings(json.loads(text)) if os.path.isabs(s)]
            assert not absolute, f"{path.relative_to(REPO)}: {absolute[0]!r}"


def test_every_format_module_follows_the_protocol():
    from woodcock.formats import DrafterFormat
    from woodcock.formats.detect import FORMATS

    assert len(FORMATS) == 7
    for fmt in FORMATS:
        assert isinstance(fmt, DrafterFormat), fmt.__name__
        assert fmt.LAYER_CONVENTION in ("after_layers", "layer_output"), fmt.__name__


@pytest.mark.parametrize("name", ["smollm2-135m-eagle3", "smollm2-135m-dspark"])
def test_every_shipped_drafter_fits_the_default_target_and_records_its_holdout(name):
    from woodcock.drafters import shipped_drafter, shipped_names
    from woodcock.formats import native
    from woodcock.loading import load_drafter

    assert name in shipped_names()
    path = shipped_drafter(name)
    drafter = load_drafter(str(path))
    target = drafter.spec.target
    assert (target.num_hidden_layers, target.hidden_size, target.vocab_size) == (30, 576, 49152)
    assert drafter.spec.taps.layer_ids == (2, 15, 27)
    provenance = native.read_provenance(path)
    agreement = provenance["holdout_agreement"]
    assert agreement and all(0.0 < a <= 1.0 for a in agreement)
    readme = (path / "README.md").read_text(encoding="utf-8")
    assert f"# {name}\n" in readme and "woodcock train" in readme and "woodcock distill" in readme
    if drafter.spec.is_block:
        holdout = provenance["holdout"]
        assert len(holdout["accuracy"]) == drafter.spec.algorithm.num_drafts
        assert holdout["acceptance_length"] > 1.0 and f"{holdout['acceptance_length']:.3f}" in readme
