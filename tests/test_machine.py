"""Machine facts: the shape of the report, the BLAS it names checked against what this process
actually maps, and the slow-path warnings."""

import ctypes
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from woodcock.runtime.machine import (
    classify_blas,
    machine_facts,
    slow_path_warnings,
)
from woodcock.runtime.openblas import find_openblas, usable_cores

LINUX = platform.system() == "Linux"


def mapped_files():
    """Every file this process maps, read straight from /proc/self/maps."""
    files = set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].startswith("/"):
            files.add(parts[5].strip())
    return files


def test_facts_have_the_keys_and_sane_types():
    facts = machine_facts("float32")
    json.dumps(facts)  # plain values only
    assert facts["os"] == platform.system() and facts["machine"] == platform.machine()
    assert isinstance(facts["platform"], str) and facts["platform"]
    assert isinstance(facts["cpu_count"], int) and facts["cpu_count"] >= 1
    assert facts["cpu"] is None or isinstance(facts["cpu"], str)
    assert isinstance(facts["memory_bytes"], int) and facts["memory_bytes"] > 2**28
    assert facts["dtype"] == "float32" and facts["quantization"] is None
    device = facts["mlx"]
    assert device["backend"] in {"cpu", "metal", "cuda", "gpu"}
    assert device["default_device"] == str(mx.default_device())
    assert device["metal_available"] is bool(mx.metal.is_available())
    assert device["device_info"] is None or isinstance(device["device_info"], dict)
    versions = facts["versions"]
    assert versions["python"] == platform.python_version()
    assert versions["mlx"] == mx.__version__
    for name in ("mlx-lm", "numpy", "woodcock"):
        assert isinstance(versions[name], str) and versions[name][0].isdigit()
    assert "transformers" in versions
    assert set(facts["blas"]) == {"library", "path", "how", "mapped"}
    assert machine_facts()["dtype"] is None


@pytest.mark.skipif(not LINUX, reason="/proc is Linux's")
def test_cpu_and_memory_match_proc():
    facts = machine_facts()
    cpuinfo = Path("/proc/cpuinfo").read_text()
    names = [line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if ":" in line]
    if "model name" in cpuinfo:
        assert facts["cpu"] in names
    meminfo = Path("/proc/meminfo").read_text().split("\n")[0]
    assert meminfo.startswith("MemTotal:")
    assert facts["memory_bytes"] == int(meminfo.split()[1]) * 1024


@pytest.mark.skipif(not LINUX, reason="BLAS is inspected on Linux")
def test_blas_is_what_this_process_maps():
    blas = machine_facts()["blas"]
    maps = mapped_files()
    assert blas["path"] in maps  # the library named is really loaded here
    assert set(blas["mapped"]) <= maps
    preload = os.environ.get("LD_PRELOAD", "") + _ld_so_preload()
    libmlx = next(p for p in maps if os.path.basename(p).startswith("libmlx"))
    bundled = [p for p in maps if "mlx_cpu.libs" in p and os.path.basename(p).startswith("libblas")]
    global_scope = ctypes.CDLL(None)
    if "openblas" not in preload.lower() and not hasattr(global_scope, "cblas_sgemm"):
        # no BLAS in the global scope (preloaded, or opened by importing woodcock): libmlx's
        # import resolves to its own dependency, which for the mlx-cpu wheel is the bundled
        # reference BLAS
        if bundled:
            assert blas["library"] == "reference"
            assert blas["path"] == bundled[0]
            assert Path(bundled[0]).parent == Path(libmlx).parents[2] / "mlx_cpu.libs"
            assert "libmlx" in blas["how"]
    else:
        assert blas["library"] == "openblas"
        assert "RTLD_DEFAULT" in blas["how"]
    # numpy's own OpenBLAS is mapped but renames its symbols: it must never be reported
    assert "scipy_openblas" not in blas["path"]


def _ld_so_preload():
    try:
        return Path("/etc/ld.so.preload").read_text()
    except OSError:
        return ""


PROBE = """
import json, os
import numpy  # maps numpy's own OpenBLAS too
from woodcock.runtime.machine import machine_facts, slow_path_warnings
facts = machine_facts("float32")
fields = [line.split(maxsplit=5) for line in open("/proc/self/maps")]
maps = sorted({f[5].strip() for f in fields if len(f) == 6 and f[5].startswith("/")})
print(json.dumps({"blas": facts["blas"], "warnings": slow_path_warnings(facts), "maps": maps}))
"""


@pytest.mark.skipif(not LINUX, reason="LD_PRELOAD is Linux's")
@pytest.mark.parametrize("preload", [False, True], ids=["bundled", "openblas-preloaded"])
def test_blas_in_a_fresh_process(preload):
    openblas = find_openblas()
    if preload and not openblas.exists():
        pytest.skip(f"{openblas} is not installed (apt-get install libopenblas0-pthread)")
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env["WOODCOCK_OPENBLAS"] = "0"  # what the process maps, not what importing woodcock adds
    if preload:
        env["LD_PRELOAD"] = str(openblas)
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True
    )
    report = json.loads(out.stdout)
    blas, maps = report["blas"], report["maps"]
    assert blas["path"] in maps
    if preload:
        assert blas["library"] == "openblas"
        assert os.path.realpath(openblas) == blas["path"]
        assert not any("BLAS" in w for w in report["warnings"])
    elif any("mlx_cpu.libs" in m for m in maps) and "openblas" not in _ld_so_preload():
        assert blas["library"] == "reference" and "mlx_cpu.libs" in blas["path"]
        assert any("reference (netlib) BLAS" in w for w in report["warnings"])


CLI_PROBE = """
import json, os, sys
from woodcock.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
from woodcock.runtime.machine import blas
print(json.dumps({"blas": blas(), "threads": os.environ.get("OPENBLAS_NUM_THREADS")}))
"""


@pytest.mark.skipif(not LINUX, reason="the global-scope rule is the Linux dynamic linker's")
@pytest.mark.parametrize("opt_out", [False, True], ids=["default", "WOODCOCK_OPENBLAS=0"])
def test_the_command_puts_openblas_under_mlx(opt_out):
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "OPENBLAS_NUM_THREADS")}
    if opt_out:
        env["WOODCOCK_OPENBLAS"] = "0"
    out = subprocess.run(
        [sys.executable, "-c", CLI_PROBE, "--version"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    report = json.loads(out.stdout.splitlines()[-1])
    openblas = find_openblas()
    if openblas.exists() and not opt_out:
        assert report["blas"]["library"] == "openblas"
        assert report["blas"]["path"] == os.path.realpath(openblas)
        assert report["threads"] == str(usable_cores())
    elif "openblas" not in _ld_so_preload():
        assert report["blas"]["library"] != "openblas" and report["threads"] is None


IMPORT_PROBE = """
import json, sys, warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    for name in sys.argv[1:]:
        __import__(name)
from woodcock.runtime.machine import blas
print(json.dumps({"blas": blas()["library"], "warnings": [str(w.message) for w in caught]}))
"""


@pytest.mark.skipif(not LINUX, reason="the global-scope rule is the Linux dynamic linker's")
@pytest.mark.parametrize("order", [("woodcock", "mlx.core"), ("mlx.core", "woodcock")])
def test_importing_woodcock_before_mlx_brings_openblas_and_after_it_warns(order):
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "WOODCOCK_OPENBLAS")}
    out = subprocess.run(
        [sys.executable, "-c", IMPORT_PROBE, *order],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    report = json.loads(out.stdout)
    late = [w for w in report["warnings"] if "mlx was imported before woodcock" in w]
    if not find_openblas().exists() or "openblas" in _ld_so_preload():
        assert late == []
    elif order[0] == "woodcock":
        assert report["blas"] == "openblas" and late == []
    else:
        assert report["blas"] == "reference" and len(late) == 1
        assert str(find_openblas()) in late[0]


def test_classify_blas():
    site = "/venv/lib/python3.11/site-packages"
    assert classify_blas(f"{site}/mlx_cpu.libs/libblas-bd8a282c.so.3.10.0") == "reference"
    assert classify_blas("/usr/lib/x86_64-linux-gnu/blas/libblas.so.3.11.0") == "reference"
    assert classify_blas("/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3") == "openblas"
    assert classify_blas("/usr/lib/x86_64-linux-gnu/libopenblasp-r0.3.21.so") == "openblas"
    assert classify_blas("/opt/intel/lib/libmkl_rt.so.2") == "mkl"
    assert classify_blas("/usr/lib/libblis.so.4") == "blis"


def facts_with(**overrides):
    facts = {
        "os": "Linux",
        "machine": "x86_64",
        "mlx": {"backend": "cpu", "metal_available": False},
        "dtype": "float32",
        "quantization": None,
        "blas": {"library": "openblas", "path": "/usr/lib/libopenblas.so.0"},
    }
    facts.update(overrides)
    return facts


def test_warnings():
    assert slow_path_warnings(facts_with()) == []
    reference = {"library": "reference", "path": "/x/mlx_cpu.libs/libblas-1.so.3"}
    (line,) = slow_path_warnings(facts_with(blas=reference))
    assert "reference (netlib) BLAS" in line and "/x/mlx_cpu.libs/libblas-1.so.3" in line
    installed = find_openblas("x86_64").exists()
    assert ("apt-get install libopenblas0-pthread" in line) != installed
    preload = "LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
    assert (preload in line and "WOODCOCK_OPENBLAS=0" in line) == installed
    assert "\n" not in line
    for dtype in ("bfloat16", "float16"):
        (line,) = slow_path_warnings(facts_with(dtype=dtype))
        assert dtype in line and "--dtype float32" in line
    (line,) = slow_path_warnings(facts_with(quantization="4-bit affine"))
    assert "quantized" in line and "--dtype float32" in line
    assert len(slow_path_warnings(facts_with(dtype="4bit"))) == 1
    both = slow_path_warnings(facts_with(dtype="bfloat16", blas=reference))
    assert len(both) == 2
    # none of these apply off the CPU backend, nor the BLAS one off Linux
    gpu = {"backend": "metal", "metal_available": True}
    assert slow_path_warnings(facts_with(mlx=gpu, dtype="bfloat16", blas=reference)) == []
    assert slow_path_warnings(facts_with(os="Darwin", blas=reference)) == []
    cpu_on_mac = {"backend": "cpu", "metal_available": True}
    (line,) = slow_path_warnings(facts_with(os="Darwin", mlx=cpu_on_mac))
    assert "Metal is available" in line


def test_warnings_for_this_machine():
    facts = machine_facts("bfloat16")
    lines = slow_path_warnings(facts)
    if facts["mlx"]["backend"] == "cpu":
        assert any("--dtype float32" in line for line in lines)
    if LINUX and facts["mlx"]["backend"] == "cpu" and facts["blas"]["library"] == "reference":
        # the fix it names depends on whether Debian's OpenBLAS is installed here
        fix = "LD_PRELOAD=" if find_openblas().exists() else "apt-get install libopenblas0-pthread"
        assert any(fix in line for line in lines)
