"""Drafters trained on a GPU in one short lease, end to end: distil answers, train the DSpark and
EAGLE-3 drafters from the shipped ones, bench them, and bring everything back in pieces.

    python3 benchmarks/gpu_drafters.py stage [--prompts FILE] [--answers DIR] [--out .gpu/data]
    python3 benchmarks/gpu_drafters.py run --data DIR [--out DIR] [--budget SECONDS] [--small]
    python3 benchmarks/gpu_drafters.py join DIR [--dest DIR]

stage (here): the prompts not yet answered in --answers (a `woodcock distill` directory), in
file order, xz-compressed up to --max-bytes together with those answers, so that they fit in
the room `gpu_stage.py pack --target --data .gpu/data` leaves in its last part (the folder lands
in /tmp/stage/data on the machine).

run (there): steps, each a process with a time limit inside --budget (default 420 s):
  versions   the versions and the backend MLX chose
  distill-speed  benchmarks/distill_bench.py on a random-weight target of the default's shape,
             batches 64 and 256: greedy_batch against mlx-lm's BatchGenerator
  distill    `woodcock distill --batch 256 --max-tokens 192` over the staged prompts, continuing
             the staged answers, for a share of the budget (killed at its limit, it keeps every
             answer it wrote)
  probe-*    a few training steps at several batch sizes: training tokens/s of both trainers,
             the first also building the target's features for all the answers; and DSpark
             with 64 blocks a sequence instead of 16, which the run takes if a step costs at
             most 1.5 times as much
  train-*    DSpark and EAGLE-3, each from the shipped drafter (--init), with --steps sized from
             its probe to the time left and a checkpoint every 25 steps; a run cut short is
             written from its last checkpoint (--resume --finish); then cast to bf16
  bench      `woodcock bench --no-lookup` of both new drafters against plain mlx-lm
The drafters, the answers made there (gzip), the training logs and every step's stderr go into
one tar split into pieces of at most 15 MiB under --out (default $OUT), with manifest.json
(sha256 of each piece and of the whole), summary.txt and summary.json: at most 8 files.

join (here): checks the pieces against the manifest and unpacks them into --dest.

--small: the offline demo target, both drafters from random weights, a few steps: a CPU run of
every step in about two minutes, to check the script before a lease.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import lzma
import math
import os
import shutil
import statistics
import sys
import tarfile
import tempfile
from pathlib import Path

from gpu_steps import VERSIONS, WOODCOCK, Steps, last_json

PIECE_BYTES = 15 * 1024 * 1024
RETURNED_BYTES = 60 * 1024 * 1024  # of the 64 MiB a call returns, the rest for the summaries
DISTILL = {"max_tokens": 192, "batch": 256}
ANCHORS_PAY = 1.5
# the shipped drafters' shapes (their READMEs), so that --init fits; one --max-len for both,
# since the target's features are cached per length and so built once
DSPARK = ["--algorithm", "dspark", "--head-size", "8192", "--markov-rank", "64", "--max-len", "384"]
EAGLE3 = ["--algorithm", "eagle3", "--head-size", "8192", "--ttt-steps", "3", "--max-len", "384"]
FULL = {
    "runs": {
        "dspark": {"init": "smollm2-135m-dspark", "args": DSPARK, "batch": 64, "lr": "3e-4"},
        "eagle3": {"init": "smollm2-135m-eagle3", "args": EAGLE3, "batch": 64, "lr": "3e-4"},
    },
    # (algorithm, batch, anchors): throughput by batch size, and what more blocks a sequence
    # cost (the run takes them when a step costs at most ANCHORS_PAY times as much)
    "probes": [
        ("dspark", 16, None),
        ("dspark", 64, None),
        ("dspark", 256, None),
        ("dspark", 64, 64),
        ("eagle3", 64, None),
    ],  # fmt: skip
    "probe_steps": 6,
    "distill_share": 0.3,
    "bench": ["--prompts", "3", "--max-tokens", "128"],
    "reserve": 150.0,  # seconds kept for finishing, casting, the bench and packing
    "max_steps": None,
}
SMALL = {
    "runs": {
        "dspark": {
            "init": None,
            "args": ["--algorithm", "dspark", "--markov-rank", "16"],
            "batch": 4,
            "lr": "1e-3",
        },  # fmt: skip
        "eagle3": {"init": None, "args": ["--algorithm", "eagle3"], "batch": 4, "lr": "1e-3"},
    },
    "probes": [("dspark", 2, None), ("dspark", 4, None), ("dspark", 4, 8), ("eagle3", 4, None)],
    "probe_steps": 3,
    "distill_share": 0.2,
    "bench": ["--prompts", "1", "--max-tokens", "8", "--no-chat"],
    "reserve": 60.0,
    "max_steps": 12,
}


def stage(args) -> int:
    """Prompts still to answer and the answers so far, compressed to fit --max-bytes."""
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    answered: set[str] = set()
    budget = args.max_bytes
    if args.answers:
        kept = complete_lines(args.answers / "answers.jsonl")  # not one still being written
        answered = {json.loads(line)["id"] for line in kept if line.strip()}
        packed = lzma.compress("".join(f"{line}\n" for line in kept).encode())
        (out / "answers.jsonl.xz").write_bytes(packed)
        shutil.copyfile(args.answers / "distill.json", out / "distill.json")
        budget -= len(packed)
    lines = [
        line
        for line in args.prompts.read_text(encoding="utf-8").split("\n")
        if line.strip() and json.loads(line)["id"] not in answered
    ]
    best, low = packed_prefix(lines, budget)
    if low == 0:
        sys.exit(f"{args.out}: no room for prompts within --max-bytes {args.max_bytes}")
    (out / "prompts.jsonl.xz").write_bytes(best)
    print(
        f"{out}: {len(answered)} answers and {low} of {len(lines)} pending prompts,"
        f" {sum(f.stat().st_size for f in out.iterdir())} bytes"
    )
    return 0


def packed_prefix(lines: list[str], budget: int, chunk: int = 4_000_000) -> tuple[bytes, int]:
    """The longest prefix of `lines` whose xz streams (one per `chunk` bytes of text, which
    lzma.decompress reads as one) fit `budget` bytes, and its length in lines."""
    packed, taken = b"", 0
    while taken < len(lines):
        end, size = taken, 0
        while end < len(lines) and size < chunk:
            size += len(lines[end]) + 1
            end += 1
        whole = lzma.compress("".join(f"{line}\n" for line in lines[taken:end]).encode())
        if len(packed) + len(whole) <= budget:
            packed, taken = packed + whole, end
            continue
        # the longest prefix of this chunk that still fits
        low, high, best = taken, end - 1, b""
        while low < high:
            middle = (low + high + 1) // 2
            stream = lzma.compress("".join(f"{line}\n" for line in lines[taken:middle]).encode())
            if len(packed) + len(stream) <= budget:
                low, best = middle, stream
            else:
                high = middle - 1
        return packed + best, low
    return packed, taken


def run(args) -> int:
    settings = SMALL if args.small else FULL
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work or tempfile.mkdtemp(prefix="gpu_drafters-"))
    work.mkdir(parents=True, exist_ok=True)
    steps = Steps(work / "steps", args.budget or (240.0 if args.small else 420.0))
    summary: dict = {"steps": steps.done}

    target: list[str] = []
    if args.small:
        demo = work / "demo"
        if not demo.exists():
            steps.run("demo", [*WOODCOCK, "demo", str(demo)], 120)
        target = ["--target", str(demo / "target")]
    summary["facts"] = last_json(steps.run("versions", [sys.executable, "-c", VERSIONS], 60))

    speed = steps.logs / "distill-speed.json"
    bench_script = str(Path(__file__).with_name("distill_bench.py"))
    sizes = ["--batch", "4", "--prompts", "8", "--max-tokens", "8"] if args.small else [
        "--batch", "64", "--batch", "256", "--prompts", "256", "--max-tokens", "32"
    ]  # fmt: skip
    done = steps.run(
        "distill-speed",
        [sys.executable, bench_script, *target, "--random-weights", *sizes, "--json", str(speed)],
        90,
    )
    summary["distill_speed"] = json.loads(speed.read_text()) if done and speed.exists() else {}

    data = work / "distill"
    before = seed_answers(args.data, data)
    prompts = work / "prompts.jsonl"
    prompts.write_bytes(lzma.decompress((args.data / "prompts.jsonl.xz").read_bytes()))
    distill = [*WOODCOCK, "distill", *target, "--prompts", str(prompts), "--out", str(data)]
    # the staged answers' recipe, so that one directory holds one
    recipe = json.loads((data / "distill.json").read_text()) if before["answers"] else {}
    max_tokens = recipe.get("max_tokens", DISTILL["max_tokens"])
    distill += ["--max-tokens", str(max_tokens), "--batch", str(DISTILL["batch"])]
    done = steps.run("distill", distill, settings["distill_share"] * steps.left())
    if done is not None and done.returncode == 2 and "use another --out" in done.stderr:
        # answers staged from another machine's conversion of the target: start over without
        shutil.rmtree(data)
        before = seed_answers(None, data)
        steps.run("distill-fresh", distill, settings["distill_share"] * steps.left())
    after = count_answers(data)
    summary["distill"] = {"staged": before, **after, "seconds": steps.done[-1]["seconds"]}

    summary["probes"] = probes = {}
    for algorithm, batch, anchors in settings["probes"]:
        name = probe_name(algorithm, batch, anchors)
        probe = work / name
        argv = [*WOODCOCK, "train", *target, "--data", str(data), "--out", str(probe)]
        argv += [*settings["runs"][algorithm]["args"], "--batch", str(batch)]
        argv += [
            "--steps",
            str(settings["probe_steps"]),
            *(["--anchors", str(anchors)] * bool(anchors)),
        ]
        argv += ["--eval-every", "1000000", "--checkpoint-every", "1000000", "--force"]
        # the first builds the target's features for every answer
        steps.run(name, argv, 90 if probes else 240)
        probes[name] = throughput(Path(f"{probe}.ckpt") / "log.jsonl")
        shutil.rmtree(probe, ignore_errors=True)

    summary["runs"] = runs = {}
    names = list(settings["runs"])
    for i, (algorithm, recipe) in enumerate(settings["runs"].items()):
        # the time left before the reserve, shared by the runs still to come
        seconds = (steps.left() - settings["reserve"]) / (len(names) - i)
        measured = probes.get(probe_name(algorithm, recipe["batch"], None)) or {}
        recipe = {**recipe, "anchors": None}
        for probed, batch, anchors in settings["probes"]:
            wider = probes.get(probe_name(probed, batch, anchors)) or {}
            if (probed, batch) == (algorithm, recipe["batch"]) and anchors and measured and wider:
                if wider["seconds_per_step"] <= ANCHORS_PAY * measured["seconds_per_step"]:
                    measured, recipe["anchors"] = wider, anchors
        count = planned_steps(seconds, measured, settings["max_steps"])
        runs[algorithm] = train_run(steps, work, data, target, algorithm, recipe, seconds, count)

    bench = [*WOODCOCK, "bench", *target, "--no-lookup", *settings["bench"], "--json"]
    written = [runs[a]["drafter"] for a in names if runs[a].get("drafter")]
    for drafter in written:
        bench += ["--drafter", drafter]
    summary["bench"] = last_json(steps.run("bench", bench, 150)) if written else {}

    summary["pieces"] = pack(out, work, data, written, before["answers"], steps)
    text = render(summary, steps)
    (out / "summary.txt").write_text(text + "\n")
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(text)
    if not args.work:
        shutil.rmtree(work)
    return 0


def seed_answers(staged: Path | None, data: Path) -> dict:
    """The staged answers (and their distill.json) as the start of the distill directory."""
    data.mkdir(parents=True, exist_ok=True)
    if staged is not None and (staged / "answers.jsonl.xz").exists():
        raw = lzma.decompress((staged / "answers.jsonl.xz").read_bytes())
        (data / "answers.jsonl").write_bytes(raw)
        shutil.copyfile(staged / "distill.json", data / "distill.json")
    return count_answers(data)


def count_answers(data: Path) -> dict:
    answers = jsonl(data / "answers.jsonl")
    return {"answers": len(answers), "answer_tokens": sum(len(a["answer_ids"]) for a in answers)}


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in complete_lines(path) if line.strip()]


def complete_lines(path: Path) -> list[str]:
    """A JSON-lines file's lines, without a last one cut short by a killed writer ("\n" alone
    ends a line: JSON text may hold other line separators); none if it is missing."""
    return path.read_text(encoding="utf-8").split("\n")[:-1] if path.exists() else []


def throughput(log: Path) -> dict:
    """Training tokens/s of a run's steps after its first (which compiles), from its log."""
    entries = jsonl(log)
    timed = [e for e in entries if e.get("step", 0) >= 2 and "tokens_per_second" in e]
    if not timed:
        return {}
    return {
        "steps": len(timed),
        "tokens_per_step": statistics.mean(e["tokens"] for e in timed),
        "seconds_per_step": statistics.median(e["seconds"] for e in timed),
        "tokens_per_second": statistics.median(e["tokens_per_second"] for e in timed),
    }


def probe_name(algorithm: str, batch: int, anchors: int | None) -> str:
    return f"probe-{algorithm}-{batch}" + (f"-anchors{anchors}" if anchors else "")


def planned_steps(seconds: float, measured: dict, most: int | None) -> int:
    """As many of the probe's steady steps as fit `seconds`, less a margin for loading, the
    features check and the evaluations."""
    per_step = measured.get("seconds_per_step")
    count = max(4, math.floor(0.8 * seconds / per_step)) if per_step else 8
    return min(count, most) if most else count


def train_run(steps, work, data, target, algorithm, recipe, seconds, count) -> dict:
    """Train `count` steps within `seconds`, write the drafter (from the last checkpoint if the
    run was cut short) and cast it to bf16; what happened, and the drafter's path if any."""
    out = work / f"{algorithm}-fp32"
    argv = [*WOODCOCK, "train", *target, "--data", str(data), "--out", str(out)]
    argv += [*recipe["args"], "--batch", str(recipe["batch"]), "--lr", recipe["lr"]]
    argv += ["--steps", str(count), "--eval-every", str(max(1, count // 4))]
    argv += ["--checkpoint-every", "25", "--force"]
    if recipe["init"]:
        argv += ["--init", recipe["init"]]
    if recipe["anchors"]:
        argv += ["--anchors", str(recipe["anchors"])]
    result: dict = {"steps_planned": count, "seconds_planned": round(seconds, 1)}
    result["anchors"] = recipe["anchors"]
    steps.run(f"train-{algorithm}", argv, seconds)
    if not (out / "model.safetensors").exists():
        finish = [a for a in argv if a != "--force"] + ["--resume", "--finish"]
        steps.run(f"finish-{algorithm}", finish, 90)
    log = Path(f"{out}.ckpt") / "log.jsonl"
    entries = jsonl(log)
    result["steps_done"] = max((e.get("step", 0) for e in entries), default=0)
    result["evaluations"] = [{"step": e["step"], **e["eval"]} for e in entries if "eval" in e]
    result["throughput"] = throughput(log)
    if (out / "model.safetensors").exists():
        cast = work / f"woodcock-{algorithm}"
        argv = [*WOODCOCK, "convert", str(out), str(cast), "--to", "woodcock"]
        # the default target by its public name, as the shipped drafters record it
        argv += [] if target else ["--target-name", "HuggingFaceTB/SmolLM2-135M-Instruct"]
        done = steps.run(f"bf16-{algorithm}", [*argv, "--dtype", "bfloat16", "--force"], 60)
        if done is not None and done.returncode == 0:
            result["drafter"] = str(cast)
    return result


def pack(out: Path, work: Path, data: Path, drafters: list[str], staged: int, steps) -> dict:
    """One tar of what is worth bringing back, most valuable first, split into pieces; a part
    that would overrun what a call returns is left out and named in the manifest."""
    made = work / "answers-made.jsonl.gz"
    lines = [f"{line}\n" for line in complete_lines(data / "answers.jsonl")]
    with gzip.open(made, "wt", encoding="utf-8") as f:
        f.writelines(lines[staged:])
    shutil.copyfile(data / "distill.json", work / "distill.json")
    logs = sorted(work.glob("*-fp32.ckpt/log.jsonl"))  # the training runs' (train_run)
    candidates = [(Path(d), f"drafters/{Path(d).name}") for d in drafters]
    candidates += [(made, "answers/answers-made.jsonl.gz")]
    candidates += [(work / "distill.json", "answers/distill.json")]
    candidates += [(log, f"logs/{log.parent.name}.log.jsonl") for log in logs if log.exists()]
    steps.bundle(work / "steps.tar.gz")
    candidates.append((work / "steps.tar.gz", "logs/steps.tar.gz"))
    archive = work / "results.tar"
    kept, left_out, size = [], [], 0
    with tarfile.open(archive, "w") as tar:
        for path, name in candidates:
            grows = sum(p.stat().st_size for p in ([path] if path.is_file() else path.rglob("*")))
            if size + grows > RETURNED_BYTES:
                left_out.append(name)
                continue
            tar.add(path, arcname=name)
            kept.append(name)
            size += grows
    blob = archive.read_bytes()
    pieces = []
    for i in range(0, len(blob), PIECE_BYTES):
        piece = out / f"results.tar.{len(pieces):03d}"
        piece.write_bytes(blob[i : i + PIECE_BYTES])
        digest = hashlib.sha256(blob[i : i + PIECE_BYTES]).hexdigest()
        pieces.append({"file": piece.name, "sha256": digest})
    manifest = {
        "archive": "results.tar",
        "bytes": len(blob),
        "sha256": hashlib.sha256(blob).hexdigest(),
        "pieces": pieces,
        "contents": kept,
        "left_out": left_out,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return {"pieces": len(pieces), "bytes": len(blob), "left_out": left_out}


def join(args) -> int:
    """The pieces under args.pieces checked against the manifest, joined and unpacked."""
    manifest = json.loads((args.pieces / "manifest.json").read_text())
    blob = bytearray()
    for piece in manifest["pieces"]:
        data = (args.pieces / piece["file"]).read_bytes()
        if hashlib.sha256(data).hexdigest() != piece["sha256"]:
            return refuse(f"{args.pieces / piece['file']}: sha256 differs from manifest.json")
        blob += data
    if hashlib.sha256(blob).hexdigest() != manifest["sha256"]:
        return refuse(f"{args.pieces}: the joined pieces differ from manifest.json's sha256")
    dest = args.dest or args.pieces / "results"
    if dest.exists():
        return refuse(f"{dest}: exists; give another --dest")
    partial = dest.with_name(dest.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    archive = partial / manifest["archive"]
    archive.write_bytes(bytes(blob))
    with tarfile.open(archive) as tar:
        tar.extractall(partial, filter="data")
    archive.unlink()
    os.replace(partial, dest)
    print(f"{dest}: {', '.join(manifest['contents'])}")
    return 0


def refuse(message: str) -> int:
    print(message, file=sys.stderr)
    return 2


def render(summary: dict, steps: Steps) -> str:
    facts = summary.get("facts") or {}
    versions = facts.get("versions") or {}
    lines = [
        "versions: " + ", ".join(f"{k} {v}" for k, v in versions.items() if v),
        f"backend: {facts.get('backend')} ({facts.get('device_info', {}).get('device_name')})",
        "",
        "distillation speed (random weights; answer tokens/s):",
    ]
    for row in (summary.get("distill_speed") or {}).get("rows", []):
        lines.append(
            f"  batch {row['batch']:4d}  {row['generator']:24s} {row['tokens_per_second']:9.1f}"
            f"  identical {row['identical']}/{row['prompts']}"
        )
    d = summary.get("distill") or {}
    lines += [
        f"distill: {d.get('staged', {}).get('answers', 0)} staged answers -> {d.get('answers', 0)}"
        f" ({d.get('answer_tokens', 0)} answer tokens) in {d.get('seconds', 0)} s",
        "",
        "training throughput (tokens/s, steady steps):",
    ]
    for name, found in (summary.get("probes") or {}).items():
        lines.append(f"  {name:22s} {found.get('tokens_per_second', 0):10.0f}")
    for algorithm, found in (summary.get("runs") or {}).items():
        last = (found.get("evaluations") or [{}])[-1]
        figure = "holdout_acceptance_length" if algorithm != "eagle3" else "holdout_agreement"
        lines.append(
            f"{algorithm}: {found.get('steps_done')} of {found.get('steps_planned')} steps,"
            f" {figure} {last.get(figure)} at step {last.get('step')}, drafter"
            f" {'written' if found.get('drafter') else 'NOT written'}"
        )
    for run in (summary.get("bench") or {}).get("runs") or []:
        total = run["rows"][-1]
        lines.append(
            f"bench {Path(run['drafter']).name}: {total['woodcock_tps']:.1f} tok/s,"
            f" {total['speedup']:.2f}x over {total['baseline_tps']:.1f},"
            f" identical {total['identical']}/{total['prompts']}"
        )
    p = summary.get("pieces") or {}
    lines += [
        f"pieces: {p.get('pieces')} ({p.get('bytes')} bytes), left out: {p.get('left_out')}",
        steps.outcome(),
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    verbs = parser.add_subparsers(dest="verb", required=True)
    p = verbs.add_parser("stage")
    p.add_argument("--prompts", type=Path, required=True, help="JSONL prompts (woodcock distill)")
    p.add_argument("--answers", type=Path, help="a woodcock distill directory to continue")
    p.add_argument("--out", type=Path, default=Path(".gpu/data"))
    p.add_argument("--max-bytes", type=int, default=9_000_000)
    p = verbs.add_parser("run")
    p.add_argument("--data", type=Path, required=True, help="a folder `stage` wrote")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu_drafters"))
    p.add_argument("--work", type=Path, help="keep the working files here (default: removed)")
    p.add_argument("--budget", type=float, help="seconds for all steps (420; --small 240)")
    p.add_argument("--small", action="store_true", help="the demo target, a quick CPU run")
    p = verbs.add_parser("join")
    p.add_argument("pieces", type=Path, help="the folder holding manifest.json and the pieces")
    p.add_argument("--dest", type=Path)
    args = parser.parse_args()
    return {"stage": stage, "run": run, "join": join}[args.verb](args)


if __name__ == "__main__":
    sys.exit(main())
