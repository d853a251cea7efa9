"""`woodcock train --algorithm dflash|dspark` on the offline tiny target: the training forward is
the runtime block drafter's function, training learns and resumes exactly, and the drafter it
writes loads in every format that can hold it, matches the torch reference and decodes
exactly."""

import dataclasses
import json
import os

import mlx.core as mx
import numpy as np
import pytest
from helpers import distilled_tiny_target, generate_tokens, json_strings
from mlx.utils import tree_unflatten
from mlx_lm import load
from mlx_lm.generate import generate_step

from woodcock.conversion import convert
from woodcock.errors import DrafterError
from woodcock.formats import native
from woodcock.ir import Drafter, VocabMap
from woodcock.loading import load_drafter_with_format
from woodcock.parity import block_parity
from woodcock.runtime.block import BlockDrafter
from woodcock.runtime.decode import Stats
from woodcock.runtime.target import MlxTarget
from woodcock.train import train as T
from woodcock.train.block_model import (
    block_states,
    build_block_model,
    build_block_spec,
    mask_token_id,
    slot_outputs,
)
from woodcock.train.block_trainer import (
    BlockInputs,
    BlockMetrics,
    BlockTrainer,
    anchor_candidates,
    spread_anchors,
    train_anchors,
)
from woodcock.train.checkpoints import trained_weights
from woodcock.train.cli import app
from woodcock.train.data import Batch
from woodcock.train.distill import read_answers
from woodcock.train.distributed import Group
from woodcock.train.features import TargetRunner
from woodcock.train.options import TrainOptions

TAPS = (1, 2, 3)  # not the last target layer: SpecForge and DeepSpec refuse it
STEPS = 100


def run_cli(args):
    app(args, standalone_mode=False)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return distilled_tiny_target(tmp_path_factory.mktemp("train_block"), max_tokens=40)


@pytest.fixture(scope="module")
def trained(work):
    """DSpark, block 4, rank 64 vanilla Markov head, the confidence head, the target's head."""
    out = work / "dspark"
    run_cli(
        [
            "train",
            "--target",
            str(work / "target"),
            "--data",
            str(work / "data"),
            "--out",
            str(out),
            "--algorithm",
            "dspark",
            "--block-size",
            "4",
            "--markov-rank",
            "64",
            "--anchors",
            "8",
            "--taps",
            ",".join(map(str, TAPS)),
            "--steps",
            str(STEPS),
            "--batch",
            "4",
            "--lr",
            "3e-3",
            "--holdout",
            "0.2",
            "--eval-every",
            "30",
            "--checkpoint-every",
            "30",
            "--max-len",
            "96",
        ]
    )
    return out


# -- the training forward is the runtime's function ------------------------------------------


VARIANTS = {
    "dflash": dict(algorithm="dflash"),
    "dspark-vanilla": dict(algorithm="dspark", markov_head="vanilla"),
    "dspark-gated": dict(algorithm="dspark", markov_head="gated"),
    "dspark-rnn": dict(algorithm="dspark", markov_head="rnn"),
    # slot 0 only runs; the rnn state still steps through it
    "dspark-rnn-not-from-anchor": dict(
        algorithm="dspark", markov_head="rnn", sample_from_anchor=False
    ),
    "dspark-no-confidence": dict(algorithm="dspark", confidence_head=False),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_training_forward_is_the_runtime_block_drafter(work, variant):
    """Every slot's logits (Markov bias included, teacher-forced) and confidence of blocks
    anchored anywhere in two padded sequences equal `BlockDrafter.propose` after the context
    x_0..x_{p-1}, with its drafts forced to be the sequence's next tokens. The second layer has
    a sliding window and causal in-block attention, so both masks are exercised."""
    target_dir = str(work / "target")
    runner = TargetRunner(target_dir, TAPS)
    opts = TrainOptions(
        target=target_dir,
        data=work / "data",
        out=work / "unused",
        block_size=5,
        markov_rank=12,
        **VARIANTS[variant],
    )
    spec = build_block_spec(runner, target_dir, TAPS, runner.vocab_size, opts, 0)
    first_layer = spec.layers[0]
    windowed = dataclasses.replace(first_layer, sliding_window=6, attention="block_causal")
    spec = dataclasses.replace(spec, layers=(first_layer, windowed))
    model = build_block_model(
        spec, runner.embedding, runner.head, runner.final_norm_weight(), seed=1
    )
    rng = np.random.default_rng(0)
    weights = {
        k: v + 0.1 * rng.standard_normal(v.shape).astype(np.float32)
        for k, v in trained_weights(model).items()
    }
    model.update(tree_unflatten([(k, mx.array(v)) for k, v in weights.items()]))
    target = MlxTarget(runner.model, TAPS)
    runtime = BlockDrafter(Drafter(spec, VocabMap(), weights), target.shared_tensors())

    rows = read_answers(work / "data")[:2]
    sequences = [np.array(r["prompt_ids"] + r["answer_ids"], np.int32) for r in rows]
    size = spec.algorithm.block_size
    anchors = [[1, 4, len(sequences[0]) - size - 1], [2, len(sequences[1]) - size - 1]]
    width = max(len(x) for x in sequences)
    tokens = np.zeros((2, width), np.int32)
    taps = np.zeros((2, width, len(TAPS) * runner.hidden_size), np.float32)
    for j, x in enumerate(sequences):
        target.reset()
        tokens[j, : len(x)] = x
        taps[j, : len(x)] = np.array(target.forward(mx.array(x))[1])
    p = np.ones((2, 3), np.int32)  # padding blocks at position 1
    for j, a in enumerate(anchors):
        p[j, : len(a)] = a
    shift = 0 if spec.algorithm.sample_from_anchor else 1
    k = np.arange(size)
    block_ids = np.full((2, 3, size), spec.algorithm.mask_token_id, np.int32)
    block_ids[:, :, 0] = np.take_along_axis(tokens, p, 1)
    prev = np.take_along_axis(tokens, (p[..., None] + np.maximum(k - shift, 0)).reshape(2, -1), 1)
    hidden = block_states(model, spec, mx.array(taps), mx.array(p), mx.array(block_ids))
    logits, confidence = slot_outputs(model, spec, hidden, mx.array(prev.reshape(2, 3, size)))
    logits = np.array(logits).reshape(2, 3, size, -1)
    confidence = None if confidence is None else np.array(mx.sigmoid(confidence)).reshape(2, 3, -1)

    drafts = spec.algorithm.num_drafts
    for j, x in enumerate(sequences):
        for a, anchor in enumerate(anchors[j]):
            forced = iter(x[anchor + 1 :].tolist())
            runtime.reset()
            runtime.add_context(mx.array(x[1 : anchor + 1]), mx.array(taps[j, :anchor]))
            _, chain = runtime.propose(drafts, lambda _, it=forced: mx.array(next(it)))
            np.testing.assert_allclose(logits[j, a, shift:], np.array(chain), atol=1e-5)
            if confidence is None:
                assert runtime.last_confidence is None
            else:
                np.testing.assert_allclose(
                    confidence[j, a, shift:], np.array(runtime.last_confidence), atol=1e-5
                )


@pytest.mark.parametrize("terms", ["kl=1", "ce=1", "l1=1", "ce=0.1,l1=0.9", "kl=0.5,l1=2"])
def test_token_loss_terms_are_the_weighted_kl_cross_entropy_and_l1(work, terms):
    """The trainer's token loss on hand-made blocks equals the terms computed here from its
    logits: KL(p || q), -log q(the target's token) and sum |q - p|, each slot weighted."""
    target_dir = str(work / "target")
    runner = TargetRunner(target_dir, TAPS)
    head_ids = np.arange(0, runner.vocab_size, 2)  # a truncated head: every other token
    opts = TrainOptions(
        target=target_dir,
        data=work / "data",
        out=work / "unused",
        algorithm="dspark",
        block_size=3,
        markov_rank=8,
        token_loss=terms,
    )
    opts.check()
    spec = build_block_spec(runner, target_dir, TAPS, head_ids.size, opts, 0)
    model = build_block_model(
        spec, runner.embedding, runner.head[head_ids], runner.final_norm_weight(), seed=1
    )
    trainer = BlockTrainer(model, spec, head_ids, runner.head, opts, Group())
    rng = np.random.default_rng(3)
    s, n_blocks, size, vd = 2, 2, 3, head_ids.size
    rows = np.array([0, 1, 2, 4, 6, 7, 9, 10], np.int32)  # draft slots of some blocks
    target = rng.dirichlet(np.full(vd, 0.3), size=rows.size).astype(np.float32)
    weight = rng.uniform(0.2, 1.0, rows.size).astype(np.float32)
    label = rng.integers(0, vd, rows.size).astype(np.int32)
    inputs = BlockInputs(
        taps=mx.array(rng.standard_normal((s, 6, len(TAPS) * runner.hidden_size)), mx.float32),
        anchors=mx.array([[3, 6], [2, 5]], mx.int32),
        block_ids=mx.array(rng.integers(0, runner.vocab_size, (s, n_blocks, size)), mx.int32),
        prev_ids=mx.array(rng.integers(0, runner.vocab_size, (s, n_blocks, size)), mx.int32),
        rows=mx.array(rows),
        target=mx.array(target),
        neg_entropy=mx.array((target * np.log(target)).sum(-1)),
        weight=mx.array(weight),
        loss_rows=rows.size,
        slot=rows % size,
        block=rows // size,
        target_argmax=head_ids[label],
        label=mx.array(label),
        blocks=s * n_blocks,
        tokens_in=0,
    )
    count = 5.0
    _, (token_loss, *_) = trainer._loss(model, inputs, mx.array(count))
    hidden = block_states(model, spec, inputs.taps, inputs.anchors, inputs.block_ids)
    logits, _ = slot_outputs(model, spec, hidden, inputs.prev_ids, inputs.rows)
    logits = np.array(logits, np.float64)
    log_q = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1))[:, None]
    log_q -= logits.max(-1, keepdims=True)
    parts = {
        "kl": (target * (np.log(target) - log_q)).sum(-1),
        "ce": -log_q[np.arange(rows.size), label],
        "l1": np.abs(np.exp(log_q) - target).sum(-1),
    }
    weights = {name: float(w) for name, w in (t.split("=") for t in terms.split(","))}
    expected = sum(w * (weight * parts[name]).sum() / count for name, w in weights.items())
    assert float(token_loss.item()) == pytest.approx(expected, rel=2e-4)


def test_a_frozen_head_keeps_the_targets_rows(work, tmp_path):
    frozen = T.train(short_block_run(work, tmp_path / "frozen", freeze_head=True, steps=4))
    trained = T.train(short_block_run(work, tmp_path / "trained", steps=4))
    assert frozen.losses[0] == trained.losses[0] and frozen.losses[1:] != trained.losses[1:]
    runner = TargetRunner(str(work / "target"), TAPS)
    for out, same in (("frozen", True), ("trained", False)):
        drafter, _ = load_drafter_with_format(tmp_path / out)
        rows = runner.head[np.asarray(drafter.vocab.draft_to_target)]
        assert np.array_equal(np.asarray(drafter.weights["lm_head.weight"]), rows) is same


def test_anchors_fit_in_the_answer_and_follow_the_seed_and_step():
    assert anchor_candidates(20, 5, 4).tolist() == list(range(5, 16))  # p + 4 <= 19
    assert anchor_candidates(9, 5, 4).tolist() == []
    batch = Batch(
        tokens=np.zeros((3, 40), np.int32),
        final=None,
        argmax=None,
        taps=None,
        lengths=np.array([40, 12, 9]),
        prompt_lengths=np.array([3, 5, 5]),
    )
    drawn = train_anchors(batch, 8, 4, seed=1, step=7)
    assert [len(a) for a in drawn] == [8, 3, 0]
    assert drawn[1].tolist() == [5, 6, 7]
    assert all(np.all(np.diff(a) > 0) and a.min() >= 3 and a.max() <= 35 for a in drawn[:1])
    again = train_anchors(batch, 8, 4, seed=1, step=7)
    assert all(np.array_equal(x, y) for x, y in zip(drawn, again, strict=True))
    other = train_anchors(batch, 8, 4, seed=1, step=8)
    assert not np.array_equal(drawn[0], other[0])
    spread = spread_anchors(batch, 4, 4)
    assert spread[0].tolist() == [3, 11, 19, 27] and spread[1].tolist() == [5, 6, 7]


def test_mask_token_is_one_the_target_has():
    class Tokenizer:
        mask_token_id = None
        pad_token_id = None
        eos_token_id = [7, 8]

    assert mask_token_id(Tokenizer(), 100) == 7
    Tokenizer.pad_token_id = 3
    assert mask_token_id(Tokenizer(), 100) == 3
    Tokenizer.pad_token_id, Tokenizer.eos_token_id = None, None
    with pytest.raises(DrafterError, match="MASK"):
        mask_token_id(Tokenizer(), 100)


# -- the trained drafter ---------------------------------------------------------------------


def test_trained_dspark_learns_and_records_holdout_metrics(work, trained):
    drafter, fmt = load_drafter_with_format(trained)
    spec = drafter.spec
    assert fmt.NAME == "woodcock" and spec.algorithm.name == "dspark"
    algorithm = spec.algorithm
    assert (algorithm.block_size, algorithm.markov_rank, algorithm.markov_head_type) == (
        4,
        64,
        "vanilla",
    )
    assert algorithm.sample_from_anchor and algorithm.confidence_head_with_markov
    assert spec.taps.layer_ids == TAPS and spec.fusion.hidden_norm
    assert [layer.style for layer in spec.layers] == ["qwen3", "qwen3"]
    assert spec.head.lm_head == "shared" and spec.head.embedding == "shared"
    assert spec.draft_vocab_size == spec.target.vocab_size and drafter.vocab.draft_to_target is None
    assert "lm_head.weight" not in drafter.weights and "embed_tokens.weight" not in drafter.weights

    log = [
        json.loads(line) for line in (work / "dspark.ckpt" / "log.jsonl").read_text().splitlines()
    ]
    losses = [e["loss"] for e in log if "loss" in e]
    assert len(losses) == STEPS
    assert np.mean(losses[-10:]) < np.mean(losses[:10]) - 0.1

    provenance = native.read_provenance(trained)
    last, initial = provenance["holdout"], provenance["holdout_initial"]
    assert len(last["accuracy"]) == 4 and last["blocks"] > 10
    assert last["acceptance_length"] > initial["acceptance_length"] + 0.15, (last, initial)
    assert last["expected_acceptance_length"] > initial["expected_acceptance_length"] + 0.3
    assert last["alpha_mean"] > initial["alpha_mean"] + 0.1
    assert last["loss"] < initial["loss"] - 0.1
    # the confidence head has learnt the scale of alpha
    assert abs(last["confidence_mean"] - last["alpha_mean"]) < 0.1
    assert abs(initial["confidence_mean"] - initial["alpha_mean"]) > 0.04
    assert 1.0 <= last["acceptance_length"] <= 5.0
    assert set(provenance["holdout_definition"]) >= {"accuracy", "acceptance_length"}
    # the conditional acceptance by slot is the manifest's agreement, the auto policy's prior
    assert provenance["holdout_agreement"] == last["acceptance_by_slot"]
    assert len(last["acceptance_by_slot"]) == 4
    recipe = provenance["recipe"]
    assert recipe["algorithm"] == "dspark" and recipe["anchors"] == 8
    assert recipe["mask_token_id"] == algorithm.mask_token_id and "ttt_steps" not in recipe
    assert provenance["command"][provenance["command"].index("--algorithm") + 1] == "dspark"
    assert not [text for text in json_strings(provenance) if os.path.isabs(text)]


def test_trained_drafter_converts_and_matches_the_torch_reference(work, trained, tmp_path):
    pytest.importorskip("torch")
    drafter, _ = load_drafter_with_format(trained)
    target = load(str(work / "target"))[0]
    shared = MlxTarget(target, TAPS).shared_tensors()
    report = block_parity(drafter, shared)
    assert report["ok"], report
    for fmt in ("speculators", "specforge-dspark", "deepspec-dspark"):
        convert(str(trained), tmp_path / fmt, to=fmt, target=str(work / "target"))
        again, read_as = load_drafter_with_format(tmp_path / fmt)
        assert read_as.NAME == fmt
        assert dataclasses.replace(again.spec, target=drafter.spec.target) == dataclasses.replace(
            drafter.spec, head=again.spec.head
        )
        for name, array in drafter.weights.items():
            assert np.array_equal(np.asarray(again.weights[name], np.float32), array), (fmt, name)
        assert block_parity(again, shared)["ok"]


def test_trained_drafter_decodes_exactly(work, trained):
    drafter, _ = load_drafter_with_format(trained)
    model, tokenizer = load(str(work / "target"))
    target = MlxTarget(model, drafter.spec.taps.layer_ids)
    runtime = BlockDrafter(drafter, target.shared_tensors())
    stats = Stats()
    for prompt in ([5, 17, 33], read_answers(work / "data")[3]["prompt_ids"]):
        expected = []
        for token, _ in generate_step(mx.array(prompt), model, max_tokens=40):
            if token in tokenizer.eos_token_ids:
                break
            expected.append(token)
        got = generate_tokens(
            prompt,
            target,
            runtime,
            max_tokens=40,
            num_draft=runtime.num_drafts,
            eos_ids=tokenizer.eos_token_ids,
            stats=stats,
        )
        assert got == expected
    assert stats.tokens_per_round > 1.3  # the trained drafter's drafts are accepted


# -- resume, options -------------------------------------------------------------------------


def short_block_run(work, out, **changes) -> TrainOptions:
    """DFlash with its own head truncated to 160 rows: 8 steps, a checkpoint every 3."""
    settings = dict(
        target=str(work / "target"),
        algorithm="dflash",
        block_size=4,
        layers=1,
        anchors=4,
        head_size=160,
        steps=8,
        batch=3,
        lr=2e-3,
        holdout=0.2,
        eval_every=100,
        checkpoint_every=3,
        max_len=64,
        taps=TAPS,
    )
    return TrainOptions(data=work / "data", out=out, **{**settings, **changes})


def test_block_resume_continues_with_the_same_losses(work, tmp_path):
    whole = T.train(short_block_run(work, tmp_path / "whole"))

    class Stop(Exception):
        pass

    def crash_at_5(phase, done, total):
        if phase == "training" and done == 5:
            raise Stop

    with pytest.raises(Stop):
        T.train(short_block_run(work, tmp_path / "cut"), progress=crash_at_5)
    with pytest.raises(DrafterError, match="--resume: the checkpoint .* anchors = 4"):
        T.train(short_block_run(work, tmp_path / "cut", resume=True, anchors=5))
    with pytest.raises(DrafterError, match="--resume: the checkpoint .* token_loss"):
        T.train(short_block_run(work, tmp_path / "cut", resume=True, token_loss="ce=1"))
    with pytest.raises(DrafterError, match="--resume: the checkpoint .* algorithm"):
        T.train(short_block_run(work, tmp_path / "cut", resume=True, algorithm="dspark"))
    resumed = T.train(short_block_run(work, tmp_path / "cut", resume=True))
    assert resumed.resumed_from == 3
    assert resumed.losses == whole.losses[3:]  # bit for bit: same batches, anchors and state
    assert resumed.holdout == whole.holdout
    drafter, _ = load_drafter_with_format(tmp_path / "cut")
    spec = drafter.spec
    assert spec.algorithm.name == "dflash" and not spec.algorithm.sample_from_anchor
    assert spec.head.lm_head == "own" and drafter.vocab.draft_to_target.shape == (160,)
    assert len(native.read_provenance(tmp_path / "cut")["holdout"]["accuracy"]) == 3


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(algorithm="medusa"), "--algorithm 'medusa'"),
        (dict(markov_head="lstm"), "--markov-head 'lstm'"),
        (dict(block_size=1, sample_from_anchor=False), "--block-size 1"),
        (dict(anchors=0), "--anchors 0"),
        (dict(decay_gamma=0.0), "--decay-gamma 0.0"),
        (dict(confidence_weight=-1.0), "--confidence-weight -1.0"),
        (dict(token_loss="kl=1,kl=2"), "--token-loss 'kl=1,kl=2': expected terms"),
        (dict(token_loss="mse=1"), "--token-loss 'mse=1'"),
        (dict(token_loss="ce=-1"), "--token-loss 'ce=-1'"),
        (dict(token_loss="ce=0,l1=0"), "--token-loss 'ce=0,l1=0': expected a term with"),
        (dict(max_len=5), "--max-len 5"),
        (dict(block_size=62, max_len=64), "--block-size 62: no training answer in .* has room"),
    ],
)
def test_block_options_are_checked(work, tmp_path, changes, message):
    with pytest.raises(DrafterError, match=message):
        T.train(short_block_run(work, tmp_path / "x", **{"algorithm": "dspark", **changes}))


def test_cli_reports_block_holdout_metrics(work, tmp_path, capsys):
    capsys.readouterr()
    run_cli(
        [
            "train",
            "--target",
            str(work / "target"),
            "--data",
            str(work / "data"),
            "--out",
            str(tmp_path / "d"),
            "--algorithm",
            "dspark",
            "--block-size",
            "3",
            "--markov-head",
            "gated",
            "--markov-rank",
            "8",
            "--steps",
            "2",
            "--max-len",
            "48",
            "--holdout",
            "0.2",
            "--taps",
            "1,2,3",
        ]
    )
    out = capsys.readouterr().out
    assert f"wrote {tmp_path / 'd'}: 2 steps" in out
    assert "hold-out acceptance length" in out and "mean confidence" in out
    spec = load_drafter_with_format(tmp_path / "d")[0].spec
    assert spec.algorithm.markov_head_type == "gated" and len(spec.layers) == 2


def test_init_starts_from_a_trained_block_drafter(work, trained, tmp_path):
    same = dict(
        algorithm="dspark",
        block_size=4,
        layers=2,
        markov_rank=64,
        anchors=8,
        head_size=None,
        max_len=96,
        steps=1,
        lr=1e-7,
        init=str(trained),
    )
    warm = T.train(short_block_run(work, tmp_path / "warm", **same))
    # its first evaluation is the trained drafter's last one: the same weights, the same blocks
    theirs = native.read_provenance(trained)["holdout"]
    assert {k.removeprefix("holdout_"): v for k, v in warm.holdout_initial.items()} == theirs
    record = native.read_provenance(tmp_path / "warm")["init"]
    assert record["format"] == "woodcock" and "holdout" in record
    with pytest.raises(DrafterError, match=r"--init .*: layers = .*; this run trains"):
        T.train(short_block_run(work, tmp_path / "x", **{**same, "layers": 1}))
    with pytest.raises(DrafterError, match=r"--init .*: algorithm = 'dspark'; this trains"):
        dflash = {k: v for k, v in same.items() if k != "markov_rank"}  # dspark's alone
        T.train(short_block_run(work, tmp_path / "y", **{**dflash, "algorithm": "dflash"}))


def test_block_metrics_count_acceptance_given_the_earlier_slots_were_accepted():
    from types import SimpleNamespace

    # three blocks of three slots: right-right-wrong, wrong-right-right, right-right-right
    correct = np.array([[1, 1, 0], [0, 1, 1], [1, 1, 1]], bool)
    slot = np.tile(np.arange(3), 3)
    block = np.repeat(np.arange(3), 3)
    inputs = SimpleNamespace(slot=slot, block=block, target_argmax=np.zeros(9, np.int64), blocks=3)
    metrics = BlockMetrics(3)
    metrics.add(inputs, np.where(correct.ravel(), 0, 1), np.full(9, 0.5), None, np.zeros(9))
    summary = metrics.summary()
    assert summary["accuracy"] == pytest.approx([2 / 3, 1.0, 2 / 3])
    # slot 1 is reached by the two blocks whose slot 0 was right, slot 2 by the same two
    assert summary["acceptance_by_slot"] == pytest.approx([2 / 3, 1.0, 0.5])
    assert summary["acceptance_length"] == pytest.approx((3 + 1 + 4) / 3)
