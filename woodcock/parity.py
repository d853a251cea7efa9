"""Parity of the MLX runtime with the torch reference (`woodcock.reference.TorchDrafter`), on
random target features and tokens, in fp32: the max |diff| of every intermediate tensor and of
every step's logits, and whether the greedy tokens agree. Needs the `torch` extra.

`parity` dispatches on the algorithm: `eagle3_parity` steps a chain, `block_parity` runs one
DFlash/DSpark block (Markov head and confidence head included). It sits above both the runtime
and the reference, which know nothing of each other.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import numpy as np

from woodcock.errors import DrafterError
from woodcock.ir import DFlash, Drafter, DrafterSpec, DSpark, Eagle3
from woodcock.runtime.backend import describe as describe_backend
from woodcock.runtime.backend import report as backend_report
from woodcock.runtime.block import BlockDrafter
from woodcock.runtime.eagle3 import Eagle3Drafter
from woodcock.runtime.layers import KVCache

TOLERANCE = 1e-4


def parity(
    drafter: Drafter,
    target_tensors: Mapping[str, np.ndarray] | None = None,
    *,
    steps: int = 4,
    context: int = 12,
    seed: int = 0,
) -> dict[str, Any]:
    """The parity report of any drafter (see `eagle3_parity`; block drafters compare one whole
    block, so `steps` does not apply to them)."""
    if isinstance(drafter.spec.algorithm, Eagle3):
        return eagle3_parity(drafter, target_tensors, steps=steps, context=context, seed=seed)
    return block_parity(drafter, target_tensors, context=context, seed=seed)


def _check_inputs(spec: DrafterSpec, target_tensors: Mapping | None, steps: int, context: int):
    shared = [
        part
        for part, how in (("lm_head", spec.head.lm_head), ("embedding", spec.head.embedding))
        if how == "shared"
    ]
    if shared and target_tensors is None:
        raise DrafterError(
            f"the drafter shares its {' and '.join(shared)} with the target: give the target"
            " (woodcock parity --target TARGET, or load_target_tensors(TARGET))"
        )
    if steps < 1 or context < 1:
        raise DrafterError(
            f"parity: steps = {steps}, context = {context}: expected at least one of each"
        )


def _pair(drafter: Drafter, target_tensors: Mapping | None, runtime_class: type):
    """(torch, the reference, the runtime drafter `runtime_class`), both in fp32."""
    try:
        import torch

        from woodcock.reference import TorchDrafter
    except ImportError:
        raise DrafterError(
            "parity needs PyTorch for the reference: pip install -e '.[torch]'"
        ) from None
    reference = TorchDrafter(drafter, target_tensors, dtype=torch.float32)
    return torch, reference, runtime_class(drafter, target_tensors, dtype=mx.float32)


def _random_taps(spec: DrafterSpec, context: int, rng: np.random.Generator) -> np.ndarray:
    width = len(spec.taps.layer_ids) * spec.target.hidden_size
    return rng.standard_normal((context, width), dtype=np.float32)


@contextmanager
def _layer_outputs(reference: Any) -> Iterator[list]:
    """The output of each of the reference's layers, appended as the forward runs them."""
    captured: list = []
    hooks = [
        layer.register_forward_hook(lambda _module, _args, out: captured.append(out[0]))
        for layer in reference.layers
    ]
    try:
        yield captured
    finally:
        for hook in hooks:
            hook.remove()


def _report(
    algorithm: str,
    context: int,
    steps: int,
    seed: int,
    rows: list[dict[str, Any]],
    mlx_tokens: list[int],
    torch_tokens: list[int],
) -> dict[str, Any]:
    worst = max(row["max_abs_diff"] for row in rows)
    agree = mlx_tokens == torch_tokens
    return {
        "algorithm": algorithm,
        "dtype": "float32",
        "context": context,
        "steps": steps,
        "seed": seed,
        "tolerance": TOLERANCE,
        "tensors": rows,
        "tokens": {"mlx": mlx_tokens, "torch": torch_tokens, "agree": agree},
        "max_abs_diff": worst,
        "ok": bool(worst <= TOLERANCE and agree),
        "backend": backend_report(),
    }


def _row(name: str, mlx_value: mx.array, torch_value: Any) -> dict[str, Any]:
    a = np.array(mlx_value.astype(mx.float32))
    b = torch_value.detach().float().numpy()
    if a.shape != b.shape:
        raise DrafterError(f"parity: {name}: MLX shape {list(a.shape)}, torch {list(b.shape)}")
    return {"name": name, "shape": list(a.shape), "max_abs_diff": float(np.abs(a - b).max())}


def eagle3_parity(
    drafter: Drafter,
    target_tensors: Mapping[str, np.ndarray] | None = None,
    *,
    steps: int = 4,
    context: int = 12,
    seed: int = 0,
) -> dict[str, Any]:
    """Run `Eagle3Drafter` and `TorchDrafter` on the same random taps [context, A*Ht] and target
    tokens [context + 1] (fp32 both).

    Compared: the fused features, each layer's output and the fed-back state of one forward over
    all context rows, the logits of every context row, then a greedy chain of `steps` steps run
    through the loop's API (add_context, propose) against the reference's `eagle3_draft`: each
    step's logits and the drafted tokens. `ok` is every max |diff| <= TOLERANCE and equal tokens.
    """
    spec = drafter.spec
    _check_inputs(spec, target_tensors, steps, context)
    torch, reference, runtime = _pair(drafter, target_tensors, Eagle3Drafter)

    rng = np.random.default_rng(seed)
    taps = _random_taps(spec, context, rng)
    tokens = rng.integers(0, spec.target.vocab_size, size=context + 1)
    t_taps, t_tokens = torch.from_numpy(taps), torch.from_numpy(tokens)
    m_taps, m_tokens = mx.array(taps), mx.array(tokens.astype(np.int32))

    # One forward over all context rows, every row kept, layer outputs captured by hooks.
    with _layer_outputs(reference) as captured:
        t_fused = reference.fuse(t_taps)
        t_out = reference.eagle3_forward(
            t_tokens[1:], t_fused, torch.arange(1, context + 1), reference.new_cache()
        )
    model, outputs = runtime.model, []
    m_fused = model.fuse(m_taps)
    caches = [KVCache() for _ in spec.layers]
    x = model(
        m_tokens[1:], m_fused, caches, context_rows=0, chain=False, out_rows=None, collect=outputs
    )
    m_logits, m_state = model.head(x)
    rows = [_row("fused", m_fused, t_fused)]
    rows += [
        _row(f"layers.{i} output", m, t)
        for i, (m, t) in enumerate(zip(outputs, captured, strict=True))
    ]
    rows.append(_row("fed-back state", m_state, t_out.hidden))
    rows.append(_row("logits, context rows", m_logits, t_out.logits))

    # The greedy chain, through the decoding loop's API.
    result = reference.eagle3_draft(t_taps, t_tokens, steps)
    runtime.add_context(m_tokens[1:], m_taps)
    drafted, logits = runtime.propose(steps, lambda row: mx.argmax(row))
    rows += [_row(f"logits, step {j + 1}", logits[j], result.logits[j]) for j in range(steps)]
    mlx_tokens = np.array(drafted).tolist()
    torch_tokens = result.tokens.tolist()
    return _report(spec.algorithm.name, context, steps, seed, rows, mlx_tokens, torch_tokens)


def block_parity(
    drafter: Drafter,
    target_tensors: Mapping[str, np.ndarray] | None = None,
    *,
    context: int = 12,
    seed: int = 0,
) -> dict[str, Any]:
    """Run `BlockDrafter` and `TorchDrafter` on the same random taps [context, A*Ht] and a random
    anchor (fp32 both).

    Compared: the fused context, each layer's output and the post-norm states of the block
    [anchor, MASK x (B-1)], the backbone logits of every slot, then one proposal through the
    loop's API (add_context, propose with argmax): the logits each draft was sampled from
    (DSpark: with the Markov bias, against the reference's `markov_heads` fed the same previous
    tokens) and the confidence, and the greedy drafts against `block_draft`. `ok` is every max
    |diff| <= TOLERANCE and equal drafts.
    """
    spec = drafter.spec
    algorithm = spec.algorithm
    if not isinstance(algorithm, DFlash):
        raise DrafterError(
            f"block_parity: algorithm = {algorithm.name!r}: expected a block drafter"
        )
    _check_inputs(spec, target_tensors, 1, context)
    torch, reference, runtime = _pair(drafter, target_tensors, BlockDrafter)

    rng = np.random.default_rng(seed)
    taps = _random_taps(spec, context, rng)
    # Only the last token (the anchor) matters to a block drafter.
    tokens = rng.integers(0, spec.target.vocab_size, size=context)
    anchor = int(tokens[-1])
    size, first = algorithm.block_size, 0 if algorithm.sample_from_anchor else 1
    t_taps = torch.from_numpy(taps)

    # The block forward, every layer's output captured.
    with _layer_outputs(reference) as captured:
        t_fused = reference.fuse(t_taps)
        block_ids = torch.cat(
            (torch.tensor([anchor]), torch.full((size - 1,), algorithm.mask_token_id))
        )
        t_out = reference.block_forward(
            t_fused, torch.arange(context), block_ids, torch.arange(context, context + size)
        )
    m_fused = runtime.fuse(mx.array(taps))
    runtime.add_context(mx.array(tokens.astype(np.int32)), mx.array(taps))
    outputs: list[mx.array] = []
    m_hidden = runtime.block_hidden(collect=outputs)
    rows = [_row("fused context", m_fused, t_fused)]
    rows += [
        _row(f"layers.{i} output", m, t)
        for i, (m, t) in enumerate(zip(outputs, captured, strict=True))
    ]
    rows.append(_row("block hidden (post-norm)", m_hidden, t_out.hidden))
    rows.append(_row("backbone logits", runtime.logits(m_hidden), t_out.logits))

    # One proposal through the loop's API, and the reference's heads on the same drafts.
    drafted, logits = runtime.propose(runtime.num_drafts, lambda row: mx.argmax(row))
    mlx_tokens = np.array(drafted).tolist()
    before = [anchor] * (1 + first) + mlx_tokens[: size - 1 - first]
    t_logits, t_confidence = reference.markov_heads(
        t_out.hidden, t_out.logits, torch.tensor(before)
    )
    is_dspark = isinstance(algorithm, DSpark) and algorithm.markov_rank > 0
    name = "draft logits (with Markov bias)" if is_dspark else "draft logits"
    rows.append(_row(name, logits, t_logits[first:]))
    if runtime.last_confidence is not None:
        rows.append(_row("confidence", runtime.last_confidence, t_confidence[first:]))
    torch_tokens = reference.block_draft(t_taps, anchor).tokens.tolist()
    return _report(
        algorithm.name, context, runtime.num_drafts, seed, rows, mlx_tokens, torch_tokens
    )


def render_text(report: dict[str, Any]) -> str:
    """The report as a small table."""
    tensors = report["tensors"]
    name_width = max(len("tensor"), *(len(row["name"]) for row in tensors))
    shape_width = max(len("shape"), *(len(str(row["shape"])) for row in tensors))
    lines = [
        f"{report['algorithm']}: MLX runtime vs torch reference, {report['dtype']},"
        f" {report['context']} context rows, {report['steps']} greedy steps, seed {report['seed']};"
        f" {describe_backend(report['backend'])}",
        f"{'tensor':<{name_width}}  {'shape':<{shape_width}}  max |diff|",
    ]
    for row in tensors:
        flag = "" if row["max_abs_diff"] <= report["tolerance"] else "  > tolerance"
        lines.append(
            f"{row['name']:<{name_width}}  {str(row['shape']):<{shape_width}}"
            f"  {row['max_abs_diff']:.2e}{flag}"
        )
    tokens = report["tokens"]
    lines.append(
        f"greedy tokens: MLX {tokens['mlx']}, torch {tokens['torch']}:"
        f" {'agree' if tokens['agree'] else 'DIFFER'}"
    )
    verdict = "OK" if report["ok"] else "FAIL"
    lines.append(
        f"{verdict}: max |diff| {report['max_abs_diff']:.2e}, tolerance {report['tolerance']:.0e}"
    )
    return "\n".join(lines)
