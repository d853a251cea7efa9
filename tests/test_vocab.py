"""Vocabulary truncation (FR-Spec / VocabTrim) and expansion through the torch reference, token
counting with a hold-out split (`woodcock vocab count`), and the convert options."""

import dataclasses
import json

import numpy as np
import pytest
import torch

from woodcock.cli import main
from woodcock.converters.vocab import (
    coverage_by_size,
    expand,
    load_counts,
    most_frequent,
    truncate,
)
from woodcock.errors import DrafterError
from woodcock.formats import native, zlab_dflash
from woodcock.ir import Drafter, Head, VocabCounts
from woodcock.loading import load_drafter
from woodcock.reference import TorchDrafter
from woodcock.synthetic import random_drafter, tiny_spec

V, H = 96, 32


@pytest.fixture(autouse=True)
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def run(argv, capsys):
    try:
        main(argv)
        code = 0
    except SystemExit as e:
        code = e.code or 0
    return code, *capsys.readouterr()


TARGET = {
    "embed_tokens.weight": np.random.default_rng(1).standard_normal((V, H), dtype=np.float32),
    "lm_head.weight": np.random.default_rng(2).standard_normal((V, H), dtype=np.float32),
}


def make(spec, seed=0):
    drafter = random_drafter(spec, seed=seed)
    weights = {
        k: a if k.endswith("norm.weight") else a * np.float32(5) for k, a in drafter.weights.items()
    }
    return Drafter(spec, drafter.vocab, weights)


def logits(drafter):
    """Teacher-forced draft logits [rows, Vd] (with the Markov bias for DSpark): no argmax feeds
    back, so drafters with different vocabularies see the same inputs."""
    model = TorchDrafter(drafter, TARGET)
    spec = drafter.spec
    rng = np.random.default_rng(5)
    taps = torch.from_numpy(
        rng.standard_normal((6, len(spec.taps.layer_ids) * H), dtype=np.float32)
    )
    context = model.fuse(taps)
    if not spec.is_block:
        ids = torch.from_numpy(rng.integers(0, V, 6))
        return model.eagle3_forward(ids, context, torch.arange(1, 7), model.new_cache()).logits
    block = torch.from_numpy(rng.integers(0, V, 4))
    out = model.block_forward(context, torch.arange(6), block, torch.arange(6, 10))
    return model.markov_heads(out.hidden, out.logits, torch.from_numpy(rng.integers(0, V, 4)))[0]


def counts(seed=3):
    values = np.random.default_rng(seed).integers(0, 50, V)
    values[[10, 11]] = 1000  # a tie: the lower id goes first
    return VocabCounts(values, {"source": "test"})


SPECS = {
    "eagle3-full-own-head": dataclasses.replace(
        tiny_spec("eagle3"), head=Head(lm_head="own", embedding="shared")
    ),
    "eagle3-reduced": tiny_spec("eagle3", draft_vocab_size=60),
    "dflash-shared-head": tiny_spec("dflash", style="qwen3"),
    "dspark-own-head": dataclasses.replace(
        tiny_spec("dspark", style="qwen3", markov_head_type="gated", draft_vocab_size=70),
        head=Head(lm_head="own", embedding="shared"),
    ),
    "dspark-rnn-full": dataclasses.replace(
        tiny_spec("dspark", style="qwen3", markov_head_type="rnn"),
        head=Head(lm_head="own", embedding="own"),
    ),
}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_truncation_keeps_the_logits_of_the_kept_tokens(name):
    drafter = make(SPECS[name])
    before_ids = drafter.vocab.target_ids(drafter.spec)
    truncated, report = truncate(drafter, 20, counts())
    ids = truncated.vocab.draft_to_target
    assert ids.shape == (20,) and np.all(np.diff(ids) > 0)
    assert set(ids) <= set(before_ids)
    # exactly the 20 most frequent of the drafter's tokens, ties to the lower id
    c = counts().counts
    ranked = sorted(before_ids, key=lambda t: (-c[t], t))[:20]
    assert list(ids) == sorted(ranked)
    assert truncated.vocab.counts is not None and truncated.spec.draft_vocab_size == 20
    rows = np.searchsorted(before_ids, ids)
    assert torch.equal(logits(truncated), logits(drafter)[:, rows])
    assert report["kept"] == 20 and report["draft_vocab_before"] == len(before_ids)
    assert report["train_coverage"] == pytest.approx(c[ids].sum() / c.sum())
    assert report["holdout_coverage"] is None
    if truncated.spec.head.lm_head == "shared":
        assert "lm_head.weight" not in truncated.weights  # read through the map, not copied


def test_truncation_reports_holdout_coverage_and_breaks_ties_by_id():
    drafter = make(SPECS["eagle3-full-own-head"])
    holdout = np.zeros(V, np.int64)
    holdout[[10, 11, 12]] = [3, 1, 4]
    truncated, report = truncate(drafter, 1, counts(), holdout)
    assert list(truncated.vocab.draft_to_target) == [10]  # 10 and 11 tie at 1000
    assert report["holdout_coverage"] == pytest.approx(3 / 8)


@pytest.mark.parametrize(
    "size, counts_value, message",
    [
        (0, counts(), "expected at least 1 token"),
        (97, counts(), "the drafter has only 96 draft tokens"),
        (5, VocabCounts(np.ones(10, np.int64)), "token counts cover 10 ids"),
        (5, None, "carries no token counts; pass --counts"),
    ],
)
def test_truncation_refusals(size, counts_value, message):
    with pytest.raises(DrafterError, match=message):
        truncate(make(SPECS["eagle3-full-own-head"]), size, counts_value)


def test_truncating_to_the_full_size_only_attaches_the_counts():
    drafter = make(SPECS["eagle3-reduced"])
    same, _ = truncate(drafter, 60, counts())
    assert same.vocab.counts is not None
    assert np.array_equal(same.vocab.draft_to_target, drafter.vocab.draft_to_target)


@pytest.mark.parametrize("name", ["eagle3-reduced", "dspark-own-head"])
def test_expansion_zero_rows_score_exactly_zero(name):
    drafter = make(SPECS[name])
    ids = np.array(drafter.vocab.draft_to_target)
    full = expand(drafter)
    assert full.vocab.draft_to_target is None and full.spec.draft_vocab_size == V
    before, after = logits(drafter), logits(full)
    assert torch.equal(after[:, ids], before)
    missing = np.setdiff1d(np.arange(V), ids)
    assert torch.all(after[:, missing] == 0)
    assert not np.any(np.asarray(full.weights["lm_head.weight"])[missing])


def test_expanding_a_shared_head_drops_the_map():
    spec = tiny_spec("dflash", style="qwen3", draft_vocab_size=40)
    spec = dataclasses.replace(spec, head=Head(lm_head="shared", embedding="shared"))
    drafter = make(spec)
    full = expand(drafter)
    assert full.spec.head.lm_head == "shared" and "lm_head.weight" not in full.weights
    assert torch.equal(logits(full)[:, np.array(drafter.vocab.draft_to_target)], logits(drafter))
    with pytest.raises(DrafterError, match="already the target's"):
        expand(full)


def test_coverage_helpers():
    train = np.array([5, 0, 3, 3, 1])
    holdout = np.array([1, 1, 0, 2, 0])
    assert list(most_frequent(train, np.arange(5), 3)) == [0, 2, 3]
    assert coverage_by_size(train, holdout, [1, 3]) == {"1": 0.25, "3": 0.75}
    assert coverage_by_size(train, np.zeros(5, np.int64), [1]) == {"1": None}


# ---------------------------------------------------------------------------------------------
# woodcock vocab count

CORPUS = [
    "The quick brown fox jumps over the lazy dog.\n" * 3,
    "Speculative decoding drafts a few tokens and the target verifies them.\n",
    "A drafter reads the hidden states of the target model.\nSmall models run fast.\n",
]
PAD = 7  # the config's vocab_size exceeds the tokenizer's length, as Qwen3's does


@pytest.fixture
def target_dir(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = tmp_path / "target"
    path.mkdir()
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"})
    )
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "num_hidden_layers": 4,
        "hidden_size": H,
        "vocab_size": tokenizer.get_vocab_size() + PAD,
    }
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture
def corpus_dir(tmp_path):
    path = tmp_path / "corpus"
    (path / "sub").mkdir(parents=True)
    for i, text in enumerate(CORPUS):
        (path / ("sub" if i else ".") / f"doc{i}.txt").write_text(text)
    (path / "ignored.md").write_text("not counted")
    return path


def direct_counts(target_dir, texts, vocab):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    ids = [i for text in texts for i in tokenizer.encode(text, add_special_tokens=False).ids]
    return np.bincount(ids, minlength=vocab)


def test_vocab_count_text_directory(target_dir, corpus_dir, tmp_path, capsys):
    out = tmp_path / "counts"
    argv = ["vocab", "count", str(corpus_dir), "--target", str(target_dir), "--out", str(out)]
    code, stdout, err = run([*argv, "--holdout", "0.5", "--seed", "1"], capsys)
    assert code == 0, err
    loaded = load_counts(out)
    vocab = json.loads((target_dir / "config.json").read_text())["vocab_size"]
    total = loaded.counts.counts + loaded.holdout
    assert total.shape == (vocab,)
    assert np.array_equal(total, direct_counts(target_dir, CORPUS, vocab))
    info = loaded.counts.info
    assert info["vocab_size"] == vocab and isinstance(info["tokenizer"], str)
    assert info["segments"]["train"] + info["segments"]["holdout"] == 3
    assert info["tokens"]["train"] == int(loaded.counts.counts.sum())
    coverage = [c for c in info["holdout_coverage"].values() if c is not None]
    assert coverage and all(0 <= c <= 1 for c in coverage) and coverage == sorted(coverage)
    assert "hold-out coverage by head size" in stdout
    # reproducible, and never silently replaced
    code, _, err = run([*argv, "--holdout", "0.5", "--seed", "1"], capsys)
    assert code == 2 and "already holds vocab_counts.npz; pass --force" in err
    first = (out / "vocab_counts.npz").read_bytes()
    assert run([*argv, "--holdout", "0.5", "--seed", "1", "--force"], capsys)[0] == 0
    assert (out / "vocab_counts.npz").read_bytes() == first


@pytest.mark.parametrize("character", ["a", "\u20ac"])  # 1 and 3 bytes in UTF-8
def test_text_segments_are_cut_at_64_kib_of_utf8(tmp_path, character):
    from woodcock.vocab_count import SEGMENT_BYTES, _text_segments

    line = character * (99 // len(character.encode())) + "\n"  # 100 bytes
    text = line * 2000
    (tmp_path / "t.txt").write_text(text, encoding="utf-8")
    segments = list(_text_segments(tmp_path / "t.txt"))
    assert "".join(segments) == text
    assert len(segments) == 4
    assert all(len(s.encode()) <= SEGMENT_BYTES for s in segments)


def test_vocab_count_jsonl_of_token_ids(target_dir, tmp_path, capsys):
    rng = np.random.default_rng(0)
    lines = [rng.integers(0, 50, rng.integers(1, 30)).tolist() for _ in range(40)]
    corpus = tmp_path / "ids.jsonl"
    corpus.write_text(
        "\n".join(json.dumps(x if i % 2 else {"input_ids": x}) for i, x in enumerate(lines))
        + "\n\n"
    )
    out = tmp_path / "c"
    argv = ["vocab", "count", str(corpus), "--target", str(target_dir), "--out", str(out)]
    code, _, err = run([*argv, "--holdout", "0"], capsys)
    assert code == 0, err
    loaded = load_counts(out / "vocab_counts.npz")
    vocab = loaded.counts.counts.shape[0]
    assert np.array_equal(loaded.counts.counts, np.bincount(np.concatenate(lines), minlength=vocab))
    assert not loaded.holdout.any()
    assert set(loaded.counts.info["holdout_coverage"].values()) == {None}
    for bad in (vocab, -1, 2**64):  # 2**64: past any int64, named like the others
        corpus.write_text(json.dumps([1, 2, bad]) + "\n")
        code, _, err = run([*argv, "--force"], capsys)
        assert code == 2 and f"ids.jsonl:1: token id {bad} is outside the target vocabulary" in err
    for record, message in [
        ({"token_ids": "1 2 3"}, "ids.jsonl:1: token_ids must be a list of token ids, found str"),
        ({"text": [1, 2]}, "ids.jsonl:1: text must be a string, found list"),
        (3, "ids.jsonl:1: expected a list of token ids or a text"),
    ]:
        corpus.write_text(json.dumps(record) + "\n")
        code, _, err = run([*argv, "--force"], capsys)
        assert code == 2 and err.strip().endswith(message), err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--holdout", "1.5"], "expected a fraction in [0, 1)"),
        (["--glob", "*.rst"], "no files match --glob '*.rst'"),
        (["--seed", "-1"], "--seed -1: expected 0 or more"),
    ],
)
def test_vocab_count_refusals(target_dir, corpus_dir, tmp_path, capsys, extra, message):
    argv = ["vocab", "count", str(corpus_dir), "--target", str(target_dir)]
    code, _, err = run([*argv, "--out", str(tmp_path / "o"), *extra], capsys)
    assert code == 2 and message in err and err.count("\n") == 1


def test_vocab_count_takes_the_default_target(
    target_dir, corpus_dir, tmp_path, capsys, monkeypatch
):
    """No --target, or the default target's name, as every other command takes it."""
    import woodcock.default_target

    monkeypatch.setattr(woodcock.default_target, "default_target_path", lambda: target_dir)
    named = ["--target", woodcock.default_target.DEFAULT_TARGET]
    for out, extra in [("default", []), ("named", named), ("path", ["--target", str(target_dir)])]:
        argv = ["vocab", "count", str(corpus_dir), "--out", str(tmp_path / out), *extra]
        code, _, err = run(argv, capsys)
        assert code == 0, err
    expected = load_counts(tmp_path / "path").counts.counts
    for out in ("default", "named"):
        assert np.array_equal(load_counts(tmp_path / out).counts.counts, expected)


# ---------------------------------------------------------------------------------------------
# woodcock convert --truncate-vocab / --counts / --expand-vocab


def counts_file(path, train, holdout=None):
    path.mkdir()
    arrays = {"counts": train}
    if holdout is not None:
        arrays["holdout_counts"] = holdout
    np.savez(path / "vocab_counts.npz", **arrays)
    (path / "vocab_counts.json").write_text(json.dumps({"source": "test corpus"}))
    return path / "vocab_counts.npz"


def test_convert_truncates_with_a_counts_file(tmp_path, capsys):
    source = tmp_path / "src"
    drafter = make(SPECS["eagle3-full-own-head"])
    native.write(drafter, source)
    train = counts().counts
    holdout = np.random.default_rng(9).integers(0, 5, V)
    file = counts_file(tmp_path / "counts", train, holdout)
    out = tmp_path / "out"
    argv = ["convert", str(source), str(out), "--to", "woodcock", "--counts", str(file)]
    code, stdout, err = run([*argv, "--truncate-vocab", "32", "--dry-run"], capsys)
    assert code == 0, err
    assert not out.exists()
    assert "lm_head.weight (vocabulary rows)" in stdout and "32 of 96 target ids (mapped)" in stdout
    code, stdout, err = run([*argv, "--truncate-vocab", "32"], capsys)
    assert code == 0, err
    result = load_drafter(out)
    assert result.spec.draft_vocab_size == 32
    kept = result.vocab.draft_to_target
    assert np.array_equal(result.vocab.counts.counts, train)
    assert result.vocab.counts.info == {"source": "test corpus"}
    expected = 100 * holdout[kept].sum() / holdout.sum()
    assert f"hold-out coverage {expected:.2f}%" in stdout
    # the stored counts truncate again without a counts file
    again = tmp_path / "again"
    code, stdout, err = run(
        ["convert", str(out), str(again), "--to", "woodcock", "--truncate-vocab", "8"], capsys
    )
    assert code == 0, err
    assert "hold-out coverage unknown" in stdout
    assert load_drafter(again).spec.draft_vocab_size == 8


def test_convert_expands_into_a_format_without_a_map(tmp_path, capsys):
    spec = tiny_spec("dflash", style="qwen3", draft_vocab_size=40)
    spec = dataclasses.replace(spec, head=Head(lm_head="shared", embedding="shared"))
    source = tmp_path / "src"
    native.write(make(spec), source)
    out = tmp_path / "zlab"
    code, _, err = run(["convert", str(source), str(out), "--to", "zlab-dflash"], capsys)
    assert code == 2 and "no draft-to-target map (--expand-vocab drops the map)" in err
    code, stdout, err = run(
        ["convert", str(source), str(out), "--to", "zlab-dflash", "--expand-vocab"], capsys
    )
    assert code == 0, err
    assert "expanded 40 draft tokens to the full 96" in stdout
    assert zlab_dflash.read(out).spec.draft_vocab_size == V
    code, _, err = run(
        [
            "convert",
            str(source),
            str(tmp_path / "x"),
            "--to",
            "woodcock",
            "--expand-vocab",
            "--truncate-vocab",
            "4",
        ],
        capsys,
    )
    assert code == 2 and "exclude each other" in err


def test_convert_records_counts_alone(tmp_path, capsys):
    source = tmp_path / "src"
    native.write(make(SPECS["eagle3-reduced"]), source)
    file = counts_file(tmp_path / "counts", counts().counts)
    out = tmp_path / "out"
    code, stdout, err = run(
        [
            "convert",
            str(source),
            str(out),
            "--to",
            "woodcock",
            "--counts",
            str(tmp_path / "counts"),
        ],
        capsys,
    )
    assert code == 0, err
    assert f"token counts from {file}" in stdout
    assert (out / "vocab_counts.npz").is_file()
    code, _, err = run(
        [
            "convert",
            str(source),
            str(tmp_path / "o2"),
            "--to",
            "woodcock",
            "--counts",
            str(tmp_path / "nope.npz"),
        ],
        capsys,
    )
    assert code == 2 and "no such counts file" in err
