"""Shared test helpers (tests/ is on sys.path under pytest)."""

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
