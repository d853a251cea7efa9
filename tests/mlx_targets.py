"""Tiny random mlx-lm targets built from config dicts (no files, no network)."""

import importlib

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

CONFIGS = {
    "qwen3": {
        "model_type": "qwen3",
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "vocab_size": 96,
        "max_position_embeddings": 512,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    },
    "llama": {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": 96,
        "max_position_embeddings": 512,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
    },
}
_SMALL = {
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "vocab_size": 96,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}
# Families whose mlx-lm classes keep their parts where the common ones do not: `model.layers` a
# copy of the list the forward runs (qwen2's pipeline slice), layers that return a tuple
# (gemma4_text), the language model inside a multimodal wrapper (gemma3), a token embedding
# beside a position embedding (gpt2's wte and wpe), a head of its own name (internlm2's output).
CONFIGS |= {
    "qwen2": {"model_type": "qwen2", **_SMALL},
    "gemma4_text": {
        "model_type": "gemma4_text",
        **_SMALL,
        "head_dim": 16,
        "global_head_dim": 32,
        "vocab_size_per_layer_input": 96,
        "hidden_size_per_layer_input": 16,
        "num_kv_shared_layers": 2,
        "sliding_window": 8,
        "sliding_window_pattern": 2,
        "use_double_wide_mlp": False,
        "tie_word_embeddings": True,
    },
    "gemma3": {
        "model_type": "gemma3",
        "vocab_size": 96,
        "text_config": {
            "model_type": "gemma3_text",
            **_SMALL,
            "head_dim": 16,
            "sliding_window": 8,
            "sliding_window_pattern": 2,
            "query_pre_attn_scalar": 16,
        },
    },
    "gpt2": {
        "model_type": "gpt2",
        "n_ctx": 512,
        "n_embd": 64,
        "n_head": 4,
        "n_layer": 4,
        "n_positions": 512,
        "layer_norm_epsilon": 1e-5,
        "vocab_size": 96,
    },
    "internlm2": {"model_type": "internlm2", **_SMALL, "rope_theta": 10000.0},
}


def tiny_target(model_type: str = "qwen3", seed: int = 0, scale: float = 1.0, **overrides):
    """A random fp32 model. `scale` multiplies every weight matrix by a seeded random factor
    around it, so the logits are spread out rather than near-uniform."""
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    config = {**CONFIGS[model_type], **overrides}
    model = module.Model(module.ModelArgs.from_dict(config))
    mx.random.seed(seed)
    params = tree_map(
        lambda p: mx.random.normal(p.shape) * scale * (p.ndim > 1) + (p.ndim == 1),
        model.parameters(),
    )
    model.update(params)
    mx.eval(model.parameters())
    assert all(p.dtype == mx.float32 for _, p in tree_flatten(model.parameters()))
    return model


def sampling_target(model_type: str = "qwen3", num_hidden_layers: int = 1, **overrides):
    """The target the chi-square tests sample from: 12 tokens, logits spread out (about 1-2 nats
    of entropy at temperature 1), and one layer unless a drafter taps more. What they test is the
    sampling rule, which depth does not change, while every layer adds about 4 ms to each of
    their thousands of sampled runs on MLX's CPU backend."""
    settings = {"seed": 4, "scale": 0.3, "vocab_size": 12, **overrides}
    return tiny_target(model_type, num_hidden_layers=num_hidden_layers, **settings)
