"""Conversion benchmark (not a test): wall time against a plain copy of the same bytes, and peak
memory, for full-size Qwen3-4B drafters converted between every pair of formats that can hold
them.

    python benchmarks/convert_bench.py [--workdir /tmp/woodcock-bench] [--only dspark]

Drafters (random weights, bfloat16, `woodcock.synthetic.random_weights`):
  dspark    5 Qwen3 layers, hidden 2560, heads 32/8 x 128, MLP 9728, 5 taps of a 36-layer target,
            vanilla Markov head of rank 256 and a confidence head over the full 151936 vocabulary;
            embedding and LM head shared with the target (~1.2 GB)
  eagle3    1 Llama layer, head_dim 128 (SpecForge's Qwen3-4B config), its own embedding and full
            LM head: 914M parameters, 389M of them the embedding (~1.8 GB)
  eagle3-80 the same with head_dim 80 (= 2560 / 32), the only shape SafeAILab can hold

Each conversion runs in a fresh subprocess (`woodcock convert` in-process there): wall time of
the conversion itself (imports excluded) and peak RSS from resource.getrusage, against
shutil.copyfile of the source directory's files in another fresh subprocess; the fastest of
--runs runs of each (other load on the machine only adds time). Targets: wall <=
1.5 x copy; peak RSS <= the largest single tensor + 300 MB. Sources are converted from a native
seed first (not timed); every output is deleted after its measurement.

The native format checks a source's sha256s and records an output's: `sha256 s` is the time
to hash the source's files once (file_sha256, fastest of --runs), the least any pair that
reads or writes the native format can take, however well hashing overlaps the copy.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

MB = 1024 * 1024

# The measured process: a conversion (imports excluded from its wall time) or a plain copy.
CHILD_CONVERT = """
import json, sys, time
from woodcock.cli import main
import woodcock.converters.dtype, woodcock.converters.target_binding, woodcock.converters.vocab
import woodcock.formats.detect, woodcock.loading, woodcock.target_checkpoint  # what convert imports
import typer._adapters  # what typer imports when it parses options (pydantic, when installed)
start = time.perf_counter()
try:
    main(sys.argv[1:])
except SystemExit as e:
    if e.code:
        raise
print(json.dumps({"wall": time.perf_counter() - start}))
"""

CHILD_COPY = """
import json, shutil, sys, time
from pathlib import Path
source, dest = Path(sys.argv[1]), Path(sys.argv[2])
start = time.perf_counter()
dest.mkdir()
for file in sorted(source.iterdir()):
    shutil.copyfile(file, dest / file.name)
print(json.dumps({"wall": time.perf_counter() - start}))
"""

CHILD_HASH = """
import json, sys, time
from pathlib import Path
from woodcock.tensorfile import file_sha256
start = time.perf_counter()
for file in sorted(Path(sys.argv[1]).iterdir()):
    file_sha256(file)
print(json.dumps({"wall": time.perf_counter() - start}))
"""

# A small process between this one and the measured one: Linux keeps ru_maxrss across exec, so
# a child spawned straight from this (large) process would start with this one's peak. The
# launcher is small; getrusage(RUSAGE_CHILDREN) gives the measured process's own peak.
LAUNCHER = """
import json, resource, subprocess, sys
result = subprocess.run(sys.argv[1:], capture_output=True, text=True)
sys.stderr.write(result.stderr)
if result.returncode:
    sys.exit(result.returncode)
row = json.loads(result.stdout.strip().splitlines()[-1])
row["rss_kb"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
print(json.dumps(row))
"""


def specs():
    from woodcock.ir import (
        DecoderLayer,
        DrafterSpec,
        DSpark,
        Eagle3,
        Fusion,
        Head,
        Taps,
        Target,
    )

    def layer(head_dim, eagle3):
        return DecoderLayer(
            style="llama" if eagle3 else "qwen3",
            input="embed_and_hidden" if eagle3 else "hidden",
            attention="causal" if eagle3 else "block_bidirectional",
            sliding_window=None,
            hidden_size=2560,
            intermediate_size=9728,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=head_dim,
            rms_norm_eps=1e-6,
            rope_theta=1e6,
            rope_scaling=None,
            max_position_embeddings=40960,
        )

    target = Target(num_hidden_layers=36, hidden_size=2560, vocab_size=151936)
    dspark = DrafterSpec(
        algorithm=DSpark(
            block_size=7,
            mask_token_id=151669,
            sample_from_anchor=True,
            markov_head_type="vanilla",
            markov_rank=256,
            confidence_head=True,
            confidence_head_with_markov=True,
        ),
        target=target,
        taps=Taps((2, 10, 18, 26, 34)),
        fusion=Fusion(tap_norm="none", fc_bias=False, hidden_norm=True),
        layers=tuple(layer(128, False) for _ in range(5)),
        head=Head(lm_head="shared", embedding="shared"),
        draft_vocab_size=151936,
    )

    def eagle3(head_dim):
        return DrafterSpec(
            algorithm=Eagle3(norm_before_residual=False, norm_output=False),
            target=target,
            taps=Taps((2, 18, 33)),
            fusion=Fusion(tap_norm="none", fc_bias=False, hidden_norm=False),
            layers=(layer(head_dim, True),),
            head=Head(lm_head="own", embedding="own"),
            draft_vocab_size=151936,
        )

    return {
        "dspark": (dspark, ["woodcock", "speculators", "specforge-dspark"]),
        "eagle3": (eagle3(128), ["woodcock", "speculators", "specforge"]),
        "eagle3-80": (eagle3(80), ["woodcock", "speculators", "specforge", "safeailab"]),
    }


def child(code: str, *args: str) -> dict:
    command = [sys.executable, "-c", LAUNCHER, sys.executable, "-c", code, *args]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode:
        raise SystemExit(f"child failed: {args}\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def best_of(runs: int, code: str, args: list[str], output: Path | None) -> dict:
    """The fastest of a few runs (other load on the machine only ever adds time); the output,
    if any, is deleted after each."""
    rows = []
    for _ in range(runs):
        os.sync()  # start every run without a backlog of dirty pages to write back
        rows.append(child(code, *args))
        if output is not None:
            shutil.rmtree(output)
    return min(rows, key=lambda row: row["wall"])


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir())


def run_case(name: str, workdir: Path, runs: int) -> list[dict]:
    from woodcock.formats import native
    from woodcock.ir import Drafter, VocabMap
    from woodcock.synthetic import random_weights

    spec, formats = specs()[name]
    case_dir = workdir / name
    shutil.rmtree(case_dir, ignore_errors=True)
    case_dir.mkdir(parents=True)
    print(f"[{name}] synthesising random bf16 weights ...", flush=True)
    weights = random_weights(spec, "BF16", seed=0)
    largest = max(a.nbytes for a in weights.values())
    params = sum(a.size for a in weights.values())
    seed = case_dir / "seed"
    native.write(Drafter(spec, VocabMap(), weights), seed)
    del weights
    taps = ",".join(str(i) for i in spec.taps.layer_ids)
    # the target's facts, for formats that must record its layer count (z-lab, SpecForge DSpark)
    target = case_dir / "target"
    target.mkdir()
    facts = {"num_hidden_layers": 36, "hidden_size": 2560, "vocab_size": 151936}
    (target / "config.json").write_text(
        json.dumps({"architectures": ["Qwen3ForCausalLM"], **facts})
    )
    sources = {}
    for fmt in formats:
        sources[fmt] = case_dir / f"src-{fmt}"
        child(CHILD_CONVERT, "convert", str(seed), str(sources[fmt]), "--to", fmt, "--force")
    shutil.rmtree(seed)
    rows = []
    for src_fmt in formats:
        for dest_fmt in formats:
            if src_fmt == dest_fmt:
                continue
            source, dest, copy = sources[src_fmt], case_dir / "out", case_dir / "copy"
            argv = ["convert", str(source), str(dest), "--to", dest_fmt]
            if src_fmt == "safeailab":
                argv += ["--taps", taps]
            if dest_fmt in ("specforge-dspark", "zlab-dflash"):
                argv += ["--target", str(target)]
            copied = best_of(runs, CHILD_COPY, [str(source), str(copy)], copy)
            hashed = best_of(runs, CHILD_HASH, [str(source)], None)
            converted = best_of(runs, CHILD_CONVERT, argv, dest)
            size = directory_bytes(source)
            row = {
                "drafter": name,
                "from": src_fmt,
                "to": dest_fmt,
                "params": params,
                "bytes": size,
                "wall": converted["wall"],
                "copy": copied["wall"],
                "ratio": converted["wall"] / copied["wall"],
                "sha256": hashed["wall"],
                "rss_mb": converted["rss_kb"] / 1024,
                "largest_mb": largest / MB,
                "rss_budget_mb": largest / MB + 300,
            }
            rows.append(row)
            print(
                f"[{name}] {src_fmt:>16} -> {dest_fmt:<16} {row['wall']:6.2f}s"
                f" (copy {row['copy']:5.2f}s, x{row['ratio']:.2f}; sha256 {row['sha256']:.2f}s)"
                f"  peak RSS {row['rss_mb']:7.0f} MB (budget {row['rss_budget_mb']:.0f})",
                flush=True,
            )
    shutil.rmtree(case_dir)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/tmp/woodcock-bench")
    parser.add_argument("--only", action="append", choices=sorted(specs()))
    parser.add_argument("--runs", type=int, default=2, help="Take the fastest of this many.")
    parser.add_argument("--json", help="Also write the rows to this file.")
    args = parser.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(workdir).free
    print(f"{workdir}: {free / 2**30:.1f} GiB free (needs about 12 GiB)", flush=True)
    if free < 12 * 2**30:
        raise SystemExit("not enough free disk")
    rows = []
    started = time.perf_counter()
    for name in args.only or list(specs()):
        rows += run_case(name, workdir, args.runs)
    print(f"\ntotal {time.perf_counter() - started:.0f}s\n")
    print(
        "| drafter | from | to | GB | convert s | copy s | ratio | sha256 s | peak RSS MB |"
        " budget MB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['drafter']} | {r['from']} | {r['to']} | {r['bytes'] / 1e9:.2f} |"
            f" {r['wall']:.2f} | {r['copy']:.2f} | {r['ratio']:.2f} | {r['sha256']:.2f} |"
            f" {r['rss_mb']:.0f} | {r['rss_budget_mb']:.0f} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
