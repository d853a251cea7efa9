"""What the GPU scripts (gpu_check.py, gpu_drafters.py) share: each step a separate process with
its own time limit inside one budget for the whole script, its stderr kept, and the JSON it
printed read back. A step that would start past the budget is skipped, so a slow step costs the
later ones, never the results already written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

WOODCOCK = [sys.executable, "-c", "from woodcock.cli import main; main()"]

# the versions, the backend MLX chose and the device, as one JSON object
VERSIONS = """
import importlib.metadata as metadata, json, platform
import woodcock
import mlx.core as mx
from woodcock.runtime.backend import configure_tf32, report
configure_tf32(False)
found = {"python": platform.python_version()}
for name in ("mlx", "mlx-cpu", "mlx-cuda-13", "mlx-cuda-12", "mlx-metal", "mlx-lm", "woodcock"):
    try:
        found[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
        found[name] = None
info = {str(k): str(v) for k, v in mx.device_info().items()} if hasattr(mx, "device_info") else {}
print(json.dumps({"versions": found, "device": str(mx.default_device()), "device_info": info,
                  **report()}))
"""


class Steps:
    """Runs a script's steps as processes inside `budget` seconds; `logs` gets NAME.err each."""

    def __init__(self, logs: Path, budget: float):
        self.logs, self.budget = Path(logs), budget
        self.logs.mkdir(parents=True, exist_ok=True)
        self.started = time.perf_counter()
        self.done: list[dict] = []
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.env.pop("MLX_ENABLE_TF32", None)  # each step says what it wants

    def left(self) -> float:
        return self.started + self.budget - time.perf_counter()

    def run(self, name: str, argv: list[str], limit: float) -> subprocess.CompletedProcess | None:
        """The finished process, or None when it was skipped or ran past min(limit, what is
        left of the budget) and was killed (its stderr is kept either way)."""
        began = time.perf_counter()
        limit = min(limit, self.left())
        if limit < 5:
            self.done.append({"step": name, "exit": "skipped: out of budget", "seconds": 0})
            print(f"{name}: skipped, out of budget", flush=True)
            return None
        try:
            done = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=limit)
        except subprocess.TimeoutExpired as e:
            self._record(name, "timeout", limit, text_of(e.stderr))
            print(f"{name}: timed out after {limit:.0f} s", flush=True)
            return None
        seconds = time.perf_counter() - began
        self._record(name, done.returncode, seconds, done.stderr)
        print(f"{name}: exit {done.returncode} in {seconds:.0f} s", flush=True)
        return done

    def _record(self, name: str, exit, seconds: float, stderr: str) -> None:
        (self.logs / f"{name}.err").write_text(stderr)
        entry = {"step": name, "exit": exit, "seconds": round(seconds, 1)}
        if exit != 0:  # why, where only the summary comes back
            entry["stderr_tail"] = stderr[-600:]
        self.done.append(entry)

    def bundle(self, archive: Path) -> None:
        """Everything under `logs` as one gzipped tar (machines return only a few files)."""
        with tarfile.open(archive, "w:gz") as tar:
            tar.add(self.logs, arcname=self.logs.name)

    def outcome(self) -> str:
        """The summaries' last line: how many steps ran, for how long, and which failed."""
        failed = [f"{s['step']} ({s['exit']})" for s in self.done if s["exit"] not in (0, 1)]
        seconds = time.perf_counter() - self.started
        return f"{len(self.done)} steps in {seconds:.0f} s; failed: {', '.join(failed) or 'none'}"


def last_json(done: subprocess.CompletedProcess | None) -> dict:
    """The JSON object a step printed (from its first '{' on: bench prints one over many lines)."""
    if done is None or not done.stdout.strip():
        return {}
    text = done.stdout
    start = text.find("{")
    try:
        return json.loads(text[start:]) if start >= 0 else {}
    except json.JSONDecodeError:
        return {"unparsed": text[-2000:]}


def text_of(value) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value or ""
