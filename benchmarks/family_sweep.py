"""Is woodcock's greedy output mlx-lm's own on the model families mlx-lm ships? (not a test):
a tiny random target of each family (the configs below, random weights, fp32 or quantized) is
decoded greedily by mlx-lm and by woodcock with prompt lookup alone, with a random EAGLE-3
drafter and with a random DSpark drafter, each at fixed draft lengths, on three prompts (a
repeated phrase, 40 random tokens, one token). Per family: identical, refused (a DrafterError,
its message), different (the first position that differs and the target's top-2 margin there)
or crashed (any other exception). Exit 1 on any different or crashed run.

    python benchmarks/family_sweep.py [--families llama,qwen2] [--tokens 60] [--bits 4]
        [--draft-lengths 1,4,8] [--json FILE]
"""

# ruff: noqa: I001  (woodcock is imported before mlx so that the CPU backend picks up OpenBLAS)
from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections import Counter

import woodcock  # noqa: F401

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_map
from mlx_lm.generate import generate_step

from woodcock.errors import DrafterError
from woodcock.runtime.block import BlockDrafter
from woodcock.runtime.decode import GREEDY, speculative_generate_step
from woodcock.runtime.eagle3 import Eagle3Drafter
from woodcock.runtime.ngram import NgramDrafter, PromptLookup
from woodcock.runtime.policy import FixedPolicy
from woodcock.runtime.target import MlxTarget
from woodcock.synthetic import random_drafter, tiny_spec

VOCAB = 128
SMALL = {
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "vocab_size": VOCAB,
    "max_position_embeddings": 1024,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
ALTERNATING = ["sliding_attention", "full_attention"] * 2
MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 32}
# model_type -> what its ModelArgs needs beyond SMALL (None: a config of its own)
FAMILIES: dict[str, dict | None] = {
    "llama": {},
    "qwen2": {},
    "qwen3": {"tie_word_embeddings": True},
    "qwen3_moe": {**MOE, "num_experts": 4, "decoder_sparse_step": 1, "mlp_only_layers": []}
    | {"norm_topk_prob": True},
    "gemma": {},
    "gemma2": {"query_pre_attn_scalar": 16.0},
    "gemma3_text": {"sliding_window": 8, "sliding_window_pattern": 2, "query_pre_attn_scalar": 16},
    "phi3": {},
    "olmo2": {},
    "olmo3": {"sliding_window": 8, "layer_types": ["sliding_attention"] * 3 + ["full_attention"]},
    "starcoder2": {"norm_epsilon": 1e-5},
    "granite": {
        "logits_scaling": 2.0,
        "attention_multiplier": 0.25,
        "embedding_multiplier": 2.0,
        "residual_multiplier": 0.5,
        "attention_bias": False,
        "mlp_bias": False,
    },
    "cohere": {"layer_norm_eps": 1e-5, "logit_scale": 0.5},
    "cohere2": {
        "layer_norm_eps": 1e-5,
        "logit_scale": 0.5,
        "sliding_window": 8,
        "sliding_window_pattern": 2,
    },
    "internlm2": {},
    "deepseek_v3": {
        **MOE,
        "n_shared_experts": 1,
        "n_routed_experts": 4,
        "kv_lora_rank": 16,
        "q_lora_rank": 24,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "qk_nope_head_dim": 16,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
    },
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "minicpm": {"dim_model_base": 32, "scale_depth": 1.4, "scale_emb": 2.0},
    "glm4": {"attention_bias": False, "partial_rotary_factor": 0.5},
    "hunyuan_v1_dense": {},
    "smollm3": {},
    "exaone4": {"rope_scaling": None, "sliding_window": 8, "sliding_window_pattern": "LG"},
    "gpt_oss": {
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 8,
        "layer_types": ALTERNATING,
    },
    "plamo3": {
        "window_size": 8,
        "sliding_window_pattern": 2,
        "rope_local_theta": 10000.0,
        "tie_word_embeddings": True,
    },
    "gpt2": None,
    "gemma3": None,
    "gemma4_text": None,
    "qwen3_next": None,
}
OWN_CONFIGS = {
    "gpt2": {"n_ctx": 1024, "n_embd": 64, "n_head": 4, "n_layer": 4, "n_positions": 1024}
    | {"layer_norm_epsilon": 1e-5, "vocab_size": VOCAB},
    "gemma3": {
        "vocab_size": VOCAB,
        "text_config": {**SMALL, "model_type": "gemma3_text"}
        | {"sliding_window": 8, "sliding_window_pattern": 2, "query_pre_attn_scalar": 16},
    },
    "gemma4_text": {**SMALL, "global_head_dim": 32, "vocab_size_per_layer_input": VOCAB}
    | {"hidden_size_per_layer_input": 16, "num_kv_shared_layers": 2, "sliding_window": 8}
    | {"sliding_window_pattern": 2, "use_double_wide_mlp": False},
    "qwen3_next": {**SMALL, **MOE, "num_experts": 4, "decoder_sparse_step": 1}
    | {"linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16}
    | {"linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "mlp_only_layers": []}
    | {"shared_expert_intermediate_size": 32, "partial_rotary_factor": 0.5}
    | {"full_attention_interval": 2},
}


def build(family: str, bits: int | None, seed: int = 0) -> nn.Module:
    config = OWN_CONFIGS.get(family) or {**SMALL, **FAMILIES[family]}
    module = importlib.import_module(f"mlx_lm.models.{family}")
    model = module.Model(module.ModelArgs.from_dict({"model_type": family, **config}))
    mx.random.seed(seed)
    # matrices around 0.5 so that the logits are spread out, norms at 1
    weights = tree_map(
        lambda p: mx.random.normal(p.shape) * 0.5 if p.ndim > 1 else mx.ones(p.shape),
        model.parameters(),
    )
    model.update(weights)
    if bits:
        nn.quantize(
            model,
            group_size=32,
            bits=bits,
            class_predicate=lambda _, m: (
                hasattr(m, "to_quantized") and m.weight.shape[-1] % 32 == 0
            ),
        )
    mx.eval(model.parameters())
    return model


def woodcock_tokens(model, prompt: list[int], tokens: int, kind: str, draft: int) -> list[int]:
    facts = MlxTarget(model, ())
    lookup = PromptLookup(facts.vocab_size)
    if kind == "lookup":
        target, drafter = facts, NgramDrafter(facts.vocab_size)
    else:
        layers = facts.num_layers
        common = dict(
            num_layers=1,
            hidden_size=facts.hidden_size,
            vocab_size=facts.vocab_size,
            target_layers=layers,
            taps=(1, layers // 2, layers),
        )
        if kind == "eagle3":
            spec = tiny_spec("eagle3", style="llama", tap_norm="per_tap", **common)
        else:
            spec = tiny_spec("dspark", style="qwen3", block_size=max(draft, 2), **common)
        target = MlxTarget(model, spec.taps.layer_ids)
        target.check_fits(spec)
        runtime = Eagle3Drafter if kind == "eagle3" else BlockDrafter
        drafter = runtime(random_drafter(spec, seed=3), target.shared_tensors())
        if kind == "dspark":
            draft = min(draft, drafter.num_drafts)
    steps = speculative_generate_step(
        prompt, target, drafter, policy=FixedPolicy(draft), sampling=GREEDY, lookup=lookup
    )
    out = []
    for token, *_ in steps:
        out.append(int(token))
        if len(out) == tokens:
            return out
    return out


def run(model, prompt: list[int], tokens: int, kind: str, draft: int) -> dict:
    expected, margins = [], []
    for token, logprobs in generate_step(mx.array(prompt), model, max_tokens=tokens):
        top = np.sort(np.array(logprobs.astype(mx.float32)))[::-1]
        expected.append(int(token))
        margins.append(float(top[0] - top[1]))
    try:
        got = woodcock_tokens(model, prompt, tokens, kind, draft)
    except DrafterError as e:
        return {"outcome": "refused", "why": str(e)}
    except Exception as e:  # what the sweep is for: a family the runtime does not expect
        return {"outcome": "crashed", "why": f"{type(e).__name__}: {e}"}
    if got == expected:
        return {"outcome": "identical"}
    # woodcock's run is never the longer one: it stops at `tokens` too
    at = next((i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), len(got))
    return {"outcome": "different", "position": at, "margin": margins[at]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--tokens", type=int, default=60)
    parser.add_argument("--bits", type=int, choices=(4, 8))
    parser.add_argument("--draft-lengths", default="1,4,8")
    parser.add_argument("--json")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    phrase = rng.integers(2, VOCAB - 2, 7).tolist()
    prompts = [phrase * 3 + phrase[:3], rng.integers(2, VOCAB - 2, 40).tolist(), [5]]
    drafts = [int(k) for k in args.draft_lengths.split(",")]
    report = {}
    for family in args.families.split(","):
        model = build(family, args.bits)
        runs = [
            {"prompt": p, "kind": kind, "draft": k, **run(model, prompt, args.tokens, kind, k)}
            for p, prompt in enumerate(prompts)
            for kind in ("lookup", "eagle3", "dspark")
            for k in drafts
        ]
        report[family] = runs
        counts = Counter(r["outcome"] for r in runs)
        print(f"{family}: " + ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items())))
        for r in runs:
            if r["outcome"] != "identical":
                found = r.get("why") or f"position {r['position']}, margin {r['margin']:.4g}"
                print(f"    prompt {r['prompt']}, {r['kind']}, fixed:{r['draft']}: {found}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tokens": args.tokens, "bits": args.bits, "families": report}, f, indent=1)
    failed = any(r["outcome"] in ("different", "crashed") for runs in report.values() for r in runs)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
