"""What this machine is and which MLX paths it runs, reported as found (for `woodcock bench`
and bug reports), plus one-line warnings when a known slow path is in use.

Which BLAS MLX's CPU backend calls, on Linux: libmlx imports `cblas_sgemm` & co. dynamically.
The dynamic linker resolves an import from the global scope first (the executable, LD_PRELOAD
and /etc/ld.so.preload libraries, anything opened RTLD_GLOBAL) and only then from libmlx's own
dependencies, which for the `mlx-cpu` wheel is the reference (netlib) BLAS bundled in
`mlx_cpu.libs/`. So the library answering `dlsym(RTLD_DEFAULT, "cblas_sgemm")`, if any, is the
one MLX uses; otherwise it is the first of libmlx's dependencies that defines it
(`dlsym(libmlx handle, ...)`). `dladdr` names the file either address lies in. numpy's own
OpenBLAS (symbols renamed `scipy_cblas_*`) never takes part, although it is mapped too.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import mlx.core as mx

from woodcock.runtime.openblas import OPT_OUT, find_openblas

HALF_DTYPES = {"bfloat16", "bf16", "float16", "fp16", "half"}
_QUANTIZED = re.compile(r"\d+[-_ ]?bits?\b|^q\d|^int\d|^u?int[248]$|quant|mxfp|nvfp", re.I)
_DISTRIBUTIONS = {
    "mlx": "mlx",
    "mlx-lm": "mlx_lm",
    "numpy": "numpy",
    "woodcock": "woodcock",
    "transformers": "transformers",
}


def machine_facts(dtype: str | None = None, *, quantization: str | None = None) -> dict:
    """The facts, with plain JSON-able values; a fact that could not be read is None.

    dtype: the weights' dtype as the user chose it (e.g. "float32", "bfloat16"), reported as
    given. quantization: e.g. "4-bit affine" when the weights are quantized, else None."""
    uname = platform.uname()
    return {
        "os": uname.system,
        "os_release": uname.release,
        "platform": platform.platform(),
        "machine": uname.machine,
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_bytes": memory_bytes(),
        "mlx": mlx_device(),
        "dtype": dtype,
        "quantization": quantization,
        "blas": blas(),
        "ld_preload": os.environ.get("LD_PRELOAD"),
        "openblas_num_threads": os.environ.get("OPENBLAS_NUM_THREADS"),
        "versions": versions(),
    }


def slow_path_warnings(facts: dict) -> list[str]:
    """One line per slow path in use, each saying how to leave it."""
    warnings = []
    backend = (facts.get("mlx") or {}).get("backend")
    blas_facts = facts.get("blas") or {}
    if facts.get("os") == "Linux" and backend == "cpu" and blas_facts.get("library") == "reference":
        openblas = find_openblas(facts.get("machine"))
        if not openblas.exists():
            fix = "apt-get install libopenblas0-pthread and the woodcock command loads it itself"
        else:
            fix = (
                f"the woodcock command loads {openblas} itself (unless {OPT_OUT}=0); elsewhere run"
                f" with LD_PRELOAD={openblas}"
            )
        warnings.append(
            f"MLX's CPU backend calls the reference (netlib) BLAS ({blas_facts.get('path')}):"
            " fp32 matmuls run at a few GFLOP/s and verifying k tokens costs about k decode steps;"
            f" {fix} for a 3-18x faster GEMM"
        )
    if backend == "cpu":
        dtype = (facts.get("dtype") or "").lower()
        if dtype in HALF_DTYPES:
            warnings.append(
                f"weights in {dtype} on the CPU backend: half-precision matmuls have no BLAS path"
                " there (2-4 GFLOP/s); use --dtype float32"
            )
        quantized = facts.get("quantization") or (dtype if _QUANTIZED.search(dtype) else None)
        if quantized:
            warnings.append(
                f"quantized weights ({quantized}) on the CPU backend: a quantized matmul costs"
                " linearly in the rows verified, so speculative decoding cannot win; dequantize"
                " and use --dtype float32"
            )
    mlx_facts = facts.get("mlx") or {}
    if backend == "cpu" and mlx_facts.get("metal_available"):
        warnings.append(
            "MLX runs on the CPU although Metal is available: drop the CPU default device"
            " (mx.set_default_device(mx.gpu))"
        )
    return warnings


# -- pieces ----------------------------------------------------------------------------------


def warn_slow_paths(facts: dict) -> None:
    """One `woodcock: warning:` line on stderr per slow path the machine facts show."""
    for warning in slow_path_warnings(facts):
        print(f"woodcock: warning: {warning}", file=sys.stderr)


def cpu_model() -> str | None:
    system = platform.system()
    if system == "Linux":
        try:
            text = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            return None
        # x86: "model name"; arm64: "Model"/"Hardware", else the implementer/part numbers
        for key in ("model name", "Model", "Hardware", "cpu model", "CPU part"):
            match = re.search(rf"^{re.escape(key)}\s*:\s*(.+)$", text, re.M)
            if match:
                return match.group(1).strip()
        return None
    if system == "Darwin":
        return _sysctl("machdep.cpu.brand_string")
    return platform.processor() or None


def memory_bytes() -> int | None:
    system = platform.system()
    if system == "Linux":
        try:
            match = re.search(r"^MemTotal:\s*(\d+) kB", Path("/proc/meminfo").read_text(), re.M)
        except OSError:
            return None
        return int(match.group(1)) * 1024 if match else None
    if system == "Darwin":
        value = _sysctl("hw.memsize")
        return int(value) if value and value.isdigit() else None
    return None


def _sysctl(name: str) -> str | None:
    try:
        out = subprocess.run(
            ["sysctl", "-n", name], capture_output=True, text=True, timeout=5, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def mlx_device() -> dict:
    device = mx.default_device()
    metal = bool(mx.metal.is_available())
    cuda_module = getattr(mx, "cuda", None)
    cuda = bool(cuda_module.is_available()) if cuda_module is not None else False
    if device.type == mx.cpu:
        backend = "cpu"
    else:
        backend = "metal" if metal else "cuda" if cuda else "gpu"
    info = None
    if hasattr(mx, "device_info"):
        try:
            info = {str(k): _plain(v) for k, v in mx.device_info().items()}
        except (RuntimeError, ValueError):
            info = None
    return {
        "backend": backend,
        "default_device": str(device),
        "metal_available": metal,
        "cuda_available": cuda,
        "device_info": info,
    }


def _plain(value):
    return value if isinstance(value, (str, int, float, bool, type(None))) else str(value)


def versions() -> dict:
    found = {"python": platform.python_version()}
    for dist, module in _DISTRIBUTIONS.items():
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            loaded = sys.modules.get(module)
            found[dist] = getattr(loaded, "__version__", None)
    if found.get("woodcock") is None:
        import woodcock

        found["woodcock"] = woodcock.__version__
    return found


# -- BLAS ------------------------------------------------------------------------------------


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def blas() -> dict:
    """{"library": "reference" | "openblas" | "mkl" | "blis" | "flexiblas" | "accelerate" |
    "other" | "unknown", "path": the file the symbol lives in, "how": how it was found,
    "mapped": every BLAS-like shared library mapped into this process}."""
    system = platform.system()
    if system == "Darwin":
        return {
            "library": "accelerate",
            "path": None,
            "how": "MLX links Accelerate on macOS",
            "mapped": [],
        }
    if system != "Linux":
        return {
            "library": "unknown",
            "path": None,
            "how": f"not inspected on {system}",
            "mapped": [],
        }
    mapped = [p for p in mapped_libraries() if _blas_like(p)]
    path, how = _resolve("cblas_sgemm")
    if path is None:
        return {"library": "unknown", "path": None, "how": how, "mapped": mapped}
    return {"library": classify_blas(path), "path": path, "how": how, "mapped": mapped}


def mapped_libraries() -> list[str]:
    """Real paths of the shared objects mapped into this process (/proc/self/maps), in order."""
    seen: dict[str, None] = {}
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].startswith("/") and ".so" in parts[5]:
            seen.setdefault(parts[5].strip(), None)
    return list(seen)


def _blas_like(path: str) -> bool:
    name = os.path.basename(path).lower()
    return any(key in name for key in ("blas", "mkl_", "blis", "libaccelerate"))


def classify_blas(path: str) -> str:
    lowered = path.lower()
    name = os.path.basename(lowered)
    if "openblas" in lowered:  # also Debian's openblas-pthread/libblas.so.3 alternative
        return "openblas"
    if "mkl" in name:
        return "mkl"
    if "blis" in lowered:
        return "blis"
    if "flexiblas" in lowered:
        return "flexiblas"
    if name.startswith(("libblas", "libcblas")):
        return "reference"  # netlib: mlx_cpu.libs' bundled copy, or Debian's libblas3
    return "other"


def _resolve(symbol: str) -> tuple[str | None, str]:
    """(file that MLX's `symbol` import resolves to, how it was found)."""
    try:
        libdl = ctypes.CDLL(None)
        dladdr = libdl.dladdr
    except (OSError, AttributeError):
        return None, "dladdr unavailable"
    dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    dladdr.restype = ctypes.c_int

    def where(address: int | None) -> str | None:
        info = _DlInfo()
        if not address or not dladdr(address, ctypes.byref(info)) or not info.dli_fname:
            return None
        return os.path.realpath(info.dli_fname.decode(errors="replace"))

    address = _address(libdl, symbol)
    if address:
        return where(address), f"dlsym(RTLD_DEFAULT, {symbol!r}): global scope wins"
    libmlx = _libmlx_path()
    if libmlx is None:
        return None, "libmlx is not loaded"
    try:
        handle = ctypes.CDLL(libmlx, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError as e:
        return None, f"cannot open {libmlx}: {e}"
    return where(_address(handle, symbol)), f"dlsym(libmlx, {symbol!r}): its own dependency"


def _address(library: ctypes.CDLL, symbol: str) -> int | None:
    try:
        return ctypes.cast(getattr(library, symbol), ctypes.c_void_p).value
    except AttributeError:
        return None


def _libmlx_path() -> str | None:
    return next((p for p in mapped_libraries() if os.path.basename(p).startswith("libmlx")), None)
