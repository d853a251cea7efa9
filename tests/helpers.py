"""Shared test helpers (tests/ is on sys.path under pytest)."""

import json
import mmap

import numpy as np

from woodcock.ir import Drafter


def base_is_mmap(array) -> bool:
    while array is not None and not isinstance(array, mmap.mmap):
        array = array.obj if isinstance(array, memoryview) else array.base
    return isinstance(array, mmap.mmap)


def assert_same_drafter(a: Drafter, b: Drafter) -> None:
    """Equal specs, equal vocabulary maps and counts, bit-identical weights of the same dtypes."""
    assert a.spec == b.spec
    for x, y in ((a.vocab.draft_to_target, b.vocab.draft_to_target),):
        assert (x is None) == (y is None)
        if x is not None:
            assert x.dtype == y.dtype and np.array_equal(x, y)
    assert (a.vocab.counts is None) == (b.vocab.counts is None)
    if a.vocab.counts is not None:
        assert np.array_equal(a.vocab.counts.counts, b.vocab.counts.counts)
        assert a.vocab.counts.info == b.vocab.counts.info
    assert set(a.weights) == set(b.weights)
    for name in a.weights:
        x, y = a.weights[name], b.weights[name]
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert x.tobytes() == y.tobytes(), name


def run_cli(argv, capsys) -> tuple[int, str, str]:
    """Run the woodcock command in-process: (exit code, stdout, stderr)."""
    from woodcock.cli import main

    try:
        main(argv)
        code = 0
    except SystemExit as e:
        code = e.code or 0
    out, err = capsys.readouterr()
    return code, out, err


def write_corpus_prompts(path, count, start=0):
    """`count` short prompts of the demo corpus's words, one {"id", "prompt"} a line."""
    from woodcock.demo import CORPUS

    words = " ".join(CORPUS).split()
    with open(path, "w") as f:
        for i in range(start, start + count):
            j = (7 * i) % (len(words) - 3)
            f.write(
                json.dumps({"id": f"p{i}", "prompt": " ".join(words[j : j + 1 + i % 3])}) + "\n"
            )
    return path


def distilled_tiny_target(root, *, max_tokens: int, batch: int = 8):
    """`root`/target (the demo's tiny target) and `root`/data, its greedy answers to 30 corpus
    prompts (`woodcock distill`)."""
    from woodcock.demo import write_tiny_target
    from woodcock.train.cli import app

    target = write_tiny_target(root / "target")
    prompts = write_corpus_prompts(root / "prompts.jsonl", 30)
    argv = ["distill", "--target", str(target), "--prompts", str(prompts), "--out",
            str(root / "data"), "--max-tokens", str(max_tokens), "--batch", str(batch), "--no-chat"]  # fmt: skip
    app(argv, standalone_mode=False)
    return root


def json_strings(record):
    """Every string value in a JSON-like record, however deep."""
    if isinstance(record, dict):
        for value in record.values():
            yield from json_strings(value)
    elif isinstance(record, list):
        for value in record:
            yield from json_strings(value)
    elif isinstance(record, str):
        yield record


def generate_tokens(
    prompt,
    target,
    drafter,
    *,
    max_tokens: int,
    num_draft: int | None = None,
    policy=None,
    sampling=None,
    eos_ids=(),
    stats=None,
    lookup=None,
) -> list[int]:
    """Tokens as plain decoding would emit them: stop before an EOS token or at max_tokens.
    num_draft: a fixed draft length, for `policy=FixedPolicy(num_draft)`."""
    from woodcock.runtime.decode import GREEDY, speculative_generate_step
    from woodcock.runtime.policy import FixedPolicy

    if (num_draft is None) == (policy is None):
        raise ValueError("give exactly one of num_draft and policy")
    steps = speculative_generate_step(
        prompt,
        target,
        drafter,
        policy=policy or FixedPolicy(num_draft),
        sampling=sampling or GREEDY,
        stats=stats,
        lookup=lookup,
    )
    out: list[int] = []
    for token, _ in steps:
        if token in eos_ids or len(out) == max_tokens:
            break
        out.append(token)
    return out


def plain_greedy(model, prompt, max_tokens, eos=()) -> list[int]:
    """mlx-lm's own greedy decoding: the tokens before an EOS, at most max_tokens."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    out = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens):
        if token in eos:
            break
        out.append(token)
    return out
