"""A tiny target and a drafter that agrees with it, built offline in seconds: for trying
`woodcock generate` without downloading anything, and for end-to-end tests.

The target is a random Qwen3-shaped mlx-lm model whose attention and MLP outputs are scaled
down, so its next token depends mostly on the current one (a "near-bigram" model), with a
byte-level BPE tokenizer trained on a few sentences. The drafter is an EAGLE-3 drafter written
by hand to compute that bigram map: its attention copies the row's own token embedding (queries
and keys are scaled embeddings, so each row attends to itself) and outweighs the fed-back
state, its MLP and fused features are zero, and it shares the target's embedding and LM head.
It agrees with the target most of the time, but not always, which is what a speculative
decoder must handle.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models import qwen3
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from woodcock.converters.target_binding import rename_target
from woodcock.formats import native
from woodcock.ir import (
    DecoderLayer,
    Drafter,
    DrafterSpec,
    Eagle3,
    Fusion,
    Head,
    Taps,
    Target,
    VocabMap,
)
from woodcock.staging import staged_directory
from woodcock.tensorfile import read_safetensors

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts a few tokens and the target verifies them in one pass.",
    "A drafter reads the hidden states of the target model.",
    "Small models run fast; large models are accurate.",
    "def add(a, b):\n    return a + b\n",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "One, two, three, four, five, six, seven, eight, nine, ten.",
]
EOS = "<|endoftext|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TARGET_CONFIG = {
    "model_type": "qwen3",
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}


def write_tiny_target(
    path: Path, *, vocab_size: int = 320, mixing: float = 0.05, seed: int = 0
) -> Path:
    """An mlx-lm model directory (config.json, model.safetensors, tokenizer files)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    vocab = tokenizer.get_vocab_size()
    tokenizer.save(str(path / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS,
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))

    config = {**TARGET_CONFIG, "vocab_size": vocab, "eos_token_id": tokenizer.token_to_id(EOS)}
    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    rng = np.random.default_rng(seed)
    weights = {}
    for name, param in tree_flatten(model.parameters()):
        if param.ndim == 1:
            weights[name] = mx.ones(param.shape)
            continue
        scale = 1.0 / np.sqrt(param.shape[-1]) if "embed" not in name else 1.0
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            scale *= mixing  # context barely changes the residual stream
        weights[name] = mx.array(rng.standard_normal(param.shape).astype(np.float32) * scale)
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def bigram_drafter(target_path: Path, *, sharpness: float = 4.0) -> Drafter:
    """The hand-written EAGLE-3 drafter for a `write_tiny_target` model (see the module doc)."""
    config = json.loads((Path(target_path) / "config.json").read_text())
    hidden, vocab, layers = config["hidden_size"], config["vocab_size"], config["num_hidden_layers"]
    heads, head_dim = 4, hidden // 4
    target_tensors, _ = read_safetensors(Path(target_path) / "model.safetensors")
    spec = DrafterSpec(
        # the post-norm state is fed back (EAGLE-3.1), so it stays small next to the copy
        algorithm=Eagle3(norm_before_residual=False, norm_output=True, speculative_tokens=4),
        target=Target(
            num_hidden_layers=layers,
            hidden_size=hidden,
            vocab_size=vocab,
            name_or_path=str(target_path),
            architectures=("Qwen3ForCausalLM",),
        ),
        taps=Taps((1, layers // 2, layers)),
        fusion=Fusion(tap_norm="none", fc_bias=False, hidden_norm=False),
        layers=(
            DecoderLayer(
                style="llama",
                input="embed_and_hidden",
                attention="causal",
                sliding_window=None,
                hidden_size=hidden,
                intermediate_size=2 * hidden,
                num_attention_heads=heads,
                num_key_value_heads=heads,
                head_dim=head_dim,
                rms_norm_eps=config["rms_norm_eps"],
                rope_theta=10000.0,
                rope_scaling=None,
                max_position_embeddings=config["max_position_embeddings"],
            ),
        ),
        head=Head(lm_head="shared", embedding="shared"),
        draft_vocab_size=vocab,
    )
    ones, eye = np.ones(hidden, np.float32), np.eye(hidden, dtype=np.float32)
    embedding_half = np.concatenate([eye, np.zeros_like(eye)], axis=1)  # [H, 2H]: read e_n only
    weights = {
        "fc.weight": np.zeros((hidden, 3 * hidden), np.float32),
        "layers.0.hidden_norm.weight": ones,
        "layers.0.input_layernorm.weight": ones,
        "layers.0.self_attn.q_proj.weight": sharpness * embedding_half,
        "layers.0.self_attn.k_proj.weight": sharpness * embedding_half,
        "layers.0.self_attn.v_proj.weight": embedding_half,
        # the copied embedding outweighs the fed-back state in the residual stream
        "layers.0.self_attn.o_proj.weight": 16.0 * eye,
        "layers.0.post_attention_layernorm.weight": ones,
        "layers.0.mlp.gate_proj.weight": np.zeros((2 * hidden, hidden), np.float32),
        "layers.0.mlp.up_proj.weight": np.zeros((2 * hidden, hidden), np.float32),
        "layers.0.mlp.down_proj.weight": np.zeros((hidden, 2 * hidden), np.float32),
        "norm.weight": np.array(target_tensors["model.norm.weight"], np.float32),
    }
    return Drafter(spec, VocabMap(), weights)


def write_demo(dest: str | Path, *, force: bool = False) -> None:
    """`woodcock demo`: DEST/target (the tiny mlx-lm model) and DEST/drafter (its bigram
    drafter, in the woodcock format, recording where the target lives)."""
    with staged_directory(dest, force=force) as out:
        write_tiny_target(out / "target")
        drafter = bigram_drafter(out / "target")
        # the drafter records where its target lives once the directory has its final name
        drafter = rename_target(drafter, str(Path(dest).resolve() / "target"))
        native.write(drafter, out / "drafter")
