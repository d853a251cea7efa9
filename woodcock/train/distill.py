"""`woodcock distill`: the target answers a set of prompts, greedily, in batches; resumable.

Output directory:
    answers.jsonl   one line per answered prompt, appended as each answer finishes:
                    {"id", "prompt_ids", "answer_ids", "finish_reason"}. answer_ids are the
                    tokens the target generated, including the EOS token when it stopped on one
                    (finish_reason "stop"; "length" when it reached --max-tokens). The run
                    appending holds a flock on it: a second run at the same time would answer
                    the same prompts again and append them twice.
    distill.json    how the answers were made (target, template, length cap, generators); a
                    re-run must agree with it, so one directory never mixes two recipes.

Generation is woodcock.runtime.greedy_batch: up to `batch` answers decode together, a finished
one makes room for the next prompts, which are prefilled together (on the CPU, a later turn of
a conversation from the cache of an earlier turn's prompt, where both are asked). It gives token
for token what mlx-lm's `generate_step` gives one prompt at a time (checked in the tests on the
tiny target; batched arithmetic may still break exact ties differently on a real model). It
replaced mlx-lm's `BatchGenerator`, which computes and hands back every row's log-probabilities
over the whole vocabulary each step: at 256 rows on the CPU that alone took longer than the
step's forward (`benchmarks/RESULTS.md`).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from woodcock.default_target import resolve_target
from woodcock.errors import DrafterError
from woodcock.jsonfile import is_int_list, jsonl_records, read_json_object, write_json
from woodcock.provenance import identity, portable_path, same_content
from woodcock.runtime.generate import check_system_prompt, encode_messages, encode_prompt
from woodcock.runtime.greedy_batch import greedy_answers
from woodcock.runtime.target import MlxTarget
from woodcock.target_checkpoint import load_mlx_target

try:
    import fcntl
except ImportError:  # Windows: no locks, so concurrent runs are not kept apart
    fcntl = None

ANSWERS = "answers.jsonl"
META = "distill.json"
META_VERSION = 1
GENERATOR = "woodcock.runtime.greedy_batch"


@dataclass
class DistillReport:
    prompts: int = 0  # in the prompts file
    skipped: int = 0  # already answered by an earlier run
    answered: int = 0  # answered by this run
    prompt_tokens: int = 0
    answer_tokens: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.answer_tokens / self.seconds if self.seconds else 0.0


ROLES = ("user", "assistant")


def read_prompts(path: Path) -> list[tuple[str, str | list[dict]]]:
    """(id, prompt) per line of a JSONL file of {"id", "prompt"} objects, or {"id", "messages"}
    for a conversation so far: [{"role", "content"}] from a user turn, roles alternating between
    "user" and "assistant", ending with the user's turn to answer. Ids must be unique."""
    return [(ident, prompt) for _, ident, prompt in _prompt_records(path)]


def _prompt_records(path: Path) -> list[tuple[str, str, str | list[dict]]]:
    """`read_prompts` with each prompt's `FILE:LINE` first."""
    path = Path(path)
    prompts: list[tuple[str, str, str | list[dict]]] = []
    seen: set[str] = set()
    for where, row in jsonl_records(path):
        if not isinstance(row, dict) or not (
            (isinstance(row.get("prompt"), str) and row["prompt"]) or "messages" in row
        ):
            raise DrafterError(
                f"{where}: expected an object with a non-empty string 'prompt' or 'messages'"
            )
        ident = row.get("id")
        if isinstance(ident, int) and not isinstance(ident, bool):
            ident = str(ident)
        if not isinstance(ident, str) or not ident:
            raise DrafterError(f"{where}: id = {row.get('id')!r}: expected a string")
        if ident in seen:
            raise DrafterError(f"{where}: id {ident!r} occurs twice")
        seen.add(ident)
        prompt = row["prompt"] if "prompt" in row else _conversation(where, row["messages"])
        prompts.append((where, ident, prompt))
    if not prompts:
        raise DrafterError(f"{path}: no prompts")
    return prompts


def _conversation(where: str, messages) -> list[dict]:
    """A conversation's messages as the chat template takes them, checked."""
    if not isinstance(messages, list) or len(messages) % 2 != 1:
        raise DrafterError(
            f"{where}: 'messages' must be a list of an odd number of turns (user first and last)"
        )
    for i, message in enumerate(messages):
        expected = ROLES[i % 2]
        if (
            not isinstance(message, dict)
            or message.get("role") != expected
            or not isinstance(message.get("content"), str)
            or not message["content"]
        ):
            raise DrafterError(
                f"{where}: messages[{i}]: expected {{'role': {expected!r}, 'content': a"
                " non-empty string}"
            )
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _with(recorded, value: str) -> list:
    """A recorded list (or single string) of names with `value` added once."""
    names = [recorded] if isinstance(recorded, str) else recorded
    return list(dict.fromkeys([*(names if isinstance(names, list) else []), value]))


def encode_distill_prompt(tokenizer, prompt, *, chat: bool, system: str | None) -> list[int]:
    """A prompt's tokens as the target sees them: a text like `woodcock generate` encodes it, a
    conversation through the chat template (after the system prompt, when given)."""
    if isinstance(prompt, str):
        return encode_prompt(tokenizer, prompt, chat=chat, system=system)
    if not chat or not tokenizer.has_chat_template:
        raise DrafterError(
            "a prompt given as 'messages' needs the target's chat template (and no --no-chat)"
        )
    head = [{"role": "system", "content": system}] if system else []
    return encode_messages(tokenizer, head + prompt)


def read_answers(out: Path, *, repair: bool = False) -> list[dict]:
    """The answers written so far. A last line cut short by an interrupted run is dropped (and,
    with `repair`, cut off the file so appending continues cleanly); any other bad line is an
    error."""
    return [row for _, row in answer_records(out, repair=repair)]


def answer_records(out: Path, *, repair: bool = False) -> list[tuple[str, dict]]:
    """`read_answers` with each record's `FILE:LINE` first."""
    path = Path(out) / ANSWERS
    if not path.exists():
        return []
    data = path.read_bytes()
    rows: list[tuple[str, dict]] = []
    start, number = 0, 0
    while start < len(data):
        number += 1
        end = data.find(b"\n", start)
        complete = end != -1
        line = data[start : end if complete else len(data)]
        try:
            row = json.loads(line) if line.strip() else None
        except (json.JSONDecodeError, UnicodeDecodeError):
            row = False
        if row is False or (row is not None and not _valid_answer(row)):
            if complete:
                raise DrafterError(
                    f"{path}:{number}: not a valid answer record; expected an object with a"
                    " string 'id' and lists of integers 'prompt_ids' and 'answer_ids'"
                )
            if repair:
                with open(path, "r+b") as f:
                    f.truncate(start)
            break
        if row is not None:
            if not complete and repair:  # a whole record without its newline
                with open(path, "ab") as f:
                    f.write(b"\n")
            rows.append((f"{path}:{number}", row))
        if not complete:
            break
        start = end + 1
    return rows


def _valid_answer(row) -> bool:
    return (
        isinstance(row, dict)
        and isinstance(row.get("id"), str)
        and is_int_list(row.get("prompt_ids"))
        and is_int_list(row.get("answer_ids"))
    )


@contextlib.contextmanager
def _sole_writer(answers: Path) -> Iterator[None]:
    """Held while this run reads and appends to `answers`; another live run there is refused.
    The kernel drops the lock when its process dies, however it dies: a killed run blocks no
    later one. The file is locked, not its folder, whose lock staging.py takes for outputs
    staged inside it."""
    if fcntl is None:
        yield
        return
    fd = os.open(answers, os.O_RDONLY | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DrafterError(
                f"{answers}: is being written by another woodcock distill; wait for it to finish"
            ) from None
        except OSError:
            pass  # a file system without flock: runs are then not kept apart
        yield
    finally:
        os.close(fd)


def _refuse_unencodable(
    prompts: list[tuple[str, str, str | list[dict]]], tokenizer, *, chat: bool, target: str
) -> None:
    """Refuse a conversation that could not be encoded, before any file is written: a folder
    left behind with its distill.json would then refuse the corrected command."""
    if chat and tokenizer.has_chat_template:
        return
    for where, _, prompt in prompts:
        if not isinstance(prompt, str):
            why = "which --no-chat turns off" if not chat else f"and {target} has none"
            raise DrafterError(
                f"{where}: a prompt given as 'messages' needs the target's chat template, {why}"
            )


def distill(
    target: str | None,
    prompts_file: Path,
    out: Path,
    *,
    max_tokens: int = 256,
    batch: int = 8,
    chat: bool = True,
    system: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> DistillReport:
    """Answer every prompt of `prompts_file` not yet answered in `out` (target None: the default
    target). progress(done, total) is called as answers finish."""
    if max_tokens < 1 or batch < 1:
        raise DrafterError(f"--max-tokens {max_tokens}, --batch {batch}: expected at least 1")
    check_system_prompt(system, chat=chat)
    out = Path(out)
    prompts = _prompt_records(prompts_file)
    if target is None:
        target = resolve_target(None)
    prompts_record = portable_path(prompts_file, out)
    meta = {
        "version": META_VERSION,
        "target": identity(target),
        "max_tokens": max_tokens,
        "chat": chat,
        "system": system,
        "decoding": "greedy",
    }
    if out.exists() and not out.is_dir():
        raise DrafterError(f"{out}: exists and is not a directory")
    # the target first: a run that cannot start leaves no folder behind
    model, tokenizer = load_mlx_target(target)
    _refuse_unencodable(prompts, tokenizer, chat=chat, target=str(target))
    out.mkdir(parents=True, exist_ok=True)
    with _sole_writer(out / ANSWERS):
        meta_path = out / META
        if meta_path.exists():
            recorded = read_json_object(meta_path)
            differing = [
                k
                for k in ("target", "max_tokens", "chat", "system")
                if not same_content(recorded.get(k), meta[k])
            ]
            if differing:
                k = differing[0]
                raise DrafterError(
                    f"{meta_path}: the answers there were made with {k} = {recorded.get(k)!r}, this"
                    f" run asks for {meta[k]!r}; use another --out directory"
                )
            meta = {
                **recorded,
                "prompts_files": _with(recorded.get("prompts_files"), prompts_record),
                # answers made by an older version name its generator in "generator"
                "generators": _with(
                    recorded.get("generators", recorded.get("generator")), GENERATOR
                ),
            }
        elif (out / ANSWERS).exists() and (out / ANSWERS).stat().st_size:
            raise DrafterError(
                f"{meta_path}: missing, while {out / ANSWERS} holds answers: which target and"
                " settings made them is unknown; restore it, or use another --out directory"
            )
        else:
            meta |= {"prompts_files": [prompts_record], "generators": [GENERATOR]}
        done = {row["id"] for row in read_answers(out, repair=True)}
        pending = [(ident, prompt) for _, ident, prompt in prompts if ident not in done]
        report = DistillReport(prompts=len(prompts), skipped=len(prompts) - len(pending))
        if mx.default_device() == mx.cpu:
            model.set_dtype(mx.float32)  # half-precision matmuls have no BLAS path on CPU
        meta["eos_ids"] = sorted(int(t) for t in tokenizer.eos_token_ids)
        # Through a temporary file: a run killed while writing must not leave a torn distill.json,
        # which would stop every later run from resuming.
        partial_meta = out / f".{META}.partial"
        write_json(partial_meta, meta)
        os.replace(partial_meta, meta_path)
        if progress:
            progress(report.skipped, report.prompts)
        if not pending:
            return report
        encoded = [
            encode_distill_prompt(tokenizer, prompt, chat=chat, system=system)
            for _, prompt in pending
        ]
        start = time.perf_counter()
        answers = greedy_answers(
            MlxTarget(model, (), name=str(target)),
            encoded,
            batch=batch,
            max_tokens=max_tokens,
            stop_ids=tokenizer.eos_token_ids,
        )
        with open(out / ANSWERS, "a", encoding="utf-8") as f:
            for answer in answers:
                record = {
                    "id": pending[answer.index][0],
                    "prompt_ids": [int(t) for t in encoded[answer.index]],
                    "answer_ids": answer.tokens,
                    "finish_reason": answer.finish_reason,
                }
                f.write(json.dumps(record) + "\n")
                f.flush()
                report.answered += 1
                report.prompt_tokens += len(record["prompt_ids"])
                report.answer_tokens += len(record["answer_ids"])
                if progress:
                    progress(report.skipped + report.answered, report.prompts)
            os.fsync(f.fileno())
        report.seconds = time.perf_counter() - start
        return report
