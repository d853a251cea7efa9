"""Named drafter variants for the speculators interop harness (no torch import here).

Kept apart from `speculators_harness` so that test modules can parametrize over the variant names
at collection time without importing torch/transformers/speculators (about 6 s) in runs that
deselect the slow interop tests. `speculators_harness` re-exports everything defined here.

All dimensions not named here come from the verifier the drafter is built for (`VERIFIERS`):
draft hidden size, heads, kv heads, head_dim and intermediate size equal the verifier's, exactly as
speculators' training CLI copies them (`transformer_layer_config` = verifier dims with
`num_hidden_layers` = draft layers).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

Algorithm = Literal["eagle3", "dflash", "dspark"]

# Verifier recipes, keyword arguments of `speculators_harness.make_verifier`.
# Both have 6 decoder layers (N = 6), V = 128, H = 64, 4 heads / 2 kv heads, head_dim 16, I = 128.
VERIFIERS: dict[str, dict] = {
    "qwen3": {"model_type": "qwen3", "tie_word_embeddings": False},
    # Tied verifier: its model.safetensors has no lm_head.weight, so speculators takes the LM head
    # from embed_tokens (src/speculators/model.py `verifier_weights.get("lm_head.weight", embed)`).
    "llama_tied": {"model_type": "llama", "tie_word_embeddings": True},
}

REDUCED_VOCAB = 48  # draft vocab of the reduced-vocab variants (verifier vocab is 128)
SEQ = 16  # sequence length T of the forward checks


@dataclasses.dataclass(frozen=True)
class Variant:
    """One drafter configuration, built by `speculators_harness.build` with speculators' classes.

    `draft_vocab_size=None` means full vocab (Vd = V: no d2t/t2d). Otherwise a seeded, sorted,
    non-identity selection of Vd verifier ids is made (`make_vocab_mapping`) and handed to
    speculators through `from_training_args(t2d=..., d2t=...)`, which calls
    `load_vocab_mappings(t2d, d2t)` before `load_verifier_weights()`.

    `layer_types=None` means every draft layer is `full_attention` (and, for Qwen3 layer configs,
    `use_sliding_window=False`, `sliding_window=None`). Otherwise `sliding_window` must be set.

    `sample_from_anchor=None` keeps the config-class default (DFlash False, DSpark True).
    `own_lm_head=True` also randomises `lm_head.weight` (frozen in speculators, normally the
    verifier head rows); only allowed where speculators saves it and lets the file win on load
    (EAGLE-3 always, DFlash/DSpark only with reduced vocab).
    """

    name: str
    algorithm: Algorithm
    layer_model_type: Literal["llama", "qwen3"] = "qwen3"
    num_layers: int = 1
    draft_vocab_size: int | None = None
    aux_layer_ids: tuple[int, ...] = (1, 3, 5)
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None
    attention_bias: bool = False
    rope_theta: float = 50000.0
    verifier: str = "qwen3"
    own_lm_head: bool = False
    # EAGLE-3
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    ttt_steps: int = 3
    # DFlash / DSpark
    block_size: int = 4
    mask_token_id: int = 127
    sample_from_anchor: bool | None = None
    sliding_window_non_causal: bool = False
    # DSpark
    markov_rank: int = 12
    markov_head_type: Literal["vanilla", "gated", "rnn"] = "vanilla"
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True

    @property
    def reduced_vocab(self) -> bool:
        return self.draft_vocab_size is not None

    def effective_sample_from_anchor(self) -> bool:
        if self.sample_from_anchor is not None:
            return self.sample_from_anchor
        return self.algorithm == "dspark"


def _e3(name: str, **kw) -> Variant:
    kw.setdefault("layer_model_type", "llama")
    kw.setdefault("draft_vocab_size", REDUCED_VOCAB)
    return Variant(name=name, algorithm="eagle3", **kw)


def _df(name: str, **kw) -> Variant:
    kw.setdefault("num_layers", 2)
    return Variant(name=name, algorithm="dflash", **kw)


def _ds(name: str, **kw) -> Variant:
    return Variant(name=name, algorithm="dspark", **kw)


_SW2 = ("sliding_attention", "full_attention")

VARIANT_LIST: tuple[Variant, ...] = (
    # ---- EAGLE-3 (Llama layers unless said otherwise; reduced vocab Vd=48 unless said otherwise)
    _e3("eagle3_llama"),
    _e3("eagle3_qwen3", layer_model_type="qwen3"),
    _e3("eagle3_llama_norm_before_residual", norm_before_residual=True),
    _e3("eagle3_llama_norm_before_fc", norm_before_fc=True),
    _e3("eagle3_llama_fc_norm", fc_norm=True),
    _e3("eagle3_llama_norm_output", norm_output=True),
    # train-CLI defaults ("Eagle 3.1"): norm_before_residual + norm_before_fc + norm_output
    _e3(
        "eagle3_llama_cli_defaults",
        norm_before_residual=True,
        norm_before_fc=True,
        norm_output=True,
    ),
    _e3(
        "eagle3_qwen3_2layer_fc_norm_all",
        layer_model_type="qwen3",
        num_layers=2,
        fc_norm=True,
        norm_before_residual=True,
        norm_output=True,
        attention_bias=True,
    ),
    _e3("eagle3_llama_full_vocab", draft_vocab_size=None),
    _e3("eagle3_llama_2layer", num_layers=2, ttt_steps=4),
    # sliding layer 0 with a window of 4 rows; layer 1 full attention
    _e3("eagle3_llama_2layer_sliding", num_layers=2, layer_types=_SW2, sliding_window=4),
    # tap ids 0 (embedding output) and N=6 (final residual, pre-norm); A = 2
    _e3("eagle3_llama_aux_0_N", aux_layer_ids=(0, 6), norm_before_fc=True),
    # converted-checkpoint case: lm_head trained (not the verifier's rows); tied llama verifier
    _e3("eagle3_llama_own_lm_head_tied_verifier", own_lm_head=True, verifier="llama_tied"),
    _e3(
        "eagle3_qwen3_full_vocab_aux_2_4",
        layer_model_type="qwen3",
        draft_vocab_size=None,
        aux_layer_ids=(2, 4),
        ttt_steps=2,
    ),
    # ---- DFlash (2 Qwen3-style layers, block 4, full vocab unless said otherwise)
    _df("dflash_full_attention"),
    _df("dflash_sliding", layer_types=_SW2, sliding_window=4),
    _df(
        "dflash_sliding_non_causal",
        layer_types=("sliding_attention", "sliding_attention"),
        sliding_window=4,
        sliding_window_non_causal=True,
    ),
    _df("dflash_reduced_vocab", draft_vocab_size=REDUCED_VOCAB),
    _df("dflash_reduced_vocab_own_lm_head", draft_vocab_size=REDUCED_VOCAB, own_lm_head=True),
    _df("dflash_sample_from_anchor", sample_from_anchor=True, num_layers=1),
    _df("dflash_aux_0_N", aux_layer_ids=(0, 3, 6), attention_bias=True),
    # transformer_layer_config model_type llama: DFlash layers are Qwen3-style regardless
    _df("dflash_llama_layer_config", layer_model_type="llama", verifier="llama_tied"),
    _df("dflash_block8", block_size=8, num_layers=1),
    # ---- DSpark (1 Qwen3-style layer, block 4, rank 12; sample_from_anchor default True)
    _ds("dspark_vanilla"),
    _ds("dspark_gated", markov_head_type="gated"),
    _ds("dspark_rnn", markov_head_type="rnn"),
    _ds("dspark_vanilla_no_confidence", enable_confidence_head=False),
    _ds(
        "dspark_gated_confidence_without_markov",
        markov_head_type="gated",
        confidence_head_with_markov=False,
    ),
    _ds("dspark_rank0", markov_rank=0, confidence_head_with_markov=False),
    _ds(
        "dspark_rank0_no_confidence",
        markov_rank=0,
        enable_confidence_head=False,
        confidence_head_with_markov=False,
    ),
    _ds("dspark_rnn_no_sample_from_anchor", markov_head_type="rnn", sample_from_anchor=False),
    _ds("dspark_vanilla_no_sample_from_anchor", sample_from_anchor=False, num_layers=2),
    _ds(
        "dspark_gated_reduced_vocab_sliding",
        markov_head_type="gated",
        draft_vocab_size=REDUCED_VOCAB,
        num_layers=2,
        layer_types=_SW2,
        sliding_window=4,
        aux_layer_ids=(1, 3, 6),
    ),
    _ds(
        "dspark_rnn_reduced_vocab",
        markov_head_type="rnn",
        draft_vocab_size=REDUCED_VOCAB,
        own_lm_head=True,
    ),
)

VARIANTS: dict[str, Variant] = {v.name: v for v in VARIANT_LIST}
assert len(VARIANTS) == len(VARIANT_LIST), "duplicate variant names"
VARIANT_NAMES: tuple[str, ...] = tuple(VARIANTS)
