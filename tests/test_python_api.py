"""The README's Python API given what a user might plausibly pass by mistake: each refused with a
DrafterError naming the argument, before any work; nothing written where a write is refused."""

from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from woodcock.demo import write_demo
from woodcock.errors import DrafterError
from woodcock.loading import load_drafter, save_drafter
from woodcock.runtime.generate import encode_prompt, generate
from woodcock.runtime.policy import FixedPolicy, parse_policy
from woodcock.runtime.sampling import Sampling
from woodcock.runtime.session import open_session
from woodcock.synthetic import random_drafter, tiny_spec


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    root = tmp_path_factory.mktemp("api") / "demo"
    write_demo(root)
    return root


@pytest.fixture(scope="module")
def session(demo):
    return open_session(str(demo / "target"), str(demo / "drafter"))


def run(session, prompt, **overrides):
    arguments = {"max_tokens": 8, "policy": FixedPolicy(2), "sampling": Sampling()} | overrides
    return generate(session, prompt, **arguments)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"max_tokens": 0}, r"max_tokens = 0: expected an integer at least 1"),
        ({"max_tokens": -1}, r"max_tokens = -1: expected"),
        ({"max_tokens": None}, r"max_tokens = None: expected"),
        ({"max_tokens": 1.5}, r"max_tokens = 1.5: expected"),
        ({"max_tokens": True}, r"max_tokens = True: expected"),
        ({"max_tokens": 10**9}, r"max_tokens = 1000000000: 3 prompt tokens \+ 1000000000 exceed"),
        ({"policy": "fixed:2"}, r"policy = 'fixed:2': expected a policy object; parse_policy"),
        ({"policy": None}, r"policy = None: expected a policy object"),
        ({"sampling": None}, r"sampling = None: expected a Sampling"),
        ({"stop": ["", "x"]}, r"stop = \['', 'x'\]: expected non-empty strings"),
        ({"stop": [3]}, r"stop = \[3\]: expected non-empty strings"),
        ({"logprobs": -1}, r"logprobs = -1: expected None or an integer in \[0, 320\]"),
        ({"logprobs": 321}, r"logprobs = 321: expected"),
    ],
)
def test_generate_refuses_bad_arguments_naming_them(session, overrides, message):
    with pytest.raises(DrafterError, match=message):
        run(session, [5, 6, 7], **overrides)


@pytest.mark.parametrize(
    "prompt, message",
    [
        ([], r"prompt_ids: empty; expected at least one token"),
        ([5, 6, 320], r"prompt_ids: token id 320: expected ids in \[0, 320\)"),
        ([5, -1], r"prompt_ids: token id -1: expected"),
        ([5, 10**6], r"prompt_ids: token id 1000000: expected"),  # was an out-of-bounds gather
        ("hello", r"prompt_ids: expected a list of integer token ids \(encode_prompt"),
        ([[5, 6]], r"prompt_ids: expected a list of integer token ids"),
        ([5, 6.0], r"prompt_ids: expected a list of integer token ids"),
        (None, r"prompt_ids: expected a list"),
    ],
)
def test_generate_refuses_prompts_that_are_not_token_ids_of_the_target(session, prompt, message):
    with pytest.raises(DrafterError, match=message):
        run(session, prompt)


def test_prompts_as_arrays_and_a_lone_stop_string_are_taken(session):
    ids = encode_prompt(session.tokenizer, "Paris is", chat=False)
    expected = run(session, ids, max_tokens=24)
    assert run(session, np.array(ids), max_tokens=24).tokens == expected.tokens
    assert run(session, mx.array(ids), max_tokens=24).tokens == expected.tokens
    stop = expected.text[5:7]
    assert len(stop) == 2 and stop not in expected.text[:6]
    one = run(session, ids, max_tokens=24, stop=stop)
    assert one.text == run(session, ids, max_tokens=24, stop=[stop]).text
    assert one.text == expected.text[: expected.text.index(stop)]


@pytest.mark.parametrize("prompt", [None, 5, ["hi"], b"hi"])
def test_encode_prompt_takes_text_only(session, prompt):
    with pytest.raises(DrafterError, match="expected a string"):
        encode_prompt(session.tokenizer, prompt, chat=False)


def block_drafter(block: int, confidence_head: bool):
    algorithm = SimpleNamespace(confidence_head=confidence_head)
    return SimpleNamespace(num_drafts=block, algorithm=algorithm)


def test_parse_policy_refuses_what_no_drafter_could_run(tmp_path):
    chain = SimpleNamespace(num_drafts=None)
    for text in (None, 5, ["fixed:2"]):
        with pytest.raises(DrafterError, match="expected text: fixed:K"):
            parse_policy(text, chain)
    with pytest.raises(DrafterError, match=r"expected fixed:K with K >= 1"):
        parse_policy("fixed:²", chain)  # a digit to str.isdigit, not to int()
    assert parse_policy("fixed:4", block_drafter(4, False)).length == 4
    with pytest.raises(DrafterError, match=r"drafts blocks of 4; expected K <= 4"):
        parse_policy("fixed:5", block_drafter(4, False))
    assert parse_policy("fixed:3", None).length == 3
    with pytest.raises(
        DrafterError, match="--policy auto: chooses draft lengths, and there is no drafter"
    ):
        parse_policy("auto:latency.json", None)
    with pytest.raises(DrafterError, match=r"has no confidence head \(DSpark's\); use auto:x.json"):
        parse_policy("confidence:x.json", block_drafter(8, False))


def test_open_session_takes_a_path_for_the_drafter_and_refuses_none(demo, session):
    by_path = open_session(demo / "target", demo / "drafter")
    ids = encode_prompt(session.tokenizer, "Paris is", chat=False)
    assert run(by_path, ids, max_tokens=16).tokens == run(session, ids, max_tokens=16).tokens
    with pytest.raises(DrafterError, match="drafter = None: expected a directory"):
        open_session(str(demo / "target"), None)


def test_save_drafter_and_random_drafter_refuse_what_is_not_a_drafter(demo, tmp_path):
    with pytest.raises(DrafterError, match="drafter = None: expected a Drafter"):
        save_drafter(None, tmp_path / "out")
    with pytest.raises(DrafterError, match="drafter = '.*': expected a Drafter"):
        save_drafter(str(demo / "drafter"), tmp_path / "out")
    blocker = tmp_path / "a-file"
    blocker.write_text("kept")
    with pytest.raises(DrafterError, match=r"a-file/sub: its folder .*a-file cannot be made \("):
        save_drafter(load_drafter(demo / "drafter"), blocker / "sub")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]
    assert blocker.read_text() == "kept"
    for spec in (None, "eagle3", {"algorithm": "eagle3"}):
        with pytest.raises(DrafterError, match="expected a DrafterSpec"):
            random_drafter(spec)
    with pytest.raises(DrafterError, match="dtype = 'bogus': expected one of"):
        random_drafter(tiny_spec(), dtype="bogus")
    assert Path(demo / "drafter").is_dir()
