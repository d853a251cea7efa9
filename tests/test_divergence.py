"""`woodcock bench`'s verdict where speculative and plain greedy decoding part: a tie the
backend's rounding decides, or a real difference (exit code 1), on the offline demo pair with a
planted tie and a planted error."""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from helpers import run_cli

from woodcock import bench
from woodcock.cli import main
from woodcock.runtime.divergence import (
    Divergence,
    classify,
    first_divergence,
    rounding_noise,
    verify_logits,
)
from woodcock.runtime.generate import encode_prompt, generate
from woodcock.runtime.policy import FixedPolicy
from woodcock.runtime.sampling import Sampling, ulp
from woodcock.runtime.session import open_session
from woodcock.runtime.target import MlxTarget

PROMPT = "The quick brown"
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    path = tmp_path_factory.mktemp("divergence") / "demo"
    try:
        main(["demo", str(path)])
    except SystemExit as e:
        assert not e.code
    prompts = path / "prompts.jsonl"
    prompts.write_text(json.dumps({"domain": "fox", "prompt": PROMPT}) + "\n")
    return path


def bench_args(demo, target=None):
    return ["bench", "--target", str(target or demo / "target"), "--drafter", str(demo / "drafter"), "--prompt-file", str(demo / "prompts.jsonl"), "--max-tokens", str(MAX_TOKENS), "--no-chat", "--policy", "fixed:2", "--no-lookup"]  # fmt: skip


@pytest.fixture(scope="module")
def runs(demo):
    """The demo pair's session, the prompt, plain decoding's tokens and a speculative run."""
    session = open_session(str(demo / "target"), str(demo / "drafter"), lookup=False)
    ids = encode_prompt(session.tokenizer, PROMPT, chat=False)
    expected, _ = bench.baseline_generate(session.model, session.tokenizer, ids, MAX_TOKENS)
    ours = generate(session, ids, max_tokens=MAX_TOKENS, policy=FixedPolicy(2), sampling=Sampling())
    return session, ids, expected, ours


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 7]) == 2  # plain decoding stopped there
    assert first_divergence([], [4]) == 0


def test_a_tie_needs_both_margins_within_twice_the_noise():
    def divergence(one_row, verify):
        return Divergence(3, 10, 11, one_row, verify, verify_rows=4, noise=0.5)

    assert divergence(0.0, 0.25).tie and divergence(1.0, 1.0).tie
    assert not divergence(0.0, 1.5).tie and not divergence(-1.2, 0.1).tie
    # the verify forward itself ranks plain's token first: not the verify path's choice
    assert not divergence(0.25, -0.25).tie and not divergence(-0.25, 0.25).tie
    assert divergence(0.0, 1.5).as_dict()["kind"] == "different"


def test_the_replayed_verify_path_chose_every_token_the_run_emitted(runs):
    session, ids, expected, ours = runs
    stats = ours.stats
    assert ours.tokens == expected and stats.rounds > 1
    # the prompt's rows made the first token; each round's K drafts and its anchor the next
    rows_by_position = [len(ids)]
    for drafted, accepted in zip(stats.drafted, stats.accepted, strict=True):
        rows_by_position += [drafted + 1] * (accepted + 1)
    assert set(stats.drafted[:-1]) == {2}  # fixed:2; the last round no further than the end
    for position in range(len(ours.tokens)):
        logits, rows = verify_logits(session.target, ids, ours.tokens, stats, position)
        assert mx.argmax(logits).item() == ours.tokens[position]
        assert rows == rows_by_position[position]
    assert classify(session, ids, expected, ours.tokens, ours.stats) is None


def test_the_measured_noise_of_fp32_on_the_cpu_is_small_but_counts_the_rows(runs):
    session, ids, expected, _ = runs
    noise = rounding_noise(session.target, ids + expected, 4)
    assert 0 <= noise < 1e-3
    assert rounding_noise(session.target, ids + expected, 1) == 0.0  # one row is the one-row path
    assert ulp(mx.float32, 3.0) == 2.0**-22 and ulp(mx.bfloat16, 20.0) == 0.125


def test_a_wrong_token_with_a_clear_margin_is_different(runs):
    session, ids, expected, ours = runs
    wrong = list(ours.tokens)
    wrong[5] = (wrong[5] + 1) % 320
    divergence = classify(session, ids, expected, wrong, ours.stats)
    assert divergence.position == 5 and divergence.woodcock_token == wrong[5]
    assert divergence.one_row_margin > 2 * divergence.noise
    assert divergence.verify_margin < -2 * divergence.noise and not divergence.tie


def test_identical_runs_count_identical(demo, capsys):
    code, out, err = run_cli(bench_args(demo) + ["--json"], capsys)
    assert code == 0, err
    (run,) = json.loads(out)["runs"]
    total = run["rows"][-1]
    assert (total["identical"], total["ties"], total["different"]) == (1, 0, 0)
    assert total["divergences"] == []
    assert json.loads(out)["backend"]["backend"] == "cpu"


def test_a_planted_error_is_different_and_fails_the_bench(demo, capsys, monkeypatch):
    real = bench.generate

    def wrong_at_five(session, ids, **kwargs):
        result = real(session, ids, **kwargs)
        result.tokens[5] = (result.tokens[5] + 1) % session.target.vocab_size
        return result

    monkeypatch.setattr(bench, "generate", wrong_at_five)
    code, out, err = run_cli(bench_args(demo) + ["--json"], capsys)
    assert code == 1, err
    total = json.loads(out)["runs"][0]["rows"][-1]
    assert (total["identical"], total["ties"], total["different"]) == (0, 0, 1)
    (divergence,) = total["divergences"]
    assert divergence["position"] == 5 and divergence["kind"] == "different"
    assert divergence["domain"] == "fox" and divergence["verify_rows"] == 3
    code, out, err = run_cli(bench_args(demo), capsys)
    assert code == 1
    assert "on 0 of 1 prompts; 0 ties (the first divergence within" in out and "1 DIFFERENT" in out
    assert "first divergence at token 5" in out and out.count(": DIFFERENT") == 1


def test_a_planted_tie_is_a_tie_and_passes(demo, capsys, monkeypatch, tmp_path):
    """A target whose head gives two tokens the same row ties them exactly: plain decoding takes
    the lower id; a verify path nudged a few ulps towards the higher one takes that."""
    session = open_session(str(demo / "target"), str(demo / "drafter"), lookup=False)
    ids = encode_prompt(session.tokenizer, PROMPT, chat=False)
    expected, _ = bench.baseline_generate(session.model, session.tokenizer, ids, MAX_TOKENS)
    chosen = expected[4]
    twin = next(t for t in range(chosen + 1, 320) if t not in expected)
    target = tmp_path / "target"
    shutil.copytree(demo / "target", target)
    weights = mx.load(str(target / "model.safetensors"))
    head = np.array(weights["lm_head.weight"])
    head[twin] = head[chosen]
    weights["lm_head.weight"] = mx.array(head)
    mx.save_safetensors(str(target / "model.safetensors"), weights)
    logits = session.model(mx.array([ids + expected]))
    nudge = 4 * ulp(mx.float32, mx.abs(logits).max().item())
    real = MlxTarget.forward

    def nudged(self, tokens):
        logits, taps = real(self, tokens)
        if tokens.shape[0] > 1:
            logits = logits + nudge * (mx.arange(logits.shape[-1]) == twin)
        return logits, taps

    monkeypatch.setattr(MlxTarget, "forward", nudged)
    code, out, err = run_cli(bench_args(demo, target) + ["--json"], capsys)
    assert code == 0, err
    total = json.loads(out)["runs"][0]["rows"][-1]
    assert (total["identical"], total["ties"], total["different"]) == (0, 1, 0)
    (divergence,) = total["divergences"]
    assert (divergence["plain_token"], divergence["woodcock_token"]) == (chosen, twin)
    assert divergence["one_row_margin"] == 0 and 0 < divergence["verify_margin"] <= 2 * nudge
    assert divergence["noise"] >= nudge / 2 and divergence["kind"] == "tie"
    code, out, err = run_cli(bench_args(demo, target), capsys)
    assert code == 0 and "; 1 ties (" in out and ", 0 DIFFERENT" in out and ": tie" in out
