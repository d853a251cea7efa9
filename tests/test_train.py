"""`woodcock distill` and `woodcock train` on the offline tiny target: answers equal plain greedy
decoding and resume, the training forward is the runtime drafter's function, training learns,
resumes exactly, and writes a drafter that loads and decodes exactly."""

import dataclasses
import json
import os
import shutil

import mlx.core as mx
import numpy as np
import pytest
from helpers import (
    distilled_tiny_target,
    generate_tokens,
    json_strings,
    plain_greedy,
    write_corpus_prompts,
)
from mlx.utils import tree_unflatten
from mlx_lm import load

from woodcock.errors import DrafterError
from woodcock.formats import native
from woodcock.loading import load_drafter
from woodcock.provenance import content_sha256
from woodcock.runtime.decode import Stats
from woodcock.runtime.eagle3 import Eagle3Drafter
from woodcock.runtime.target import MlxTarget
from woodcock.tensorfile import read_safetensors
from woodcock.train import train as T
from woodcock.train.checkpoints import trained_weights
from woodcock.train.cli import app
from woodcock.train.distill import ANSWERS, distill, read_answers, read_prompts
from woodcock.train.eagle3_model import build_model, build_spec, ttt_logits
from woodcock.train.features import TargetRunner, from_fp16, to_fp16
from woodcock.train.options import TrainOptions
from woodcock.train.target_shape import default_taps

MAX_TOKENS = 40
STEPS = 60
HEAD = 160


def run_cli(args):
    app(args, standalone_mode=False)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return distilled_tiny_target(tmp_path_factory.mktemp("train"), max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def trained(work):
    out = work / "drafter"
    run_cli(
        [
            "train",
            "--target",
            str(work / "target"),
            "--data",
            str(work / "data"),
            "--out",
            str(out),
            "--steps",
            str(STEPS),
            "--ttt-steps",
            "3",
            "--head-size",
            str(HEAD),
            "--batch",
            "4",
            "--lr",
            "2e-3",
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


def test_distill_answers_are_greedy_decoding_and_resume(work, tmp_path):
    rows = read_answers(work / "data")
    assert len(rows) == 30 and len({r["id"] for r in rows}) == 30
    model, tokenizer = load(str(work / "target"))
    assert json.loads((work / "data" / "distill.json").read_text())["generators"] == [
        "woodcock.runtime.greedy_batch"
    ]
    for row in rows:
        answer = row["answer_ids"]
        assert 1 <= len(answer) <= MAX_TOKENS
        assert answer == plain_greedy(model, row["prompt_ids"], MAX_TOKENS)[: len(answer)]
        assert row["finish_reason"] in ("stop", "length")

    # a re-run over a longer prompt list answers only the new prompts; a torn last line (an
    # interrupted run) is dropped and answered again
    data = tmp_path / "data"
    data.mkdir()
    lines = (work / "data" / ANSWERS).read_text().splitlines()
    (data / ANSWERS).write_text("\n".join(lines[:10]) + "\n" + lines[10][:25])
    # answers an older version made name its generator alone; a resumed run adds its own
    meta = json.loads((work / "data" / "distill.json").read_text())
    del meta["generators"]
    (data / "distill.json").write_text(json.dumps({**meta, "generator": "older"}))
    prompts = write_corpus_prompts(tmp_path / "more.jsonl", 33)
    report = distill(
        str(work / "target"), prompts, data, max_tokens=MAX_TOKENS, batch=8, chat=False
    )
    assert (report.skipped, report.answered) == (10, 23)
    generators = json.loads((data / "distill.json").read_text())["generators"]
    assert generators == ["older", "woodcock.runtime.greedy_batch"]
    again = read_answers(data)
    assert sorted(r["id"] for r in again) == sorted(f"p{i}" for i in range(33))
    by_id = {r["id"]: r for r in rows}
    assert all(r["answer_ids"] == by_id[r["id"]]["answer_ids"] for r in again if r["id"] in by_id)
    report = distill(
        str(work / "target"), prompts, data, max_tokens=MAX_TOKENS, batch=8, chat=False
    )
    assert (report.skipped, report.answered) == (33, 0)
    with pytest.raises(DrafterError, match="max_tokens"):
        distill(str(work / "target"), prompts, data, max_tokens=8, chat=False)
    # the same target under another folder name is the same target; answers whose record is
    # lost are not adopted
    renamed = shutil.copytree(work / "target", tmp_path / "renamed-target")
    report = distill(str(renamed), prompts, data, max_tokens=MAX_TOKENS, batch=8, chat=False)
    assert (report.skipped, report.answered) == (33, 0)
    (data / "distill.json").unlink()
    with pytest.raises(DrafterError, match=r"distill.json: missing, while .* holds answers"):
        distill(str(renamed), prompts, data, max_tokens=MAX_TOKENS, batch=8, chat=False)


def test_distill_answers_a_conversation_through_the_chat_template(work, tmp_path):
    from woodcock.runtime.generate import encode_messages

    conversation = [
        {"role": "user", "content": "The quick brown"},
        {"role": "assistant", "content": "fox jumps"},
        {"role": "user", "content": "over the"},
    ]
    prompts = tmp_path / "conversations.jsonl"
    prompts.write_text(
        json.dumps({"id": "c1", "messages": conversation})
        + "\n"
        + json.dumps({"id": "p1", "prompt": "over the"})
        + "\n"
    )
    assert read_prompts(prompts)[0] == ("c1", conversation)
    out = tmp_path / "answers"
    report = distill(str(work / "target"), prompts, out, max_tokens=MAX_TOKENS, system="Be brief.")
    assert report.answered == 2
    model, tokenizer = load(str(work / "target"))
    rows = {r["id"]: r for r in read_answers(out)}
    expected = encode_messages(
        tokenizer, [{"role": "system", "content": "Be brief."}, *conversation]
    )
    assert rows["c1"]["prompt_ids"] == expected
    assert (
        rows["c1"]["answer_ids"]
        == plain_greedy(model, expected, MAX_TOKENS)[: len(rows["c1"]["answer_ids"])]
    )
    with pytest.raises(DrafterError, match="needs the target's chat template"):
        distill(
            str(work / "target"), prompts, tmp_path / "plain", max_tokens=MAX_TOKENS, chat=False
        )


@pytest.mark.parametrize(
    "messages,message",
    [
        (
            [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
            "odd number of turns",
        ),
        ("hello", "odd number of turns"),
        ([{"role": "assistant", "content": "a"}], r"messages\[0\]: expected \{'role': 'user'"),
        (
            [
                {"role": "user", "content": "a"},
                {"role": "user", "content": "b"},
                {"role": "user", "content": "c"},
            ],
            r"messages\[1\]: expected \{'role': 'assistant'",
        ),
        ([{"role": "user", "content": ""}], r"messages\[0\]"),
    ],
)
def test_bad_conversation_prompts_are_refused_naming_the_turn(tmp_path, messages, message):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"id": "c", "messages": messages}) + "\n")
    with pytest.raises(DrafterError, match=f"prompts.jsonl:1: .*{message}"):
        read_prompts(path)


def test_an_empty_prompt_is_refused_naming_its_line(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": ""}\n')
    with pytest.raises(DrafterError, match="prompts.jsonl:2: expected an object with a non-empty"):
        read_prompts(path)


def test_prompts_may_hold_unicode_line_separators(tmp_path):
    # json.dumps(ensure_ascii=False) writes U+2028 and U+0085 raw; str.splitlines() would cut
    # the record there (real ShareGPT prompts contain them)
    texts = ["one\u2028two", "three\x85four\x1cfive", "six"]
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        "".join(
            json.dumps({"id": f"q{i}", "prompt": t}, ensure_ascii=False) + "\r\n"
            for i, t in enumerate(texts)
        ),
        encoding="utf-8",
    )
    assert read_prompts(path) == [(f"q{i}", t) for i, t in enumerate(texts)]


def test_feature_cache_is_the_targets_taps_and_argmax(work, trained):
    (cache_dir,) = (work / "data").glob("features-*")
    index = [json.loads(line) for line in (cache_dir / "index.jsonl").read_text().splitlines()]
    assert len(index) == 30
    spec = load_drafter(trained).spec
    width = len(spec.taps.layer_ids) * spec.target.hidden_size
    rows = sum(e["length"] for e in index)
    taps = np.fromfile(cache_dir / "taps.bin", np.float16).reshape(rows, width)
    taps = np.array(
        from_fp16(taps, np.fromfile(cache_dir / "taps_exp.bin", np.int8).reshape(rows, -1))
    )
    final = np.fromfile(cache_dir / "final.bin", np.float16).reshape(rows, -1)
    final = np.array(
        from_fp16(final, np.fromfile(cache_dir / "final_exp.bin", np.int8).reshape(rows, 1))
    )
    argmax = np.fromfile(cache_dir / "argmax.bin", np.int32)
    model, _ = load(str(work / "target"))
    target = MlxTarget(model, spec.taps.layer_ids)
    head = target.shared_tensors()["lm_head.weight"]
    for e in index[:3]:
        s, n = e["start"], e["length"]
        tokens = np.fromfile(cache_dir / "tokens.bin", np.int32)[s : s + n]
        target.reset()
        logits, expected = target.forward(mx.array(tokens))
        np.testing.assert_allclose(taps[s : s + n], np.array(expected), rtol=2e-3, atol=2e-3)
        assert (argmax[s : s + n] == np.array(mx.argmax(logits, axis=-1))).mean() > 0.95
        np.testing.assert_allclose(
            final[s : s + n].astype(np.float32) @ head.T, np.array(logits), atol=0.02
        )


def test_fp16_storage_keeps_massive_activations():
    x = np.array([[3.0, -1e-3, 0.5, 2.0], [70000.0, -1.0, 1e5, 3e-3]], np.float32)
    packed, exponent = to_fp16(mx.array(x), 2)
    assert np.array(exponent).tolist() == [[0, 0], [2, 2]]
    unpacked = from_fp16(np.array(packed), np.array(exponent))
    assert unpacked.dtype == mx.float32
    np.testing.assert_allclose(np.array(unpacked), x, rtol=1e-3, atol=1e-6)
    # a power of two times an fp16 value: exactly the float32 the host would compute
    host = (
        np.array(packed).astype(np.float32).reshape(2, 2, 2)
        * np.exp2(np.array(exponent))[..., None]
    )
    assert np.array_equal(np.array(unpacked), host.reshape(2, 4))


def test_ttt_forward_is_the_runtime_chain_with_teacher_forcing(work):
    """Training row P-1 at TTT step k gives the logits the runtime drafter gives at draft step
    k+1 after context x_1..x_P, when its drafts are forced to be x_{P+1}, x_{P+2}, ..."""
    model, _ = load(str(work / "target"))
    runner = TargetRunner(str(work / "target"), (1, 2, 4))
    vocab = runner.vocab_size
    spec = build_spec(runner, str(work / "target"), (1, 2, 4), vocab, 3)
    train_model = build_model(spec, runner.embedding, runner.head, runner.final_norm_weight(), 3)
    weights = trained_weights(train_model)
    rng = np.random.default_rng(0)
    weights = {
        k: v + 0.05 * rng.standard_normal(v.shape).astype(np.float32) for k, v in weights.items()
    }
    train_model.update(tree_unflatten([(k, mx.array(v)) for k, v in weights.items()]))
    from woodcock.ir import Drafter, VocabMap

    drafter = Drafter(spec, VocabMap(), weights)
    target = MlxTarget(model, spec.taps.layer_ids)
    runtime = Eagle3Drafter(drafter, target.shared_tensors())
    row = read_answers(work / "data")[0]
    x = np.array(row["prompt_ids"] + row["answer_ids"], np.int32)
    _, taps = target.forward(mx.array(x))
    steps, length = 3, len(x)
    tokens = np.concatenate([x, np.zeros(steps, np.int32)])
    logits = ttt_logits(
        train_model, mx.array(tokens[None, 1 : length - 1 + steps]), taps[None, : length - 1], steps
    )
    for p in (2, 9, length - steps - 1):
        forced = iter(x[p + 1 : p + steps].tolist())
        runtime.reset()
        runtime.add_context(mx.array(x[1 : p + 1]), taps[:p])
        _, chain = runtime.propose(steps, lambda _, it=forced: mx.array(next(it, 0)))
        for k in range(steps):
            np.testing.assert_allclose(np.array(logits[k][0, p - 1]), np.array(chain[k]), atol=2e-5)


def test_trained_drafter_loads_learns_and_decodes_exactly(work, trained):
    drafter = load_drafter(trained)
    spec = drafter.spec
    assert spec.algorithm.name == "eagle3" and spec.algorithm.norm_output
    assert spec.algorithm.norm_before_residual and spec.fusion.tap_norm == "per_tap"
    assert spec.taps.layer_ids == (1, 2, 4)  # 2, N//2, N-3 collide for a 4-layer target
    assert spec.head.lm_head == "own" and spec.head.embedding == "shared"
    assert spec.draft_vocab_size == HEAD and drafter.vocab.draft_to_target.shape == (HEAD,)
    counts = drafter.vocab.counts
    assert counts is not None and counts.counts.sum() == counts.info["tokens"] > 0
    assert 0.5 < counts.info["holdout_coverage"][str(HEAD)] <= 1.0
    # the head keeps the most frequent training tokens
    kept = counts.counts[drafter.vocab.draft_to_target]
    assert kept.min() >= np.delete(counts.counts, drafter.vocab.draft_to_target).max()

    provenance = native.read_provenance(trained)
    agreement, initial = provenance["holdout_agreement"], provenance["holdout_agreement_initial"]
    assert len(agreement) == 3 and len(provenance["holdout_agreement_unconditional"]) == 3
    assert agreement[0] > initial[0] + 0.2, (agreement, initial)
    command = provenance["command"]
    assert command[:2] == ["woodcock", "train"] and "--target" in command
    assert command[command.index("--steps") + 1] == str(STEPS) and "--lr" in command
    assert provenance["recipe"]["head_size"] == HEAD and provenance["recipe"]["ttt_steps"] == 3
    assert provenance["data"]["holdout_samples"] >= 1
    assert not [text for text in json_strings(provenance) if os.path.isabs(text)]
    assert provenance["data"]["dir"] == os.path.relpath(work / "data", trained)

    log = [
        json.loads(line)
        for line in (trained.parent / "drafter.ckpt" / "log.jsonl").read_text().splitlines()
    ]
    losses = [e["loss"] for e in log if "loss" in e]
    assert len(losses) == STEPS
    assert np.mean(losses[-10:]) < np.mean(losses[:10]) - 0.05

    model, tokenizer = load(str(work / "target"))
    target = MlxTarget(model, spec.taps.layer_ids)
    runtime = Eagle3Drafter(drafter, target.shared_tensors())
    stats = Stats()
    for prompt in ([5, 17, 33], read_answers(work / "data")[3]["prompt_ids"]):
        expected = plain_greedy(model, prompt, 48, tokenizer.eos_token_ids)
        got = generate_tokens(
            prompt,
            target,
            runtime,
            max_tokens=48,
            num_draft=3,
            eos_ids=tokenizer.eos_token_ids,
            stats=stats,
        )
        assert got == expected
    assert stats.tokens_per_round > 1.3  # the trained drafter's drafts are accepted


def short_run(work, out, **changes) -> TrainOptions:
    """10 steps, a checkpoint every 4."""
    settings = dict(
        steps=10,
        ttt_steps=2,
        head_size=HEAD,
        batch=3,
        lr=2e-3,
        holdout=0.2,
        eval_every=100,
        checkpoint_every=4,
        max_len=64,
    )
    settings = {"target": str(work / "target"), **settings, **changes}
    return TrainOptions(data=work / "data", out=out, **settings)


def test_resume_continues_with_the_same_losses(work, tmp_path, monkeypatch):
    def options(name, **kw):
        return short_run(work, tmp_path / name, **kw)

    whole = T.train(options("whole"))

    class Stop(Exception):
        pass

    def crash_at_6(phase, done, total):
        if phase == "training" and done == 6:
            raise Stop

    with pytest.raises(Stop):
        T.train(options("cut"), progress=crash_at_6)
    with pytest.raises(DrafterError, match="--resume"):
        T.train(options("cut"))
    with pytest.raises(DrafterError, match="steps"):
        T.train(options("cut", resume=True, steps=11))
    with pytest.raises(DrafterError, match="with algorithm = 'eagle3', this run asks for 'dspark'"):
        T.train(options("cut", resume=True, algorithm="dspark", head_size=None, ttt_steps=3))
    # moved: the answers and the checkpoints copied elsewhere, the target in a folder of another
    # name, named by a relative path, the default taps given explicitly: still the same run
    moved = tmp_path / "moved"
    shutil.copytree(work / "data", moved / "data")
    shutil.copytree(tmp_path / "cut.ckpt", moved / "cut.ckpt")
    shutil.copytree(work / "target", moved / "renamed-target")
    monkeypatch.chdir(moved)
    taps = default_taps(json.loads((work / "target" / "config.json").read_text())["num_hidden_layers"])
    resumed = T.train(
        dataclasses.replace(
            options("cut", resume=True), data=moved / "data", out=moved / "cut", target="renamed-target", taps=taps
        )
    )
    assert resumed.resumed_from == 4
    assert resumed.losses == whole.losses[4:]  # bit for bit: same batches, same state
    log = [
        json.loads(line) for line in (moved / "cut.ckpt" / "log.jsonl").read_text().splitlines()
    ]
    assert [e["step"] for e in log] == list(range(11))
    assert resumed.holdout_agreement == whole.holdout_agreement


def test_a_damaged_checkpoint_is_refused_naming_the_file(work, tmp_path):
    """What a full disk or a partial copy leaves: a resume ends with exit 2's one line, never an
    internal error."""

    def stop_at_6(phase, done, total):
        if phase == "training" and done == 6:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        T.train(short_run(work, tmp_path / "cut"), progress=stop_at_6)
    good = tmp_path / "cut.ckpt"
    step = good / "step-0000004"

    def damaged(name, damage, message):
        copy = tmp_path / name
        shutil.copytree(good, copy / "cut.ckpt")
        damage(copy / "cut.ckpt", copy / "cut.ckpt" / step.name)
        with pytest.raises(DrafterError, match=message) as info:
            T.train(short_run(work, copy / "cut", resume=True, finish=True))
        assert "\n" not in str(info.value)

    def edit_json(path, change):
        record = json.loads(path.read_text())
        change(record)
        path.write_text(json.dumps(record))

    def truncate(path):
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])

    damaged(
        "half-model",
        lambda ckpt, folder: truncate(folder / "model.safetensors"),
        r"step-0000004/model.safetensors: not a readable checkpoint file \(",
    )
    damaged(
        "no-optimizer",
        lambda ckpt, folder: (folder / "optimizer.safetensors").unlink(),
        r"step-0000004/optimizer.safetensors: not a readable checkpoint file",
    )
    damaged(
        "latest-folder",
        lambda ckpt, folder: edit_json(ckpt / "latest.json", lambda r: r.update(folder=5)),
        r"latest.json: folder = 5: expected a step-N folder's name",
    )
    damaged(
        "no-recipe",
        lambda ckpt, folder: edit_json(folder / "state.json", lambda r: r.pop("recipe")),
        r"state.json: recipe = None: expected dict",
    )
    damaged(
        "tokens-null",
        lambda ckpt, folder: edit_json(folder / "state.json", lambda r: r.update(train_tokens=None)),
        r"state.json: train_tokens = None: expected int",
    )

    def damage_log_line(ckpt, number, text):
        lines = (ckpt / "log.jsonl").read_bytes().split(b"\n")
        lines[number - 1] = text
        (ckpt / "log.jsonl").write_bytes(b"\n".join(lines))

    damaged(
        "log-garbled",
        lambda ckpt, folder: damage_log_line(ckpt, 3, b'{"step": 2, "loss'),
        r"cut.ckpt/log.jsonl:3: not a training log entry; expected a JSON object with an integer",
    )
    damaged(
        "log-binary",
        lambda ckpt, folder: damage_log_line(ckpt, 2, b"\xff\xfe"),
        r"cut.ckpt/log.jsonl:2: not a training log entry",
    )
    # the half-written checkpoint and the cut log line a kill left go when the run resumes
    (good / ".step-0000006.partial").mkdir()
    with open(good / "log.jsonl", "ab") as log:
        log.write(b'{"step": 7, "lo')
    T.train(short_run(work, tmp_path / "cut", resume=True, finish=True))
    assert sorted(p.name for p in good.iterdir()) == ["latest.json", "log.jsonl", step.name]
    logged = [json.loads(line)["step"] for line in (good / "log.jsonl").read_text().splitlines()]
    assert logged == list(range(5))


def test_finish_writes_the_drafter_of_the_last_checkpoint(work, tmp_path, capsys):
    def stop_at_6(phase, done, total):
        if phase == "training" and done == 6:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        T.train(short_run(work, tmp_path / "early"), progress=stop_at_6)
    with pytest.raises(DrafterError, match="--finish ends a checkpointed run: pass --resume"):
        T.train(short_run(work, tmp_path / "early", finish=True))
    report = T.train(short_run(work, tmp_path / "early", resume=True, finish=True))
    assert report.steps == 4 and report.losses == [] and report.resumed_from == 4
    # the command's summary of a run that made no steps
    again = [
        "train",
        "--target",
        str(work / "target"),
        "--data",
        str(work / "data"),
        "--out",
        str(tmp_path / "again"),
        "--checkpoints",
        str(tmp_path / "early.ckpt"),
    ]
    again += [
        "--steps",
        "10",
        "--ttt-steps",
        "2",
        "--head-size",
        str(HEAD),
        "--batch",
        "3",
        "--lr",
        "2e-3",
        "--holdout",
        "0.2",
        "--eval-every",
        "100",
        "--checkpoint-every",
        "4",
        "--max-len",
        "64",
    ]
    capsys.readouterr()
    run_cli(again + ["--resume", "--finish"])
    assert (
        f"wrote {tmp_path / 'again'}: 4 steps (resumed at 4) (no steps in this run); cpu backend"
        in capsys.readouterr().out
    )
    checkpoint, _ = read_safetensors(tmp_path / "early.ckpt" / "step-0000004" / "model.safetensors")
    drafter = load_drafter(tmp_path / "early")
    for name, array in checkpoint.items():
        assert np.array_equal(np.asarray(drafter.weights[name], np.float32), array), name
    training = native.read_provenance(tmp_path / "early")["training"]
    assert training["steps"] == 4 and training["planned_steps"] == 10
    log = [json.loads(line) for line in (tmp_path / "early.ckpt" / "log.jsonl").read_text().splitlines()]
    assert training["final_loss"] == next(e["loss"] for e in log if e["step"] == 4)  # made before


def test_init_starts_from_a_trained_drafter(work, trained, tmp_path):
    theirs = native.read_provenance(trained)
    same_eval = dict(max_len=96, ttt_steps=3, init=str(trained), steps=2, lr=1e-6)
    warm = T.train(short_run(work, tmp_path / "warm", **same_eval))
    # Its first evaluation is the trained drafter's last one: the same weights on the same rows.
    assert warm.holdout_agreement_initial == theirs["holdout_agreement"]
    cold = T.train(short_run(work, tmp_path / "cold", max_len=96, ttt_steps=3, steps=2, lr=1e-6))
    assert warm.holdout_agreement_initial[0] > cold.holdout_agreement_initial[0] + 0.2
    record = native.read_provenance(tmp_path / "warm")["init"]
    # another run's folder than the output's: recorded by name and content, not by path
    assert record["source"] == f"{trained.name}@sha256:{content_sha256(trained)}"
    assert record["format"] == "woodcock"
    assert record["holdout_agreement"] == theirs["holdout_agreement"]
    started = load_drafter(tmp_path / "warm")
    trained_spec = load_drafter(trained).spec
    assert np.array_equal(
        started.vocab.draft_to_target, load_drafter(trained).vocab.draft_to_target
    )

    # from any format woodcock reads: speculators does not record the target's layer count
    from woodcock.conversion import convert

    converted = tmp_path / "speculators"
    convert(str(trained), converted, to="speculators", target=str(work / "target"))
    assert load_drafter(converted).spec.target.num_hidden_layers is None
    from_converted = T.train(short_run(work, tmp_path / "warm2", **{**same_eval, "init": str(converted)}))
    assert from_converted.holdout_agreement_initial == theirs["holdout_agreement"]

    with pytest.raises(DrafterError, match=r"--init .*--head-size 64: a drafter to start from"):
        T.train(short_run(work, tmp_path / "x", init=str(trained), head_size=64))
    with pytest.raises(DrafterError, match=r"--init .*: taps = .*; this run trains"):
        T.train(short_run(work, tmp_path / "y", init=str(trained), taps=(1, 2, 3)))
    # --force replaces OUT whole: never the run's own inputs
    for out, where in [
        (work, "holds the answers \\(--data\\)"),
        (trained, "is the --init drafter"),
    ]:
        with pytest.raises(DrafterError, match=f"the output {where}"):
            T.train(short_run(work, out, init=str(trained), force=True))
    # nor the checkpoints, which --force clears at the start, nor OUT and they one another
    for checkpoints, message in [
        (work / "data", f"{work / 'data'}: the checkpoint folder is the answers \\(--data\\)"),
        (tmp_path / "z" / "ckpt", "the checkpoint folder and the output .* must not hold one another"),
        (tmp_path, "the checkpoint folder and the output .* must not hold one another"),
    ]:
        with pytest.raises(DrafterError, match=message):
            T.train(short_run(work, tmp_path / "z", checkpoints=checkpoints, force=True))
    assert not (tmp_path / "z").exists() and not (work / "data" / "latest.json").exists()
    assert (work / "data").is_dir() and load_drafter(trained).spec == trained_spec


def test_init_takes_a_shipped_drafters_name(tmp_path):
    from woodcock.train.warm_start import load_init

    opts = TrainOptions(data=tmp_path, out=tmp_path / "out", algorithm="dspark", head_size=8192)
    init, record = load_init(dataclasses.replace(opts, init="smollm2-135m-dspark"))
    assert init.spec.algorithm.name == "dspark" and init.spec.draft_vocab_size == 8192
    assert record["source"] == "smollm2-135m-dspark" and record["format"] == "woodcock"
    with pytest.raises(DrafterError, match=r"--init smollm2-135m-eagle3: algorithm = 'eagle3'"):
        load_init(dataclasses.replace(opts, init="smollm2-135m-eagle3"))


def test_distill_and_train_default_to_the_default_target(work, tmp_path, monkeypatch):
    import woodcock.default_target

    monkeypatch.setattr(woodcock.default_target, "default_target_path", lambda: work / "target")
    prompts = write_corpus_prompts(tmp_path / "prompts.jsonl", 4)
    data = tmp_path / "data"
    run_cli(
        ["distill", "--prompts", str(prompts), "--out", str(data), "--max-tokens", "4", "--no-chat"]
    )
    meta = json.loads((data / "distill.json").read_text())
    assert meta["target"] == f"target@sha256:{content_sha256(work / 'target')}"
    report = T.train(short_run(work, tmp_path / "drafter", target=None, steps=1))
    assert report.steps == 1
    recipe = native.read_provenance(tmp_path / "drafter")["recipe"]
    assert recipe["target"] == f"target@sha256:{content_sha256(work / 'target')}"


def test_a_target_without_a_decoder_at_model_model_is_refused_as_a_teacher(monkeypatch):
    """Training reads the final hidden state from `model.model`; a multimodal wrapper keeps its
    decoder under `language_model`, and is refused in one line, not failed in the middle."""
    from mlx_targets import tiny_target

    from woodcock.train import features

    monkeypatch.setattr(features, "load_mlx_target", lambda source: (tiny_target("gemma3"), None))
    with pytest.raises(DrafterError, match=r"no decoder at `model.model` \(mlx_lm.models.gemma3\)"):
        features.TargetRunner("wrapped", (1, 2))
