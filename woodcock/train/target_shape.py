"""What every trained drafter takes from its target: the default taps, decoder layers with the
target's dimensions, and the target's facts its spec records."""

from __future__ import annotations

from woodcock.ir import DecoderLayer, Target
from woodcock.target_checkpoint import target_from_config
from woodcock.train.features import TargetRunner


def default_taps(num_layers: int) -> tuple[int, ...]:
    taps = (2, num_layers // 2, num_layers - 3)
    if all(a < b for a, b in zip(taps, taps[1:], strict=False)) and taps[0] >= 0:
        return taps
    return tuple(sorted({1, max(1, num_layers // 2), num_layers}))


def _rope_scaling(args) -> dict | None:
    scaling = getattr(args, "rope_scaling", None)
    if not isinstance(scaling, dict):
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in ("linear", "llama3"):
        return None  # the drafter's short context needs no long-context scaling
    return {**{k: v for k, v in scaling.items() if k != "type"}, "rope_type": kind}


def layer_like_target(runner: TargetRunner, **fields) -> DecoderLayer:
    """A draft decoder layer with the target's width, heads, head_dim, MLP width, norm epsilon
    and RoPE; `fields` gives style, input, attention and sliding_window."""
    args = runner.model.args
    hidden = runner.hidden_size
    heads = int(args.num_attention_heads)
    return DecoderLayer(
        hidden_size=hidden,
        intermediate_size=int(args.intermediate_size),
        num_attention_heads=heads,
        num_key_value_heads=int(getattr(args, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(args, "head_dim", None) or hidden // heads),
        rms_norm_eps=float(getattr(args, "rms_norm_eps", 1e-6)),
        rope_theta=float(getattr(args, "rope_theta", 10000.0)),
        rope_scaling=_rope_scaling(args),
        max_position_embeddings=int(getattr(args, "max_position_embeddings", 4096) or 4096),
        **fields,
    )


def target_facts(runner: TargetRunner, target: str) -> Target:
    return Target(
        num_hidden_layers=runner.num_layers,
        hidden_size=runner.hidden_size,
        vocab_size=runner.vocab_size,
        name_or_path=str(target),
        architectures=target_from_config(target).architectures,
    )
