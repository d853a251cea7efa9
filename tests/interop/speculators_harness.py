"""Drive the real `speculators==0.9.0` package to produce reference drafters and logits.

This module *calls* speculators (vllm-project/speculators); it re-implements none of its math.
It builds tiny random verifiers and drafters with speculators' own classes
(`Eagle3DraftModel` / `DFlashDraftModel` / `DSparkDraftModel.from_training_args`, i.e. the
constructor the training CLI uses), saves them with `save_pretrained`, reloads them with
`SpeculatorModel.from_pretrained`, and runs speculators' own training-time forward on given
verifier features, capturing the draft logits with forward hooks (speculators' forwards return
argmax tokens or a loss, not logits).

Conventions used throughout (batch = 1 always: speculators trains on packed batch-1 rows):

* `T` sequence length, `V` verifier vocab, `Vd` draft vocab, `H` hidden size, `A` number of tapped
  verifier layers, `N` verifier decoder layers, `Bk` DFlash/DSpark block size.
* Layer ids follow speculators/vLLM: id `l` = verifier residual stream *after* `l` decoder layers
  (= input of decoder layer `l`; id 0 = embedding output; id N = final residual *before* the
  final norm). Features are concatenated along the last axis in the order of the config's id list
  (the variants always use ascending ids), so `fc.weight[:, j*H:(j+1)*H]` multiplies id j.
* All tensors are fp32 on CPU. Models run in eval mode under `torch.no_grad()`.
* Default attention implementation is `"sdpa"` (set on the nested `transformer_layer_config`;
  speculators itself defaults to `"simple_flex_attention"`, which for EAGLE-3 TTT needs T to be a
  multiple of 128 and for DFlash/DSpark builds its mask through `torch.compile`). `"eager"` and
  `"sdpa"` agree to ~1e-6 in 0.9.0 (tests check it; 0.9.0 fixed the older snapshot's eager
  float-mask bug), so either is a valid reference.

Nothing here touches the network: verifiers are local directories, `HF_HUB_OFFLINE=1` is set on
import if unset. speculators' loguru INFO/WARNING chatter is disabled on import.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import speculators.models.dflash.core as _dflash_core  # noqa: E402
import speculators.models.dspark.core as _dspark_core  # noqa: E402
import torch  # noqa: E402
from loguru import logger as _loguru  # noqa: E402
from safetensors import safe_open  # noqa: E402
from speculators import SpeculatorModel, SpeculatorModelConfig  # noqa: E402
from speculators.models import DFlashDraftModel, DSparkDraftModel, Eagle3DraftModel  # noqa: E402
from speculators.models.eagle3.data import shift_batch as _shift_batch  # noqa: E402
from speculators_variants import (  # noqa: E402,F401  (re-exported)
    REDUCED_VOCAB,
    VARIANT_LIST,
    VARIANT_NAMES,
    VARIANTS,
    VERIFIERS,
    Variant,
)
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, Qwen3Config  # noqa: E402

_loguru.disable("speculators")

SPECULATORS_VERSION = "0.9.0"
DEFAULT_ATTN = "sdpa"

__all__ = [
    "DEFAULT_ATTN",
    "REDUCED_VOCAB",
    "SPECULATORS_VERSION",
    "VARIANTS",
    "VARIANT_LIST",
    "VARIANT_NAMES",
    "VERIFIERS",
    "Variant",
    "block_logits",
    "build",
    "eagle3_logits",
    "eagle3_run",
    "expected_saved_tensors",
    "load_drafter",
    "make_inputs",
    "make_verifier",
    "make_vocab_mapping",
    "read_checkpoint",
    "run_reference",
    "shift_for_eagle3",
    "verifier_features",
    "verifier_tensors",
]


# --------------------------------------------------------------------------------------------
# random initialisation (seeded, independent of the global RNG)


def _randomize_(name: str, p: torch.Tensor, gen: torch.Generator) -> None:
    """Overwrite one floating tensor in place with seeded values that keep activations O(1).

    * 1-D tensors whose name contains "norm" (RMSNorm gains, incl. q_norm/k_norm, input_norm,
      fc_norm.j, hidden_norm): uniform in [0.5, 1.5], so no norm is the identity.
    * other 1-D tensors (biases): normal, std 0.2.
    * `embed_tokens.weight` / `markov_w1.weight` (embedding tables): normal, std 1.
    * other 2-D weights `[out, in]`: normal, std 1/sqrt(in).
    """
    with torch.no_grad():
        if p.ndim == 1 and "norm" in name:
            v = torch.rand(p.shape, generator=gen, dtype=torch.float32) + 0.5
        elif p.ndim == 1:
            v = torch.randn(p.shape, generator=gen, dtype=torch.float32) * 0.2
        elif name.endswith(("embed_tokens.weight", "markov_w1.weight")):
            v = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        else:
            v = torch.randn(p.shape, generator=gen, dtype=torch.float32) / math.sqrt(p.shape[-1])
        p.copy_(v.to(p.dtype))


# --------------------------------------------------------------------------------------------
# verifier


def make_verifier(
    out_dir: str | os.PathLike,
    model_type: str = "qwen3",
    *,
    vocab_size: int = 128,
    hidden_size: int = 64,
    num_layers: int = 6,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    tie_word_embeddings: bool = False,
    seed: int = 0,
) -> Path:
    """Save a tiny random Hugging Face causal LM (fp32, safetensors) to `out_dir`; return it.

    `model_type` "qwen3" (Qwen3ForCausalLM, q/k norms, no sliding window) or "llama"
    (LlamaForCausalLM). Both: `rms_norm_eps=1e-6`, `max_position_embeddings=256`, RoPE default
    with theta 10000, no biases. Every parameter is overwritten from `torch.Generator(seed)`
    (embeddings N(0,1), linears N(0,1/fan_in), norm gains U(0.5,1.5)) so hidden states and
    logits are O(1). With `tie_word_embeddings=True` the file holds no `lm_head.weight`
    (the head is `model.embed_tokens.weight`). Files: config.json, generation_config.json,
    model.safetensors. No tokenizer.
    """
    out = Path(out_dir)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=1e-6,
        max_position_embeddings=256,
        tie_word_embeddings=tie_word_embeddings,
        hidden_act="silu",
        attention_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    if model_type == "qwen3":
        config = Qwen3Config(**common, use_sliding_window=False)
    elif model_type == "llama":
        config = LlamaConfig(**common, mlp_bias=False)
    else:
        raise ValueError(f"model_type must be 'qwen3' or 'llama', got {model_type!r}")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):  # named_parameters dedups tied weights
        _randomize_(name, p, gen)
    model.eval()
    model.save_pretrained(out)
    return out


def _load_verifier(verifier_dir: str | os.PathLike):
    model = AutoModelForCausalLM.from_pretrained(
        str(verifier_dir), dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def verifier_features(
    verifier_dir: str | os.PathLike,
    input_ids: torch.Tensor,
    layer_ids: Sequence[int],
) -> dict[str, Any]:
    """Run the HF verifier on `input_ids` [1, T] and collect speculators-convention features.

    Returns a dict:
      * `features` [1, T, A*H]: concat over `layer_ids` (in the given order) of the residual
        stream after `l` layers, captured with forward pre-hooks on `model.layers[l]` (l < N) and
        on the final norm (l = N, pre-norm). This is what vLLM hands speculators as aux states.
      * `taps` {l: [1, T, H]}.
      * `last_hidden_prenorm` [1, T, H]: id N (speculators' `verifier_last_hidden_states`).
      * `logits` [1, T, V]: verifier logits (row t predicts token t+1).
      * `hf_hidden_states`: HF `output_hidden_states` tuple (N+1 entries; entry N is post-norm).
    """
    model = _load_verifier(verifier_dir)
    layers = model.model.layers
    n = len(layers)
    captured: dict[int, torch.Tensor] = {}
    handles = []

    def pre_hook(idx):
        def hook(_mod, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            captured[idx] = x.detach().clone()

        return hook

    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(pre_hook(i), with_kwargs=True))
    handles.append(model.model.norm.register_forward_pre_hook(pre_hook(n), with_kwargs=True))
    try:
        with torch.no_grad():
            out = model(input_ids=input_ids, output_hidden_states=True)
    finally:
        for h in handles:
            h.remove()
    for lid in layer_ids:
        if not 0 <= lid <= n:
            raise ValueError(f"layer id {lid} outside [0, {n}]")
    taps = {lid: captured[lid] for lid in layer_ids}
    return {
        "features": torch.cat([taps[lid] for lid in layer_ids], dim=-1),
        "taps": taps,
        "last_hidden_prenorm": captured[n],
        "logits": out.logits.detach(),
        "hf_hidden_states": tuple(h.detach() for h in out.hidden_states),
    }


def verifier_tensors(verifier_dir: str | os.PathLike) -> dict[str, Any]:
    """The verifier tensors speculators shares with its drafters, read from model.safetensors.

    Returns `embed_tokens` [V, H], `lm_head` [V, H] (= `embed_tokens` when the verifier is tied,
    `tied` True), `norm` [H] (final norm gain). speculators fills the drafter's `embed_tokens`
    with `embed_tokens` and its `lm_head` with `lm_head[t2d]` (reduced vocab) or `lm_head`.
    """
    path = Path(verifier_dir) / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        keys = set(f.keys())
        embed = f.get_tensor("model.embed_tokens.weight")
        tied = "lm_head.weight" not in keys
        head = embed if tied else f.get_tensor("lm_head.weight")
        norm = f.get_tensor("model.norm.weight")
    return {"embed_tokens": embed, "lm_head": head, "norm": norm, "tied": tied}


def make_inputs(
    verifier_dir: str | os.PathLike,
    layer_ids: Sequence[int],
    seq_len: int = 16,
    seed: int = 0,
) -> dict[str, Any]:
    """Random token ids [1, seq_len] (uniform in [0, V), seeded) plus `verifier_features` of them.

    Keys: `input_ids` [1, T] int64 and everything `verifier_features` returns.
    """
    vocab = AutoConfig.from_pretrained(str(verifier_dir)).vocab_size
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, seq_len), generator=gen, dtype=torch.long)
    return {"input_ids": ids, **verifier_features(verifier_dir, ids, layer_ids)}


# --------------------------------------------------------------------------------------------
# drafters


def make_vocab_mapping(
    verifier_vocab: int, draft_vocab: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """A seeded reduced-vocab mapping in speculators' offset convention.

    Returns `(t2d, d2t)`: `t2d` bool [V] with exactly `draft_vocab` True entries; `d2t` int64
    [Vd] with `target_id = i + d2t[i]` strictly increasing = `nonzero(t2d)`. Ids 0 and V-1 are
    always kept (edge rows), the rest drawn at random, so d2t is a real, non-constant offset.
    """
    if not 2 <= draft_vocab < verifier_vocab:
        raise ValueError("need 2 <= draft_vocab < verifier_vocab")
    gen = torch.Generator().manual_seed(seed + 1234)
    middle = torch.randperm(verifier_vocab - 2, generator=gen)[: draft_vocab - 2] + 1
    selected = torch.sort(torch.cat([torch.tensor([0, verifier_vocab - 1]), middle])).values
    t2d = torch.zeros(verifier_vocab, dtype=torch.bool)
    t2d[selected] = True
    d2t = (selected - torch.arange(draft_vocab)).to(torch.long)
    return t2d, d2t


def _as_variant(variant: Variant | str) -> Variant:
    return VARIANTS[variant] if isinstance(variant, str) else variant


def _draft_layer_config(v: Variant, vcfg) -> Any:
    """transformer_layer_config for the draft: verifier dims, `num_hidden_layers` = draft layers."""
    kw = dict(
        vocab_size=vcfg.vocab_size,
        hidden_size=vcfg.hidden_size,
        intermediate_size=vcfg.intermediate_size,
        num_hidden_layers=v.num_layers,
        num_attention_heads=vcfg.num_attention_heads,
        num_key_value_heads=vcfg.num_key_value_heads,
        head_dim=vcfg.head_dim,
        rms_norm_eps=vcfg.rms_norm_eps,
        max_position_embeddings=vcfg.max_position_embeddings,
        hidden_act="silu",
        attention_bias=v.attention_bias,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": v.rope_theta},
    )
    if v.layer_types is not None:
        if len(v.layer_types) != v.num_layers or v.sliding_window is None:
            raise ValueError(f"{v.name}: layer_types needs num_layers entries and sliding_window")
        kw["layer_types"] = list(v.layer_types)
        kw["sliding_window"] = v.sliding_window
        kw["use_sliding_window"] = True
    if v.layer_model_type == "qwen3":
        if v.layer_types is None:
            kw["use_sliding_window"] = False
            kw["layer_types"] = ["full_attention"] * v.num_layers
        return Qwen3Config(**kw)
    if v.layer_model_type == "llama":
        return LlamaConfig(**kw, mlp_bias=False)
    raise ValueError(v.layer_model_type)


def build(
    variant: Variant | str,
    out_dir: str | os.PathLike,
    verifier_dir: str | os.PathLike,
    seed: int = 0,
) -> Path:
    """Build `variant` with speculators' own classes, randomise it, save it to `out_dir`; return it.

    Steps (all speculators API):
      1. `transformer_layer_config` = LlamaConfig/Qwen3Config with the verifier's dims,
         `num_hidden_layers = variant.num_layers`, rope theta `variant.rope_theta`,
         `layer_types`/`sliding_window` from the variant.
      2. `<Cls>.from_training_args(tl_config, t2d=..., d2t=..., verifier_name_or_path=<abs
         verifier_dir>, target_layer_ids=variant.aux_layer_ids, draft_vocab_size=...,
         ...algorithm kwargs...)`. This is the training CLI's constructor: it writes the
         `speculators_config` (speculative_tokens = ttt_steps for EAGLE-3, Bk if
         sample_from_anchor else Bk-1 for DFlash/DSpark), calls `load_vocab_mappings(t2d, d2t)`
         and then `load_verifier_weights()` (embed_tokens, lm_head[, t2d rows],
         verifier_lm_head, verifier_norm from the verifier's safetensors).
      3. Every trainable floating parameter (all except the frozen verifier-owned
         `embed_tokens`, `lm_head`, `verifier_lm_head`, `verifier_norm`) is overwritten from
         `torch.Generator(seed)` in sorted-name order (`_randomize_`: norm gains U(0.5,1.5),
         biases N(0,0.2²), markov_w1 N(0,1), other weights N(0,1/fan_in)). With
         `variant.own_lm_head`, `lm_head.weight` is randomised too.
      4. `save_pretrained(out_dir)` (fp32), then `load_drafter(out_dir)` and a check that the
         reloaded state dict equals the built one exactly (buffers included).
    """
    v = _as_variant(variant)
    out = Path(out_dir)
    verifier_dir = str(Path(verifier_dir).resolve())
    vcfg = AutoConfig.from_pretrained(verifier_dir)
    tl = _draft_layer_config(v, vcfg)
    vocab = vcfg.vocab_size
    vd = v.draft_vocab_size or vocab
    t2d = d2t = None
    if v.reduced_vocab:
        t2d, d2t = make_vocab_mapping(vocab, vd, seed)
    common = dict(
        t2d=t2d,
        d2t=d2t,
        draft_vocab_size=vd,
        verifier_name_or_path=verifier_dir,
        target_layer_ids=list(v.aux_layer_ids),
        draft_attn_impl=DEFAULT_ATTN,
    )
    if v.algorithm == "eagle3":
        model = Eagle3DraftModel.from_training_args(
            tl,
            norm_before_residual=v.norm_before_residual,
            norm_before_fc=v.norm_before_fc,
            fc_norm=v.fc_norm,
            norm_output=v.norm_output,
            ttt_steps=v.ttt_steps,
            **common,
        )
    else:
        dkw = dict(
            block_size=v.block_size,
            mask_token_id=v.mask_token_id,
            sample_from_anchor=v.sample_from_anchor,
            sliding_window_non_causal=v.sliding_window_non_causal,
            **common,
        )
        if v.algorithm == "dflash":
            model = DFlashDraftModel.from_training_args(tl, **dkw)
        elif v.algorithm == "dspark":
            model = DSparkDraftModel.from_training_args(
                tl,
                markov_rank=v.markov_rank,
                markov_head_type=v.markov_head_type,
                enable_confidence_head=v.enable_confidence_head,
                confidence_head_with_markov=v.confidence_head_with_markov,
                **dkw,
            )
        else:
            raise ValueError(v.algorithm)
    if v.own_lm_head and v.algorithm != "eagle3" and not v.reduced_vocab:
        raise ValueError(f"{v.name}: a full-vocab {v.algorithm} lm_head is never saved")

    frozen = {
        "embed_tokens.weight",
        "lm_head.weight",
        "verifier_lm_head.weight",
        "verifier_norm.weight",
    }
    if v.own_lm_head:
        frozen.discard("lm_head.weight")
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        if name in frozen or not p.is_floating_point():
            continue
        _randomize_(name, p, gen)
    for name in ("embed_tokens.weight", "lm_head.weight"):
        if torch.isnan(model.get_parameter(name)).any():
            raise AssertionError(f"{name} was not filled from the verifier")
    model.eval()
    model.save_pretrained(out)

    reloaded = load_drafter(out)
    want, got = model.state_dict(), reloaded.state_dict()
    if set(want) != set(got):
        raise AssertionError(f"reload changed keys: {set(want) ^ set(got)}")
    for k in want:
        if not torch.equal(want[k], got[k]):
            raise AssertionError(f"reload changed {k}")
    return out


def load_drafter(path: str | os.PathLike, attn_implementation: str = DEFAULT_ATTN):
    """`SpeculatorModel.from_pretrained(path)` with the given attention back-end, in eval mode.

    The back-end is set on the nested `transformer_layer_config` before construction
    (speculators only reads `transformer_layer_config._attn_implementation`, which is never
    serialised, and would default it to "simple_flex_attention"). Loading re-runs
    `load_verifier_weights()` from `speculators_config.verifier.name_or_path` (DFlash/DSpark:
    `embed_tokens` always, full-vocab `lm_head` always, overwritten from the verifier).
    Values: "sdpa", "eager", "simple_flex_attention".
    """
    config = SpeculatorModelConfig.from_pretrained(str(path))
    config.transformer_layer_config._attn_implementation = attn_implementation  # noqa: SLF001
    model = SpeculatorModel.from_pretrained(str(path), config=config)
    return model.eval()


def read_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """config.json as a dict, the tensors of model.safetensors {name: tensor}, its metadata and
    the directory listing (`files`, sorted)."""
    p = Path(path)
    with safe_open(str(p / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = f.metadata()
    return {
        "config": json.loads((p / "config.json").read_text()),
        "tensors": tensors,
        "metadata": meta,
        "files": sorted(x.name for x in p.iterdir()),
    }


def expected_saved_tensors(
    variant: Variant | str,
    *,
    vocab_size: int = 128,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Names, shapes and dtypes `model.safetensors` must hold for `variant` in speculators 0.9.0,
    written down from its documented layout rather than derived from its code, so that the
    interop tests check the package against it.

    EAGLE-3 saves embed_tokens and lm_head; DFlash/DSpark save lm_head only for reduced vocab
    and never embed_tokens; d2t/t2d iff reduced vocab; verifier_lm_head / verifier_norm never.
    """
    v = _as_variant(variant)
    V, H, inter, hd = vocab_size, hidden_size, intermediate_size, head_dim  # noqa: N806
    Vd = v.draft_vocab_size or V  # noqa: N806
    A = len(v.aux_layer_ids)  # noqa: N806
    f32 = torch.float32
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
        "fc.weight": ((H, A * H), f32),
        "norm.weight": ((H,), f32),
    }
    if v.reduced_vocab:
        out["d2t"] = ((Vd,), torch.int64)
        out["t2d"] = ((V,), torch.bool)
    qwen_style = v.algorithm != "eagle3" or v.layer_model_type == "qwen3"
    for layer in range(v.num_layers):
        pre = f"layers.{layer}."
        width = 2 * H if (v.algorithm == "eagle3" and layer == 0) else H
        out[pre + "input_layernorm.weight"] = ((H,), f32)
        out[pre + "post_attention_layernorm.weight"] = ((H,), f32)
        out[pre + "self_attn.q_proj.weight"] = ((num_heads * hd, width), f32)
        out[pre + "self_attn.k_proj.weight"] = ((num_kv_heads * hd, width), f32)
        out[pre + "self_attn.v_proj.weight"] = ((num_kv_heads * hd, width), f32)
        out[pre + "self_attn.o_proj.weight"] = ((H, num_heads * hd), f32)
        if v.attention_bias:
            out[pre + "self_attn.q_proj.bias"] = ((num_heads * hd,), f32)
            out[pre + "self_attn.k_proj.bias"] = ((num_kv_heads * hd,), f32)
            out[pre + "self_attn.v_proj.bias"] = ((num_kv_heads * hd,), f32)
            out[pre + "self_attn.o_proj.bias"] = ((H,), f32)
        if qwen_style:
            out[pre + "self_attn.q_norm.weight"] = ((hd,), f32)
            out[pre + "self_attn.k_norm.weight"] = ((hd,), f32)
        out[pre + "mlp.gate_proj.weight"] = ((inter, H), f32)
        out[pre + "mlp.up_proj.weight"] = ((inter, H), f32)
        out[pre + "mlp.down_proj.weight"] = ((H, inter), f32)
        if v.algorithm == "eagle3" and layer == 0:
            out[pre + "hidden_norm.weight"] = ((H,), f32)
    if v.algorithm == "eagle3":
        out["embed_tokens.weight"] = ((V, H), f32)
        out["lm_head.weight"] = ((Vd, H), f32)
        if v.norm_before_fc:
            out["input_norm.weight"] = ((A * H,), f32)
        if v.fc_norm:
            for j in range(A):
                out[f"fc_norm.{j}.weight"] = ((H,), f32)
        return out
    out["hidden_norm.weight"] = ((H,), f32)
    if v.reduced_vocab:
        out["lm_head.weight"] = ((Vd, H), f32)
    if v.algorithm == "dspark":
        r = v.markov_rank
        if r > 0:
            out["markov_head.markov_w1.weight"] = ((V, r), f32)
            out["markov_head.markov_w2.weight"] = ((Vd, r), f32)
            if v.markov_head_type == "gated":
                out["markov_head.gate_proj.weight"] = ((r, H + r), f32)
                out["markov_head.gate_proj.bias"] = ((r,), f32)
            elif v.markov_head_type == "rnn":
                out["markov_head.joint_proj.weight"] = ((3 * r, 2 * r + H), f32)
                out["markov_head.joint_proj.bias"] = ((3 * r,), f32)
        if v.enable_confidence_head:
            width = H + (r if v.confidence_head_with_markov else 0)
            out["confidence_head.proj.weight"] = ((1, width), f32)
            out["confidence_head.proj.bias"] = ((1,), f32)
    return out


# --------------------------------------------------------------------------------------------
# forward capture helpers


@contextlib.contextmanager
def _hooks(handles: list) -> Iterator[None]:
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def _patched(obj, name: str, value) -> Iterator[None]:
    """Temporarily replace attribute `name` of a module or object (instance attrs are removed
    again rather than left shadowing the class method)."""
    had_own = name in vars(obj)
    old = vars(obj).get(name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if had_own:
            setattr(obj, name, old)
        else:
            delattr(obj, name)


def _mask_to_bool(mask) -> torch.Tensor | None:
    """Dense [Q, KV] bool "may attend" from an sdpa bool mask or an eager 0/-inf float mask
    (both [1, 1, Q, KV]); None for a flex BlockMask."""
    if not isinstance(mask, torch.Tensor):
        return None
    m = mask[0, 0]
    return m.clone() if m.dtype == torch.bool else (m == 0)


def _layer_mask_hooks(model, sink: list) -> list:
    """Record, per call, the attention_mask each decoder layer receives (as [Q, KV] bool)."""

    def make(i):
        def hook(_mod, _args, kwargs):
            sink.append((i, _mask_to_bool(kwargs.get("attention_mask"))))

        return hook

    return [
        layer.register_forward_pre_hook(make(i), with_kwargs=True)
        for i, layer in enumerate(model.layers)
    ]


# --------------------------------------------------------------------------------------------
# EAGLE-3


def shift_for_eagle3(token_ids: torch.Tensor, features: torch.Tensor) -> dict[str, torch.Tensor]:
    """Apply speculators' own `shift_batch` (speculators/models/eagle3/data.py) to a sequence.

    Input: `token_ids` [1, T+1] = x_0..x_T and `features` [1, T+1, A*H] = g_0..g_T (g_t = verifier
    aux features at position t). Output (batch dim restored): `input_ids` [1, T] = x_1..x_T,
    `hidden_states` [1, T, A*H] = g_0..g_{T-1}, `position_ids` [1, T] = 1..T. These are exactly
    the `eagle3_logits` inputs speculators' trainer feeds.
    """
    t1 = token_ids.shape[1]
    batch = {
        "input_ids": token_ids[0],
        "hidden_states": features[0],
        "verifier_last_hidden_states": torch.zeros(t1, 1),
        "loss_mask": torch.ones(t1, dtype=torch.long),
        "lengths": torch.tensor([t1]),
        "position_ids": torch.arange(t1),
    }
    s = _shift_batch(batch)
    return {
        "input_ids": s["input_ids"].unsqueeze(0),
        "hidden_states": s["hidden_states"].unsqueeze(0),
        "position_ids": s["position_ids"].unsqueeze(0),
    }


def eagle3_run(
    path: str | os.PathLike,
    hidden_states: torch.Tensor,
    input_ids: torch.Tensor,
    *,
    ttt_steps: int,
    position_ids: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
    attn_implementation: str = DEFAULT_ATTN,
) -> dict[str, Any]:
    """Run speculators' `Eagle3DraftModel.forward` (no loss: `verifier_last_hidden_states=None`)
    and capture every TTT step.

    Inputs (what speculators' trainer passes after `shift_batch`, see `shift_for_eagle3`):
      * `hidden_states` [1, T, A*H]: row i = g_i, the verifier aux features at sequence
        position i (raw, before input_norm/fc_norm/fc).
      * `input_ids` [1, T] int64 (verifier ids): row i = x_{i+1}, the token *after* g_i's.
      * `position_ids` [1, T]: default (None) = speculators' default 1..T (row i -> i+1).
      * `document_ids` [1, T]: default zeros (one document; -1 would mark padding rows).

    TTT step k = 0..ttt_steps-1 (speculators' loop, teacher forced):
      * row i's token = original `input_ids[0, i+k]` (= x_{i+1+k}); rows with i+k >= T get the
        pad id 0. Row i's hidden = `fc(features)` at k=0, else row i's fed-back state of step k-1
        (`norm(z)` if norm_output else `z`, z = last decoder layer output). Position = i+1+k
        (`position_ids + k`).
      * attention of row i at step k: step-0 keys j <= i of the same document (and j > i - W for
        a sliding layer, W = sliding_window, counted in rows, relative to i not to i+k), plus
        its own keys of steps 1..k (the "diagonal"; never window-limited).
      * `logits[k][i]` = lm_head(norm(z)) [Vd] predicts x_{i+2+k} = `input_ids[0, i+1+k]`
        (target index `i+1+k`), i.e. inference draft step k+1 after the verifier has
        processed x_0..x_{i} and emitted the bonus token x_{i+1} (P = i+1), with the earlier
        chain tokens taken from the sequence. Row i of step k is exact inference iff i+k <= T-1
        (`valid[k, i]`); later rows see the pad token.

    Returns dict:
      * `logits` [ttt_steps, T, Vd] (draft vocab; map with `d2t`),
      * `input_ids` [ttt_steps, T] tokens embedded at each step,
      * `position_ids` [ttt_steps, T],
      * `embed_in` [ttt_steps, T, H] token embeddings entering layer 0 (raw, pre input_layernorm),
      * `hidden_in` [ttt_steps, T, H] hidden half entering layer 0: `fc(...)` at step 0,
        `fed_back[k-1]` at step k,
      * `fed_back` [ttt_steps, T, H] state leaving each step (input hidden of the next),
      * `last_layer` [ttt_steps, T, H] pre-norm output z of the last decoder layer,
      * `masks` list[ttt_steps] of list[num_layers] of bool [T, T*(k+1)] (None for flex),
      * `target_index` [ttt_steps, T] = i+1+k (index into `input_ids` of the predicted token),
      * `valid` [ttt_steps, T] bool = i+k <= T-1,
      * `draft_tokens` list[ttt_steps] of [1, T] argmax draft ids (speculators' return value).
    """
    model = load_drafter(path, attn_implementation)
    if not isinstance(model, Eagle3DraftModel):
        raise TypeError(f"{path} is not an EAGLE-3 drafter")
    t = input_ids.shape[1]
    if hidden_states.shape[:2] != (1, t):
        raise ValueError("hidden_states must be [1, T, A*H] with T = input_ids.shape[1]")
    if document_ids is None:
        document_ids = torch.zeros(1, t, dtype=torch.long)
    rec: dict[str, list] = {
        "logits": [],
        "ids": [],
        "pos": [],
        "last": [],
        "norm": [],
        "masks": [],
        "in": [],
    }

    def layer0_in(_m, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        rec["in"].append(x[0].detach().clone())

    handles = [
        model.lm_head.register_forward_hook(lambda m, i, o: rec["logits"].append(o[0].clone())),
        model.embed_tokens.register_forward_hook(
            lambda m, i, o: rec["ids"].append(i[0][0].clone())
        ),
        model.rotary_emb.register_forward_pre_hook(lambda m, a: rec["pos"].append(a[1][0].clone())),
        model.layers[-1].register_forward_hook(lambda m, i, o: rec["last"].append(o[0].clone())),
        model.norm.register_forward_hook(lambda m, i, o: rec["norm"].append(o[0].clone())),
        model.layers[0].register_forward_pre_hook(layer0_in, with_kwargs=True),
        *_layer_mask_hooks(model, rec["masks"]),
    ]
    with _hooks(handles), torch.no_grad():
        draft_tokens = model(
            hidden_states=hidden_states.to(torch.float32),
            input_ids=input_ids,
            document_ids=document_ids,
            position_ids=position_ids,
            ttt_steps=ttt_steps,
        )
    nl = len(model.layers)
    last = torch.stack(rec["last"])
    normed = torch.stack(rec["norm"])
    fed_back = normed if model.config.norm_output else last
    layer0_in = torch.stack(rec["in"])  # [ttt, T, 2H] = [embedding ; hidden]
    h = model.hidden_size
    i = torch.arange(t)
    k = torch.arange(ttt_steps)[:, None]
    return {
        "embed_in": layer0_in[..., :h],
        "hidden_in": layer0_in[..., h:],
        "logits": torch.stack(rec["logits"]),
        "input_ids": torch.stack(rec["ids"]),
        "position_ids": torch.stack(rec["pos"]),
        "fed_back": fed_back,
        "last_layer": last,
        "masks": [[rec["masks"][s * nl + li][1] for li in range(nl)] for s in range(ttt_steps)],
        "target_index": i[None, :] + 1 + k,
        "valid": (i[None, :] + k) <= t - 1,
        "draft_tokens": draft_tokens,
    }


def eagle3_logits(
    path: str | os.PathLike,
    hidden_states: torch.Tensor,
    input_ids: torch.Tensor,
    *,
    ttt_steps: int,
    **kwargs,
) -> list[torch.Tensor]:
    """Draft logits of every TTT step from speculators' own EAGLE-3 forward: a list of
    `ttt_steps` tensors [T, Vd]; element k row i predicts `input_ids[0, i+1+k]` (x_{i+2+k}).
    Inputs and row semantics exactly as in `eagle3_run` (kwargs: position_ids, document_ids,
    attn_implementation)."""
    out = eagle3_run(path, hidden_states, input_ids, ttt_steps=ttt_steps, **kwargs)
    return list(out["logits"].unbind(0))


# --------------------------------------------------------------------------------------------
# DFlash / DSpark


def block_logits(
    path: str | os.PathLike,
    hidden_states: torch.Tensor,
    input_ids: torch.Tensor,
    anchor_positions: Sequence[int] | torch.Tensor,
    *,
    position_ids: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
    verifier_last_hidden_states: torch.Tensor | None = None,
    attn_implementation: str = DEFAULT_ATTN,
) -> dict[str, Any]:
    """Run speculators' own DFlash/DSpark `forward` on FIXED anchors and capture the block outputs.

    How anchors are fixed: `speculators.models.dflash.core.select_anchors` (the random anchor
    sampler called by `DFlashDraftModel._build_attention_mask`) is monkeypatched for the call
    to return `(anchor_positions, all-True valid)`, and `max_anchors = n_anchors` is passed
    (DSpark's forward reshapes by `max_anchors`). The loss (`compute_metrics`, looked up in
    `dflash.core` / `dspark.core`) is monkeypatched to a recorder that returns zero, so no loss is
    computed; its `logits` / `confidence_logits` arguments are what is returned. Everything in
    between (fc, hidden_norm, block embedding, mask, RoPE, layers, norm, lm_head, Markov head,
    confidence head) is speculators' code, unchanged.

    Inputs: `hidden_states` [1, T, A*H] (g_0..g_{T-1}, verifier aux features at positions
    0..T-1, NOT shifted), `input_ids` [1, T] (x_0..x_{T-1}), `anchor_positions` n distinct ints
    with 0 <= p <= T - Bk (speculators' own sampler only draws p <= T-Bk-1 and sorts them),
    `position_ids` default arange(T), `document_ids` default zeros, `verifier_last_hidden_states`
    only feeds the (unused) training targets, default zeros [1, T, H].

    What speculators computes for the block anchored at p (slot s = 0..Bk-1):
      * block tokens: `[x_p, MASK, ..., MASK]` (mask_token_id, a verifier id), positions
        p..p+Bk-1 (= position_ids[p] + s);
      * context: `c_t = hidden_norm(fc(g_t))` for all t, as extra K/V (shared k_proj/v_proj,
        k_norm applied, RoPE at position_ids[t]); the block sees context t iff same document,
        t < p, and for sliding layers t >= p - W (window relative to the anchor p, the same for
        every slot);
      * in-block: all Bk slots for full-attention layers or `sliding_window_non_causal`, slots
        <= s for other sliding layers; never other blocks.
      * `sample_from_anchor` True: slot s predicts the token at index p+s+1 (all Bk slots are
        drafts); False: slot s predicts index p+s (slots 1..Bk-1 are drafts, slot 0 unused).
      * DSpark Markov head (teacher forced from `input_ids`): prev token of slot s =
        `x_{p+s}` if sample_from_anchor else (`x_p` for s = 0, `x_{p+s-1}` for s >= 1), i.e.
        always the ground-truth token just before the predicted one (slot 0 of the False case:
        the anchor). `W1` is indexed by these *verifier* ids.
      * confidence logit of slot s = proj([hidden_s ; W1[prev_s]]) (or proj(hidden_s)).

    Returns dict (n = number of anchors):
      * `logits` [n, Bk, Vd]: final draft logits (DSpark: base + Markov bias),
      * `base_logits` [n, Bk, Vd]: `lm_head(norm(x))` before any Markov bias,
      * `markov_bias` [n, Bk, Vd] or None (exactly what speculators' `block_bias` returned),
      * `confidence_logits` [n, Bk] or None (pre-sigmoid), `confidence` = sigmoid of it,
      * `hidden` [n, Bk, H]: post-final-norm block states,
      * `prev_token_ids` [n, Bk] verifier ids the Markov head used (None without Markov head),
      * `block_token_ids` [n, Bk] ids embedded in each block, `block_position_ids` [n, Bk],
        `context_position_ids` [T],
      * `target_index` [n, Bk]: index into `input_ids` of the token each slot predicts
        (p+s+1 or p+s), `draft_slots` [Bk] bool,
      * `masks` list[num_layers] of bool [n*Bk, T + n*Bk] (KV = [context | all blocks]; None for
        flex), `sliding_layers` list[int], `block_size`, `sample_from_anchor`, `anchors` [n].
    """
    model = load_drafter(path, attn_implementation)
    if not isinstance(model, DFlashDraftModel):
        raise TypeError(f"{path} is not a DFlash/DSpark drafter")
    t = input_ids.shape[1]
    bk = model.block_size
    anchors = torch.as_tensor(anchor_positions, dtype=torch.long).reshape(-1)
    n = anchors.numel()
    if n == 0 or anchors.min() < 0 or anchors.max() > t - bk:
        raise ValueError(f"anchors must lie in [0, T - block_size] = [0, {t - bk}]")
    if anchors.unique().numel() != n:
        raise ValueError("anchors must be distinct")
    if document_ids is None:
        document_ids = torch.zeros(1, t, dtype=torch.long)
    if verifier_last_hidden_states is None:
        verifier_last_hidden_states = torch.zeros(1, t, model.hidden_size)
    is_dspark = isinstance(model, DSparkDraftModel)

    def fixed_anchors(loss_mask, num_anchors, block_size):
        if num_anchors != n or block_size != bk:
            raise AssertionError("unexpected select_anchors call")
        return anchors.clone(), torch.ones(n, dtype=torch.bool)

    rec: dict[str, Any] = {"masks": []}

    def metrics_recorder(*args, **kwargs):
        rec["metrics_args"] = args
        return torch.zeros(()), {}

    def rec_hook(key, take_input=False):
        def hook(_m, inputs, output):
            rec[key] = (inputs[0] if take_input else output).detach().clone()

        return hook

    handles = [
        model.lm_head.register_forward_hook(rec_hook("base")),
        model.norm.register_forward_hook(rec_hook("hidden")),
        model.embed_tokens.register_forward_hook(rec_hook("block_ids", take_input=True)),
        model.rotary_emb.register_forward_pre_hook(
            lambda m, a: rec.__setitem__("pos", a[1][0].clone())
        ),
        *_layer_mask_hooks(model, rec["masks"]),
    ]
    markov = getattr(model, "markov_head", None)
    stack = contextlib.ExitStack()
    if markov is not None:
        handles.append(markov.markov_w1.register_forward_hook(rec_hook("prev", take_input=True)))
        orig_block_bias = markov.block_bias

        def block_bias(**kw):
            out = orig_block_bias(**kw)
            rec["markov_bias"] = out.detach().clone()
            return out

        stack.enter_context(_patched(markov, "block_bias", block_bias))
    stack.enter_context(_patched(_dflash_core, "select_anchors", fixed_anchors))
    stack.enter_context(_patched(_dflash_core, "compute_metrics", metrics_recorder))
    stack.enter_context(_patched(_dspark_core, "compute_metrics", metrics_recorder))
    with stack, _hooks(handles), torch.no_grad():
        model(
            hidden_states=hidden_states.to(torch.float32),
            input_ids=input_ids,
            loss_mask=torch.ones(1, t, dtype=torch.long),
            verifier_last_hidden_states=verifier_last_hidden_states,
            document_ids=document_ids,
            position_ids=position_ids,
            max_anchors=n,
        )
    args = rec["metrics_args"]
    vd = model.draft_vocab_size
    logits = args[0].reshape(n, bk, vd)
    conf = None
    if is_dspark and args[2] is not None:
        conf = args[2].reshape(n, bk)
    sfa = bool(model.config.sample_from_anchor)
    slot = torch.arange(bk)
    pos = rec["pos"]
    return {
        "logits": logits,
        "base_logits": rec["base"].reshape(n, bk, vd),
        "markov_bias": rec.get("markov_bias"),
        "confidence_logits": conf,
        "confidence": None if conf is None else torch.sigmoid(conf),
        "hidden": rec["hidden"].reshape(n, bk, -1),
        "prev_token_ids": rec["prev"].reshape(n, bk) if "prev" in rec else None,
        "block_token_ids": rec["block_ids"].reshape(n, bk),
        "block_position_ids": pos[t:].reshape(n, bk),
        "context_position_ids": pos[:t],
        "target_index": anchors[:, None] + slot[None, :] + (1 if sfa else 0),
        "draft_slots": slot >= (0 if sfa else 1),
        "masks": [m for _, m in rec["masks"]],
        "sliding_layers": list(model.sliding_window_indices),
        "block_size": bk,
        "sample_from_anchor": sfa,
        "anchors": anchors,
    }


# --------------------------------------------------------------------------------------------
# one-stop reference case


def run_reference(
    variant: Variant | str,
    path: str | os.PathLike,
    verifier_dir: str | os.PathLike,
    *,
    seq_len: int = 16,
    seed: int = 0,
    anchors: Sequence[int] | None = None,
    attn_implementation: str = DEFAULT_ATTN,
) -> dict[str, Any]:
    """Inputs and speculators outputs for a drafter built by `build`, ready to compare.

    EAGLE-3: a random sequence x_0..x_T (T = seq_len) with verifier features g_0..g_T
    (`make_inputs(seq_len + 1)`), shifted by speculators' `shift_batch` (`shift_for_eagle3`);
    `inputs` = {input_ids [1,T] (x_1..x_T), hidden_states [1,T,A*H] (g_0..g_{T-1}),
    position_ids [1,T] (1..T), sequence_ids [1,T+1], sequence_features [1,T+1,A*H]},
    `outputs` = `eagle3_run(..., ttt_steps=variant.ttt_steps)`.

    DFlash/DSpark: x_0..x_{T-1}, g_0..g_{T-1} (`make_inputs(seq_len)`), anchors default
    0..T-Bk (every allowed anchor); `inputs` = {input_ids, hidden_states, anchor_positions},
    `outputs` = `block_logits(...)`.

    Both: `inputs["verifier"]` = the full `make_inputs` dict (taps, verifier logits, ...).
    """
    v = _as_variant(variant)
    if v.algorithm == "eagle3":
        raw = make_inputs(verifier_dir, v.aux_layer_ids, seq_len + 1, seed)
        s = shift_for_eagle3(raw["input_ids"], raw["features"])
        inputs = {
            **s,
            "sequence_ids": raw["input_ids"],
            "sequence_features": raw["features"],
            "verifier": raw,
        }
        outputs = eagle3_run(
            path,
            s["hidden_states"],
            s["input_ids"],
            ttt_steps=v.ttt_steps,
            attn_implementation=attn_implementation,
        )
        return {"inputs": inputs, "outputs": outputs}
    raw = make_inputs(verifier_dir, v.aux_layer_ids, seq_len, seed)
    if anchors is None:
        anchors = range(seq_len - v.block_size + 1)
    a = torch.as_tensor(list(anchors), dtype=torch.long)
    inputs = {
        "input_ids": raw["input_ids"],
        "hidden_states": raw["features"],
        "anchor_positions": a,
        "verifier": raw,
    }
    outputs = block_logits(
        path, raw["features"], raw["input_ids"], a, attn_implementation=attn_implementation
    )
    return {"inputs": inputs, "outputs": outputs}
