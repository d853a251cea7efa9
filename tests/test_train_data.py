"""The distilled answers as training reads them: bad records refused in one line naming the file
and line (token ids outside the target's vocabulary, repeated ids), and `woodcock distill`
refusing, before it writes anything, a prompt it cannot encode or a folder another run writes."""

import json

import numpy as np
import pytest
from helpers import run_cli, write_corpus_prompts

from woodcock.demo import write_tiny_target
from woodcock.errors import DrafterError
from woodcock.train.data import load_samples
from woodcock.train.distill import ANSWERS, META, distill, read_answers

VOCAB = 320  # write_tiny_target's


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return write_tiny_target(tmp_path_factory.mktemp("data") / "target", vocab_size=VOCAB)


def answers_folder(folder, lines):
    """A distill output holding `lines` (records, or raw text) as its answers."""
    folder.mkdir()
    (folder / META).write_text("{}\n")
    text = "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)
    (folder / ANSWERS).write_text(text)
    return folder


def answer(ident, prompt_ids=(1, 2), answer_ids=(3, 4)):
    return {"id": ident, "prompt_ids": list(prompt_ids), "answer_ids": list(answer_ids)}


@pytest.mark.parametrize(
    "record,message",
    [
        (answer("x", answer_ids=[7, 99999]), "answer_ids holds token id 99999"),
        (answer("x", answer_ids=[-3, 5]), "answer_ids holds token id -3"),
        (answer("x", prompt_ids=[VOCAB]), f"prompt_ids holds token id {VOCAB}"),
        (answer("x", prompt_ids=[2**70]), f"prompt_ids holds token id {2**70}"),
    ],
)
def test_token_ids_outside_the_vocabulary_are_refused_naming_the_line(tmp_path, record, message):
    data = answers_folder(tmp_path / "data", [answer("a"), "", record, answer("b")])
    expected = f"answers.jsonl:3: {message}; expected ids in \\[0, {VOCAB}\\)"
    with pytest.raises(DrafterError, match=expected):
        load_samples(data, 64, vocab_size=VOCAB)
    edge = answers_folder(tmp_path / "edge", [answer("a", answer_ids=[0, VOCAB - 1]), answer("b")])
    assert [s.id for s in load_samples(edge, 64, vocab_size=VOCAB)] == ["a", "b"]


def test_train_refuses_an_id_outside_the_vocabulary_with_exit_2(target, tmp_path, capsys):
    # -3 failed in np.bincount as an internal error (99999, which crashed the target's forward
    # with a segfault, would take the test process down with it)
    data = answers_folder(tmp_path / "data", [answer(f"p{i}") for i in range(3)])
    with open(data / ANSWERS, "a") as f:
        f.write(json.dumps(answer("bad", answer_ids=[-3, 5])) + "\n")
    argv = ["train", "--target", str(target), "--data", str(data), "--out", str(tmp_path / "out"),
            "--steps", "1", "--batch", "2", "--head-size", "100", "--max-len", "64"]  # fmt: skip
    code, _, err = run_cli(argv, capsys)
    assert code == 2, err
    assert f"answers.jsonl:4: answer_ids holds token id -3; expected ids in [0, {VOCAB})" in err
    assert not (tmp_path / "out").exists()


def test_a_bad_answer_record_is_named_by_its_line_in_the_file(tmp_path):
    # blank lines count: the line an editor shows, as for every other JSONL file
    lines = [answer("a"), answer("b"), "", "", '{"id": 5, "prompt_ids": [1], "answer_ids": [2]}']
    data = answers_folder(tmp_path / "data", [*lines, answer("c")])
    with pytest.raises(DrafterError, match=r"answers.jsonl:5: not a valid answer record; expected"):
        read_answers(data)
    with pytest.raises(DrafterError, match=r"answers.jsonl:5: not a valid answer record"):
        load_samples(data, 64, vocab_size=VOCAB)


def test_a_repeated_answer_id_is_refused(tmp_path):
    lines = [answer("a"), answer("b"), "", answer("c"), answer("b", answer_ids=[9])]
    data = answers_folder(tmp_path / "data", lines)
    with pytest.raises(
        DrafterError, match=r"answers.jsonl:5: id 'b' occurs twice \(first on line 2\)$"
    ):
        load_samples(data, 64, vocab_size=VOCAB)


def test_distill_refuses_a_second_run_into_a_folder_being_written(target, tmp_path):
    prompts = write_corpus_prompts(tmp_path / "prompts.jsonl", 3)
    out = tmp_path / "answers"
    refusals = []

    def start_another(done, total):
        # called while the first run holds the folder, before it answers anything
        if not refusals:
            with pytest.raises(DrafterError) as refused:
                distill(str(target), prompts, out, max_tokens=4, chat=False)
            refusals.append(str(refused.value))

    report = distill(str(target), prompts, out, max_tokens=4, chat=False, progress=start_another)
    assert refusals == [
        f"{out / ANSWERS}: is being written by another woodcock distill; wait for it to finish"
    ]
    assert report.answered == 3
    assert sorted(row["id"] for row in read_answers(out)) == ["p0", "p1", "p2"]
    # the lock went with the run that held it
    assert distill(str(target), prompts, out, max_tokens=4, chat=False).skipped == 3


def test_distill_refuses_messages_without_the_chat_template_before_writing(target, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    conversation = [{"role": "user", "content": "the cat"}]
    prompts.write_text(
        json.dumps({"id": "a", "prompt": "the cat"})
        + "\n\n"
        + json.dumps({"id": "b", "messages": conversation})
        + "\n"
    )
    out = tmp_path / "answers"
    with pytest.raises(
        DrafterError,
        match=r"prompts.jsonl:3: a prompt given as 'messages' needs the target's chat template,"
        " which --no-chat turns off$",
    ):
        distill(str(target), prompts, out, max_tokens=4, chat=False)
    assert not out.exists()
    # so the corrected command starts afresh
    assert distill(str(target), prompts, out, max_tokens=4).answered == 2


def test_the_holdout_keeps_a_conversation_on_one_side_and_openings_where_they_were():
    import hashlib

    from woodcock.train.data import Sample, holdout_split

    def sample(ident):
        return Sample(ident, np.arange(4, dtype=np.int32), 2)

    openings = [f"c{i}_0" for i in range(400)]
    turns = [f"{opening}#{turn}" for opening in openings[:200] for turn in (2, 4, 6)]
    train, holdout = holdout_split([sample(i) for i in openings + turns], 0.05)
    held = {s.id for s in holdout}
    # an opening lies where sha256 of its id puts it, as before conversations joined the data
    share = {i: int(hashlib.sha256(i.encode()).hexdigest()[:12], 16) / 16**12 for i in openings}
    assert {i for i in openings if share[i] < 0.05} == held & set(openings)
    assert 0 < len(held) < len(openings + turns)
    for ident in turns:
        assert (ident in held) == (ident.partition("#")[0] in held)
    assert {s.id for s in train} | held == set(openings + turns)
    # one conversation alone: its turns are split, one on each side at least
    train, holdout = holdout_split([sample(f"c0_0#{t}") for t in (2, 4, 6)], 0.05)
    assert train and holdout
