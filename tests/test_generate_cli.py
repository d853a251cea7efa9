"""`woodcock demo` and `woodcock generate` end to end on the offline demo target."""

import json
import shlex

import mlx.core as mx
import numpy as np
import pytest
from helpers import run_cli
from mlx_lm import load
from mlx_lm.generate import generate_step

from woodcock.cli import main
from woodcock.errors import DrafterError
from woodcock.runtime.generate import encode_prompt


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("wc") / "demo"
    try:
        main(["demo", str(path)])
    except SystemExit as e:
        assert not e.code
    return path


def plain_text(target, prompt, max_tokens, chat):
    model, tokenizer = load(str(target))
    ids = encode_prompt(tokenizer, prompt, chat=chat)
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    for token, _ in generate_step(mx.array(ids), model, max_tokens=max_tokens):
        if token in tokenizer.eos_token_ids:
            break
        detokenizer.add_token(token)
    detokenizer.finalize()
    return detokenizer.text


@pytest.mark.parametrize("chat", [True, False])
def test_generate_streams_the_targets_text_and_reports(demo_dir, capsys, chat):
    args = ["generate", "--target", str(demo_dir / "target"), "--drafter", str(demo_dir / "drafter"), "--prompt", "The quick brown", "--max-tokens", "40", "--policy", "fixed:4"]
    code, out, err = run_cli(args + ([] if chat else ["--no-chat"]), capsys)
    assert code == 0, err
    assert out.startswith(plain_text(demo_dir / "target", "The quick brown", 40, chat))
    for label in ("prompt:", "generation:", "tokens per round:", "acceptance by position:", "prompt lookup:", "peak memory:"):
        assert label in out
    code, without, err = run_cli(args + ([] if chat else ["--no-chat"]) + ["--no-lookup"], capsys)
    assert code == 0, err
    assert without.split("\n==========")[0] == out.split("\n==========")[0]
    assert "prompt lookup:" not in without


def test_generate_json_and_truncated_head(demo_dir, capsys):
    counts = np.arange(1000, 1000 - 320, -1)  # "frequency" falls with the id
    np.savez(demo_dir / "counts.npz", counts=counts)
    base = ["generate", "--target", str(demo_dir / "target"), "--prompt", "Paris is", "--max-tokens", "30", "--json", "--no-chat", "--policy", "fixed:4"]
    code, out, err = run_cli(base + ["--drafter", str(demo_dir / "drafter")], capsys)
    assert code == 0, err
    full = json.loads(out)
    code, out, err = run_cli(base + ["--drafter", f"{demo_dir / 'drafter'}@{demo_dir / 'counts.npz'}:64"], capsys)
    assert code == 0, err
    truncated = json.loads(out)
    assert truncated["text"] == full["text"] == plain_text(demo_dir / "target", "Paris is", 30, False)
    assert full["tokens_per_round"] >= 1 and len(full["acceptance_by_position"]) == 4
    assert set(full) >= {"prompt_tokens", "prompt_tps", "generation_tokens", "generation_tps", "rounds", "draft_seconds", "verify_seconds", "peak_memory_gb", "finish_reason", "copied_rounds", "copied_tokens_per_round", "extended_rounds"}
    assert 0 <= full["copied_rounds"] <= full["rounds"]


def test_generate_sampling_is_seeded(demo_dir, capsys):
    args = ["generate", "--target", str(demo_dir / "target"), "--drafter", str(demo_dir / "drafter"), "--prompt", "One, two", "--max-tokens", "20", "--temp", "0.8", "--top-p", "0.9", "--seed", "3", "--json"]
    first = json.loads(run_cli(args, capsys)[1])["text"]
    assert json.loads(run_cli(args, capsys)[1])["text"] == first


def test_a_drafter_for_another_target_is_refused(demo_dir, tmp_path, capsys):
    from woodcock.loading import save_drafter
    from woodcock.synthetic import random_drafter, tiny_spec

    save_drafter(random_drafter(tiny_spec("eagle3", vocab_size=500, hidden_size=64)), tmp_path / "other")
    code, out, err = run_cli(["generate", "--target", str(demo_dir / "target"), "--drafter", str(tmp_path / "other"), "--prompt", "x"], capsys)
    assert code == 2 and out == ""
    assert "the drafter was built for a target vocab size of 500;" in err and "has 320" in err
    code, _, err = run_cli(["generate", "--target", str(demo_dir / "target"), "--drafter", f"{demo_dir / 'drafter'}@abc", "--prompt", "x"], capsys)
    assert code == 2 and "expected PATH, PATH@N or PATH@COUNTS:N" in err
    code, _, err = run_cli(["generate", "--target", str(demo_dir / "target"), "--drafter", "ngram@5", "--prompt", "x"], capsys)
    assert code == 2 and err.strip() == "woodcock: error: --drafter 'ngram@5': prompt lookup (ngram) has no draft head to truncate"


def test_stop_strings_cut_the_text_where_plain_decoding_would(demo_dir, capsys):
    plain = plain_text(demo_dir / "target", "The quick brown", 40, False)
    stop = plain[len(plain) // 2 : len(plain) // 2 + 3]
    args = ["generate", "--target", str(demo_dir / "target"), "--drafter", str(demo_dir / "drafter"), "--prompt", "The quick brown", "--max-tokens", "40", "--no-chat", "--stop", stop]
    code, out, err = run_cli(args + ["--json"], capsys)
    assert code == 0, err
    report = json.loads(out)
    assert report["text"] == plain[: plain.index(stop)] and report["finish_reason"] == "stop"
    code, out, _ = run_cli(args, capsys)  # streamed: the held-back text never shows the stop string
    assert out.split("\n" + "=" * 10)[0] == plain[: plain.index(stop)]


def test_generate_warns_of_a_slow_path_on_stderr(demo_dir, capsys):
    args = ["generate", "--target", str(demo_dir / "target"), "--drafter", str(demo_dir / "drafter"), "--prompt", "Paris is", "--max-tokens", "8", "--no-chat", "--policy", "fixed:2"]
    code, out, err = run_cli(args + ["--dtype", "bfloat16"], capsys)
    assert code == 0, err
    assert "woodcock: warning: weights in bfloat16 on the CPU backend" in err
    assert "warning" not in out
    code, out, err = run_cli(args, capsys)
    assert code == 0, err
    assert "weights in" not in err


def test_the_command_demo_suggests_runs_and_drafts(tmp_path, capsys):
    code, out, err = run_cli(["demo", str(tmp_path / "pair")], capsys)
    assert code == 0, err
    suggested = shlex.split(out.splitlines()[-1])
    assert suggested[:2] == ["woodcock", "generate"]
    code, out, err = run_cli(suggested[1:] + ["--max-tokens", "24"], capsys)
    assert code == 0, err
    acceptance = out.split("acceptance by position: ")[1].splitlines()[0].split()
    assert len(acceptance) == 4 and float(acceptance[0]) > 0.5  # the bigram drafter mostly agrees


@pytest.mark.parametrize("max_tokens", [2, 3, 8, 13])
def test_no_round_proposes_more_than_the_tokens_left(demo_dir, capsys, max_tokens):
    """As mlx-lm caps its drafts: a round's tokens never run past --max-tokens, so none is
    verified in vain and tokens per round counts only tokens emitted."""
    args = ["generate", "--target", str(demo_dir / "target"), "--drafter", str(demo_dir / "drafter"), "--prompt", "The quick brown", "--no-chat", "--json", "--policy", "fixed:8", "--max-tokens", str(max_tokens)]  # fmt: skip
    code, out, err = run_cli(args, capsys)
    assert code == 0, err
    report = json.loads(out)
    assert report["draft_lengths"][0] == min(8, max_tokens - 2)  # the prefill made one token
    if report["finish_reason"] == "length":
        assert report["generation_tokens"] == max_tokens
        assert report["tokens_per_round"] * report["rounds"] + 1 == pytest.approx(max_tokens)


def test_a_prompt_and_limit_past_the_targets_context_are_refused(demo_dir, capsys):
    args = ["generate", "--target", str(demo_dir / "target"), "--drafter", str(demo_dir / "drafter"), "--prompt", "Hi", "--no-chat"]
    code, out, err = run_cli(args + ["--max-tokens", "5000"], capsys)
    lines = [line for line in err.splitlines() if not line.startswith("woodcock: warning")]
    assert code == 2 and out == "" and len(lines) == 1, err
    assert lines[0].startswith("woodcock: error: --max-tokens 5000: ")
    assert "prompt tokens + 5000 exceed the target's context of 4096 tokens" in lines[0]


def test_a_system_prompt_is_refused_where_no_chat_template_takes_it():
    class Plain:
        has_chat_template = False

        def encode(self, text, add_special_tokens=True):
            return [len(text)]

    assert encode_prompt(Plain(), "Hi", chat=True) == [2]
    with pytest.raises(DrafterError, match="--system: a system prompt needs the chat template, and the target's tokenizer has none"):
        encode_prompt(Plain(), "Hi", chat=True, system="Be brief.")
    with pytest.raises(DrafterError, match="drop --no-chat"):
        encode_prompt(Plain(), "Hi", chat=False, system="Be brief.")
