"""`woodcock doctor`: is this drafter right for this target? Everything that can be checked
without a benchmark, in a few seconds.

Static checks compare the drafter with the target it will run on: shape (vocab, hidden size,
layer count), taps within the target's layers, a copied embedding or head against the target's
own rows (through the vocabulary map), the vocabulary map against the tokens the target emits,
and RoPE and norm epsilon against the target's config. Then the drafter is run teacher-forced
along the target's own greedy answers to a few built-in prompts: at every answer position it
drafts a chain (or a block) from the target's hidden states, and its step-k draft is compared
with the target's greedy token, counted only where steps 1..k-1 all matched (the acceptance rate
of greedy speculative decoding, as `woodcock train` reports it on its hold-out).

A drafter agreeing under 10 % at step 1 is almost always mis-converted rather than merely weak.
Doctor then re-runs the same measurement on in-memory variants of the drafter (taps shifted by
one, norm flags flipped, the target's embedding in place of the copied one, head rows reordered
to the target rows they resemble) and ranks the likely causes by what each variant recovers.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from woodcock.converters import layer_ids
from woodcock.default_target import default_target_path
from woodcock.errors import DrafterError
from woodcock.formats.hf_config import read_rope
from woodcock.ir import Drafter, DrafterSpec, Eagle3, VocabMap, Weights
from woodcock.jsonfile import read_json_object
from woodcock.loading import load_drafter_with_format, resolve_source
from woodcock.runtime.backend import describe as describe_backend
from woodcock.runtime.backend import report as backend_report
from woodcock.runtime.generate import encode_prompt
from woodcock.runtime.session import runtime_drafter
from woodcock.runtime.target import MlxTarget
from woodcock.target_checkpoint import load_mlx_target

# Short, varied and fixed, so that two runs of doctor measure the same thing.
PROMPTS = (
    "What is the capital of France?",
    "Write a Python function that returns the sum of a list.",
    "Explain in two sentences why the sky is blue.",
    "List the first five prime numbers.",
)
ANSWER_TOKENS = 32
MISCONVERTED_BELOW = 0.10  # step-1 agreement
COPY_COSINE = 0.98  # a copied row (after a float cast) is at least this close to the original
VOCAB_COVERAGE = 0.80  # share of the target's emitted tokens (by occurrence) the draft vocab holds
HEAD_SAMPLE_ROWS = 256
# a variant "fits clearly better" when its first drafts give the target's token this much more
# log-probability on average (nats) and agree at least as often
LOGPROB_GAIN = 0.05
VARIANT_TEXT = {
    "taps-1": "with its tap ids one lower",
    "taps+1": "with its tap ids one higher",
    "flip:norm_before_residual": "with norm_before_residual flipped",
    "flip:norm_output": "with norm_output flipped",
    "tap_norm:per_tap": "with a (unit) norm on each tap",
    "target_embedding": "with the target's embedding",
    "reordered_head": "with its head rows reordered to the target rows they resemble",
}


# ---------------------------------------------------------------------------------------------
# The report


def _finding(check: str, message: str) -> dict:
    return {"check": check, "message": message}


def diagnose(
    target: str | None,
    drafter: str,
    *,
    taps: Sequence[int] | None = None,
    retap: Sequence[int] | None = None,
    prompts: Sequence[str] = PROMPTS,
    answer_tokens: int = ANSWER_TOKENS,
    steps: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """The doctor's report on `drafter` (directory or id) for `target` (mlx-lm directory or id;
    None: the default target). taps: canonical ids for a format that does not record them;
    retap: canonical ids to use instead of the recorded ones (to test a suspected off-by-one
    before `convert --retap`). Raises DrafterError when either cannot be loaded at all."""
    say = progress or (lambda _: None)
    if target is None:
        target = str(default_target_path())
    ir, fmt = load_drafter_with_format(drafter, taps=taps)
    if retap is not None:
        ir = layer_ids.retap(ir, retap)
    target_dir = resolve_source(target)
    say("loading the target")
    model, tokenizer = load_mlx_target(target_dir)
    model.set_dtype(mx.float32)  # the measurement, not the speed, matters here
    spec = ir.spec
    report: dict = {
        "target": str(target),
        "drafter": str(drafter),
        "format": fmt.NAME,
        "algorithm": spec.algorithm.name,
        "taps": list(spec.taps.layer_ids),
        "backend": backend_report(),
        "checks": {},
        "findings": [],
        "likely_causes": [],
    }
    findings = report["findings"]
    config = _target_config(target_dir)
    layers = len(model.layers)
    shape = _check_shape(spec, model, layers, config)
    report["checks"]["shape"] = shape
    findings += shape["findings"]
    tap_check = _check_taps(spec, layers)
    report["checks"]["taps"] = tap_check
    findings += tap_check["findings"]
    if shape["findings"] or tap_check["findings"]:
        # the drafter cannot run on this target: nothing further can be measured
        report["likely_causes"] = _ranked_causes(report, ir, None, {}, target, drafter)
        return _finish(report)

    shared = MlxTarget(model, ()).shared_tensors()
    report["checks"]["rope_and_norms"] = _check_rope_and_norms(spec, config)
    findings += report["checks"]["rope_and_norms"]["findings"]
    embedding = _check_embedding(ir, shared)
    report["checks"]["embedding"] = embedding
    findings += embedding["findings"]
    head = _check_head(ir, shared)
    report["checks"]["lm_head"] = head
    findings += head["findings"]

    say("generating the target's answers")
    sequences = []
    for text in prompts:
        ids = encode_prompt(tokenizer, text)
        answer = _greedy(model, ids, answer_tokens, set(_eos_ids(tokenizer)))
        sequences.append((ids, answer))
    vocab = _check_vocab(ir, [a for _, a in sequences])
    report["checks"]["vocab_map"] = vocab
    findings += vocab["findings"]

    steps = steps or _default_steps(spec)
    say("measuring teacher-forced agreement")
    states = target_states(model, sequences)
    agreement = measure_agreement(ir, shared, states, steps)
    report["agreement"] = agreement
    first = agreement["by_step"][0] if agreement["by_step"] else 0.0
    if first < MISCONVERTED_BELOW:
        findings.append(
            _finding(
                "agreement",
                f"step-1 agreement {first:.1%} (under {MISCONVERTED_BELOW:.0%}): the drafter is"
                " probably mis-converted, or made for another target",
            )
        )
    # A drafter can look fine and still read the wrong layers: adjacent layers' states are
    # alike, so agreement barely moves. Each variant's first draft is scored by the
    # log-probability it gives the target's token; one that fits clearly better is a finding.
    say("trying variants of the drafter")
    variants = {
        name: measure_agreement(variant, shared, states, 1)
        for name, variant in _variants(ir, shared, layers, head).items()
    }
    report["variants"] = {
        name: {"step1_agreement": v["by_step"][0], "step1_logprob": v["step1_logprob"]}
        for name, v in variants.items()
    }
    base_logprob = agreement["step1_logprob"]
    for name, v in variants.items():
        if _clearly_better(v, first, base_logprob):
            findings.append(
                _finding(
                    "variant",
                    f"the drafter fits the target better {VARIANT_TEXT.get(name, name)}:"
                    f" first-draft log-probability of the target's token {base_logprob:.2f} ->"
                    f" {v['step1_logprob']:.2f}, step-1 agreement {first:.1%} ->"
                    f" {v['by_step'][0]:.1%}",
                )
            )
    report["likely_causes"] = _ranked_causes(report, ir, variants, head, target, drafter)
    return _finish(report)


def _clearly_better(variant: dict, agreement: float, logprob: float | None) -> bool:
    """More agreement, or (for a drafter that agrees at all, where log-probabilities mean
    something) clearly more probability on the target's tokens at no loss of agreement."""
    gain = variant["by_step"][0] - agreement
    if gain > 0.05:
        return True
    if agreement < MISCONVERTED_BELOW or variant["step1_logprob"] is None or logprob is None:
        return False
    return variant["step1_logprob"] - logprob > LOGPROB_GAIN and gain >= 0


def _finish(report: dict) -> dict:
    report["healthy"] = not report["findings"]
    report["exit_code"] = 0 if report["healthy"] else 1
    return report


# ---------------------------------------------------------------------------------------------
# Static checks


def _target_config(target_dir: Path) -> dict:
    config = read_json_object(Path(target_dir) / "config.json")
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def _check_shape(spec: DrafterSpec, model, layers: int, config: dict) -> dict:
    probe = MlxTarget(model, ())
    facts = {
        "vocab_size": (spec.target.vocab_size, probe.vocab_size),
        "hidden_size": (spec.target.hidden_size, probe.hidden_size),
        "num_hidden_layers": (spec.target.num_hidden_layers, layers),
    }
    findings = []
    for key, (drafter_value, target_value) in facts.items():
        if drafter_value is not None and drafter_value != target_value:
            findings.append(
                _finding(
                    "shape",
                    f"the drafter was built for a target with {key} {drafter_value}; this target"
                    f" has {target_value} (wrong target?)",
                )
            )
    return {
        "drafter": {k: v[0] for k, v in facts.items()},
        "target": {k: v[1] for k, v in facts.items()},
        "findings": findings,
    }


def _check_taps(spec: DrafterSpec, layers: int) -> dict:
    ids = spec.taps.layer_ids
    bad = [i for i in ids if not 0 <= i <= layers]
    findings = []
    if bad:
        findings.append(
            _finding(
                "taps",
                f"tap ids {list(ids)}: {bad} outside [0, {layers}] (the target has {layers}"
                " layers; id L = residual stream after L layers)",
            )
        )
    return {"layer_ids": list(ids), "target_layers": layers, "findings": findings}


def _check_rope_and_norms(spec: DrafterSpec, config: dict) -> dict:
    """Draft layers attend over the target's positions: their RoPE is the target's. The norm
    epsilon is the target family's too (every published drafter copies it)."""
    findings = []
    try:
        theta, scaling = read_rope(config)
    except DrafterError as e:
        return {"findings": [], "skipped": f"the target's RoPE could not be read ({e})"}
    eps = config.get("rms_norm_eps", config.get("layer_norm_epsilon"))
    for i, layer in enumerate(spec.layers):
        if not np.isclose(layer.rope_theta, theta, rtol=1e-6):
            findings.append(
                _finding(
                    "rope",
                    f"layers[{i}].rope_theta = {layer.rope_theta:g}; the target's is {theta:g}",
                )
            )
        if (layer.rope_scaling or None) != (scaling or None):
            findings.append(
                _finding(
                    "rope",
                    f"layers[{i}].rope_scaling = {json.dumps(layer.rope_scaling)}; the target's is"
                    f" {json.dumps(scaling)}",
                )
            )
        if isinstance(eps, int | float) and not np.isclose(layer.rms_norm_eps, eps, rtol=1e-3):
            findings.append(
                _finding(
                    "norms",
                    f"layers[{i}].rms_norm_eps = {layer.rms_norm_eps:g}; the target's is {eps:g}",
                )
            )
    return {
        "target": {"rope_theta": theta, "rope_scaling": scaling, "rms_norm_eps": eps},
        "findings": findings,
    }


def _row_cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = np.asarray(a, np.float32)
    b = np.asarray(b, np.float32)
    dots = np.einsum("ij,ij->i", a, b)
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    # two zero rows are the same row
    return np.where(norms > 0, dots / np.maximum(norms, 1e-30), np.where(dots == 0, 1.0, 0.0))


def _check_embedding(ir: Drafter, shared: dict) -> dict:
    """A drafter's own embedding is a copy of the target's (EAGLE-3 and DFlash freeze it):
    rows that differ mean the export wrote some other matrix (a random init, another model's)."""
    if ir.spec.head.embedding == "shared":
        return {"kind": "shared", "findings": []}
    cosines = _row_cosines(ir.weights["embed_tokens.weight"], shared["embed_tokens.weight"])
    differing = np.flatnonzero(cosines < COPY_COSINE)
    findings = []
    if differing.size > 0.005 * cosines.size:
        findings.append(
            _finding(
                "embedding",
                f"embed_tokens.weight: {differing.size} of {cosines.size} rows differ from the"
                f" target's embedding (mean cosine {cosines.mean():.3f}, e.g. token"
                f" {int(differing[0])}); a drafter's own embedding should be a copy of the"
                " target's (a random or foreign matrix in the export?)",
            )
        )
    return {
        "kind": "own",
        "mean_cosine": float(cosines.mean()),
        "rows_differing": int(differing.size),
        "findings": findings,
    }


def _check_head(ir: Drafter, shared: dict) -> dict:
    """An own head is usually initialised from (or is) the target's rows of the draft
    vocabulary, and stays closest to them. A head whose rows each resemble some *other* target
    row than the map names has its rows and its map out of order (a permuted d2t)."""
    spec = ir.spec
    if spec.head.lm_head == "shared":
        return {"kind": "shared", "findings": []}
    head = np.asarray(ir.weights["lm_head.weight"], np.float32)
    target_head = np.asarray(shared["lm_head.weight"], np.float32)
    if spec.hidden_size != spec.target.hidden_size:
        return {"kind": "own", "findings": [], "skipped": "hidden sizes differ"}
    ids = ir.vocab.target_ids(spec)
    mapped = _row_cosines(head, target_head[ids])
    rng = np.random.default_rng(0)
    sample = np.sort(rng.choice(len(ids), size=min(HEAD_SAMPLE_ROWS, len(ids)), replace=False))
    rows = head[sample]
    unit_rows = rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-30)
    unit_target = target_head / np.maximum(
        np.linalg.norm(target_head, axis=1, keepdims=True), 1e-30
    )
    similarity = unit_rows @ unit_target.T  # [sample, V]
    best = similarity.argmax(axis=1)
    best_cos = similarity[np.arange(len(sample)), best]
    # a row that plainly belongs to another target token than the one it is mapped to
    elsewhere = (best != ids[sample]) & (best_cos > 0.5) & (best_cos > mapped[sample] + 0.2)
    result = {
        "kind": "own",
        "mean_cosine_to_mapped_rows": float(mapped.mean()),
        "rows_resembling_other_tokens": float(elsewhere.mean()),
        "findings": [],
    }
    if elsewhere.mean() > 0.5:
        i = int(np.flatnonzero(elsewhere)[0])
        result["findings"].append(
            _finding(
                "vocab_map",
                f"lm_head.weight rows and the vocabulary map are out of order:"
                f" {elsewhere.mean():.0%} of sampled draft rows resemble another target token's"
                f" head row than the one the map names (draft row {int(sample[i])} is mapped to"
                f" token {int(ids[sample[i]])} but looks like token {int(best[i])}; permuted"
                " d2t?)",
            )
        )
        result["reordered_ids"] = _reordered_ids(head, unit_target, len(ids))
    return result


def _reordered_ids(head: np.ndarray, unit_target: np.ndarray, count: int) -> list[int] | None:
    """For every draft row, the target row it resembles most; None when that is not an
    injection (then no reordering of the rows can be read off the head)."""
    best = np.empty(count, np.int64)
    for start in range(0, count, 1024):
        rows = head[start : start + 1024]
        rows = rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-30)
        best[start : start + 1024] = (rows @ unit_target.T).argmax(axis=1)
    return best.tolist() if len(set(best.tolist())) == count else None


def _check_vocab(ir: Drafter, answers: Sequence[Sequence[int]]) -> dict:
    """The map is an injection into the target vocabulary by construction (the IR refuses
    anything else); what remains is whether it holds the tokens the target actually emits.
    Counted by occurrence: a truncated head misses rare tokens by design, a map built for
    another tokenizer or corpus misses common ones."""
    emitted = np.array([t for answer in answers for t in answer], np.int64)
    ids = ir.vocab.target_ids(ir.spec)
    if emitted.size == 0:
        return {"coverage": None, "findings": []}
    inside = np.isin(emitted, ids)
    coverage = float(inside.mean())
    findings = []
    if coverage < VOCAB_COVERAGE:
        missing = list(dict.fromkeys(emitted[~inside].tolist()))[:5]
        findings.append(
            _finding(
                "vocab_map",
                f"the draft vocabulary ({ir.spec.draft_vocab_size} tokens) holds only"
                f" {coverage:.0%} of the tokens the target emitted on doctor's prompts (missing"
                f" e.g. {missing}); a map built for another tokenizer or corpus?",
            )
        )
    return {
        "draft_vocab_size": ir.spec.draft_vocab_size,
        "emitted_tokens": int(emitted.size),
        "coverage": coverage,
        "findings": findings,
    }


# ---------------------------------------------------------------------------------------------
# Teacher-forced agreement


def _eos_ids(tokenizer) -> list[int]:
    ids = getattr(tokenizer, "eos_token_ids", None)
    if ids:
        return list(ids)
    single = getattr(tokenizer, "eos_token_id", None)
    return [] if single is None else [single]


def _greedy(model, prompt: Sequence[int], max_tokens: int, eos: set[int]) -> list[int]:
    """The target's own greedy answer (plain decoding, its own KV cache), EOS excluded."""
    cache = make_prompt_cache(model)
    logits = model(mx.array(prompt)[None], cache=cache)[0, -1]
    answer: list[int] = []
    while len(answer) < max_tokens:
        token = int(mx.argmax(logits).item())
        if token in eos:
            break
        answer.append(token)
        logits = model(mx.array([token])[None], cache=cache)[0, -1]
    return answer


def _default_steps(spec: DrafterSpec) -> int:
    if spec.is_block:
        return min(spec.algorithm.num_drafts, 8)
    return max(4, spec.algorithm.speculative_tokens)


def target_states(model, sequences: Sequence[tuple[list[int], list[int]]]) -> list[dict]:
    """One target forward per (prompt, answer): the residual stream after every layer count
    (ids 0..N, so that any taps can be read off it) and the target's greedy token at every
    position."""
    target = MlxTarget(model, tuple(range(len(model.layers) + 1)))
    out = []
    for prompt, answer in sequences:
        if not answer:
            continue
        sequence = list(prompt) + list(answer)
        target.reset()
        logits, states = target.forward(mx.array(sequence))
        states = states.reshape(len(sequence), target.num_layers + 1, -1)
        greedy = mx.argmax(logits, axis=-1)
        mx.eval(states, greedy)
        # greedy[t]: the target's token t+1
        out.append(
            {
                "sequence": sequence,
                "prompt": len(prompt),
                "states": states,
                "greedy": np.array(greedy),
            }
        )
    return out


def measure_agreement(ir: Drafter, shared: dict, states: Sequence[dict], steps: int) -> dict:
    """Teacher-forced greedy agreement by draft step, and the mean log-probability the first
    draft gives the target's token (a finer measure than agreement, to compare variants). At
    every answer position the drafter gets the context the decoding loop would give it (tokens
    and the target's tapped states up to there) and drafts `steps` tokens; step k counts where
    steps 1..k-1 matched the target's greedy tokens."""
    drafter = runtime_drafter(ir, shared)
    rows = np.full(ir.spec.target.vocab_size, -1, np.int64)
    head_ids = np.array(drafter.head_target_ids)
    rows[head_ids] = np.arange(len(head_ids))
    ids = mx.array(np.array(ir.spec.taps.layer_ids, np.int32))
    hits, tried = np.zeros(steps, np.int64), np.zeros(steps, np.int64)
    logprobs: list[float] = []

    def argmax(logits):
        return mx.argmax(logits, axis=-1)

    for item in states:
        sequence, greedy, p = item["sequence"], item["greedy"], item["prompt"]
        taps = item["states"][:, ids, :].reshape(len(sequence), -1)
        drafter.reset()
        # the anchor (first answer token) sits at position p
        drafter.add_context(mx.array(sequence[1 : p + 1], mx.int32), taps[:p])
        while p < len(sequence) - 1:
            k = min(steps, len(sequence) - 1 - p)
            drafts, logits = drafter.propose(k, argmax)
            first = logits[0].astype(mx.float32)
            first = first - mx.logsumexp(first)
            drafts = np.array(drafts)
            row = rows[greedy[p]]
            if row >= 0:
                logprobs.append(float(first[int(row)].item()))
            for j in range(k):
                tried[j] += 1
                if drafts[j] != greedy[p + j]:
                    break
                hits[j] += 1
            drafter.add_context(mx.array([sequence[p + 1]], mx.int32), taps[p : p + 1])
            p += 1
    return {
        "by_step": [float(h / t) if t else 0.0 for h, t in zip(hits, tried, strict=True)],
        "step1_logprob": float(np.mean(logprobs)) if logprobs else None,
        "positions": int(tried[0]) if steps else 0,
        "steps": steps,
    }


# ---------------------------------------------------------------------------------------------
# What went wrong


def _variants(ir: Drafter, shared: dict, layers: int, head: dict) -> dict[str, Drafter]:
    """In-memory variants, each undoing one usual conversion mistake."""
    spec, variants = ir.spec, {}
    ids = spec.taps.layer_ids
    for shift in (-1, 1):
        moved = tuple(i + shift for i in ids)
        if all(0 <= i <= layers for i in moved):
            variants[f"taps{shift:+d}"] = layer_ids.retap(ir, moved)
    if isinstance(spec.algorithm, Eagle3):
        for flag in ("norm_before_residual", "norm_output"):
            flipped = dataclasses.replace(
                spec.algorithm, **{flag: not getattr(spec.algorithm, flag)}
            )
            variants[f"flip:{flag}"] = Drafter(
                dataclasses.replace(spec, algorithm=flipped), ir.vocab, ir.weights
            )
    if spec.fusion.tap_norm == "none":
        ones = np.ones(spec.target.hidden_size, np.float32)
        weights = dict(ir.weights) | {f"fc_norm.{j}.weight": ones for j in range(len(ids))}
        fusion = dataclasses.replace(spec.fusion, tap_norm="per_tap")
        variants["tap_norm:per_tap"] = Drafter(
            dataclasses.replace(spec, fusion=fusion), ir.vocab, Weights(weights)
        )
    if spec.head.embedding == "own":
        embedding = shared["embed_tokens.weight"].astype(ir.weights["embed_tokens.weight"].dtype)
        weights = dict(ir.weights) | {"embed_tokens.weight": embedding}
        variants["target_embedding"] = Drafter(spec, ir.vocab, Weights(weights))
    reordered = head.get("reordered_ids")
    if reordered is not None:
        order = np.argsort(reordered)
        new_ids = np.array(reordered, np.int64)[order]
        weights = dict(ir.weights) | {
            "lm_head.weight": np.asarray(ir.weights["lm_head.weight"])[order]
        }
        if spec.draft_vocab_size == spec.target.vocab_size:
            vocab = VocabMap(None, ir.vocab.counts)
        else:
            vocab = VocabMap(new_ids, ir.vocab.counts)
        variants["reordered_head"] = Drafter(spec, vocab, Weights(weights))
    return variants


def _ranked_causes(
    report: dict, ir: Drafter, variants: dict | None, head: dict, target: str, drafter: str
) -> list[dict]:
    """Causes with evidence first (a variant that recovers agreement, a static finding), then
    those left to test, in the order they are usually met."""
    if report["healthy"] if "healthy" in report else not report["findings"]:
        return []
    spec = ir.spec
    ids = list(spec.taps.layer_ids)
    agreement = report.get("agreement") or {}
    base = (agreement.get("by_step") or [0.0])[0]
    base_logprob = agreement.get("step1_logprob")
    causes: list[dict] = []

    def gains(name: str) -> tuple[float, float]:
        v = variants[name]
        logprob_gain = (
            v["step1_logprob"] - base_logprob
            if v["step1_logprob"] is not None and base_logprob is not None
            else 0.0
        )
        return v["by_step"][0] - base, logprob_gain

    def add(cause: str, command: str, variant: str | None = None, evidence: str | None = None):
        entry = {"cause": cause, "test": command}
        if variant is not None and variants and variant in variants:
            v = variants[variant]
            entry["variant"] = variant
            entry["variant_step1_agreement"] = v["by_step"][0]
            entry["variant_step1_logprob"] = v["step1_logprob"]
            agreement_gain, logprob_gain = gains(variant)
            if _clearly_better(v, base, base_logprob):
                entry["evidence"] = (
                    f"with this undone: step-1 agreement {base:.1%} -> {v['by_step'][0]:.1%},"
                    f" first-draft log-probability {logprob_gain:+.2f} nats"
                )
            else:
                entry["evidence"] = (
                    f"undoing it does not help (step-1 agreement {v['by_step'][0]:.1%},"
                    f" first-draft log-probability {logprob_gain:+.2f} nats)"
                )
            if evidence is not None:
                entry["evidence"] = f"{evidence}; {entry['evidence']}"
        elif evidence is not None:
            entry["evidence"] = evidence
        causes.append(entry)

    t = f" --target {target}"
    for shift in (-1, 1):
        moved = [i + shift for i in ids]
        moved_text = ",".join(map(str, moved))
        add(
            f"layer-id convention off by one (taps {ids} should be {moved})",
            f"woodcock doctor{t} --drafter {drafter} --retap {moved_text}; to fix:"
            f" woodcock convert {drafter} OUT --to woodcock --retap {moved_text}"
            " (SpecForge, z-lab and DeepSpec store 'output of layer i', canonical i+1)",
            variant=f"taps{shift:+d}",
        )
    if spec.fusion.tap_norm == "none":
        add(
            "tap norm dropped (fc_norm / norm_before_fc lost in the conversion)",
            f"woodcock inspect {drafter} and the source's tensors for fc_norm.*/input_norm;"
            " re-convert: woodcock convert SRC OUT --to woodcock",
            variant="tap_norm:per_tap",
        )
    if isinstance(spec.algorithm, Eagle3):
        for flag in ("norm_before_residual", "norm_output"):
            value = getattr(spec.algorithm, flag)
            add(
                f"norm flag {flag} = {str(value).lower()} should be {str(not value).lower()}",
                f"woodcock inspect {drafter} (compare with the source's config); re-convert with"
                " the source's norm flags: woodcock convert SRC OUT --to woodcock",
                variant=f"flip:{flag}",
            )
    embedding_finding = [f for f in report["findings"] if f["check"] == "embedding"]
    if spec.head.embedding == "own":
        add(
            "the exported embedding is not the target's",
            f"woodcock convert SRC OUT --to woodcock{t} (shares or copies the target's"
            f" embedding), then woodcock doctor{t} --drafter OUT",
            variant="target_embedding",
            evidence=embedding_finding[0]["message"] if embedding_finding else None,
        )
    vocab_findings = [f for f in report["findings"] if f["check"] == "vocab_map"]
    if spec.draft_vocab_size < spec.target.vocab_size or vocab_findings:
        add(
            "vocabulary map missing, permuted or built for another tokenizer",
            f"woodcock inspect {drafter} (the d2t/t2d of the source); re-convert from the"
            " source, or rebuild the map: woodcock vocab count, then woodcock convert SRC OUT"
            " --truncate-vocab N --counts vocab_counts.npz",
            variant="reordered_head",
            evidence="; ".join(f["message"] for f in vocab_findings) or None,
        )
    shape_findings = [f for f in report["findings"] if f["check"] in ("shape", "taps", "rope")]
    recorded = spec.target.name_or_path
    add(
        "made for another target" + (f" (it records {recorded})" if recorded else ""),
        f"woodcock inspect {drafter} (its target facts); woodcock doctor --target"
        f" {recorded or 'THE_RIGHT_TARGET'} --drafter {drafter}",
        evidence="; ".join(f["message"] for f in shape_findings) or None,
    )

    def strength(entry: dict) -> tuple:
        if "variant" in entry:
            agreement_gain, logprob_gain = gains(entry["variant"])
            if _clearly_better(variants[entry["variant"]], base, base_logprob):
                return (0, -agreement_gain, -logprob_gain)
            return (2, 0.0, 0.0)
        if "evidence" in entry:
            return (1, 0.0, 0.0)
        return (2, 0.0, 0.0)

    return sorted(causes, key=strength)  # stable: ties keep the usual order


# ---------------------------------------------------------------------------------------------
# Text


def render_text(report: dict) -> str:
    lines = [
        f"drafter {report['drafter']} ({report['format']}, {report['algorithm']},"
        f" taps {report['taps']})",
        f"target  {report['target']}",
        f"backend {describe_backend(report['backend'])}",
    ]
    checks = report["checks"]
    shape = checks.get("shape", {})
    if shape:
        target = shape["target"]
        lines.append(
            f"shape: vocab {target['vocab_size']}, hidden {target['hidden_size']}, layers"
            f" {target['num_hidden_layers']}" + (" - mismatch" if shape["findings"] else " - ok")
        )
    if "taps" in checks:
        lines.append(
            "taps: "
            + ("out of range" if checks["taps"]["findings"] else "within the target's layers")
        )
    rope = checks.get("rope_and_norms")
    if rope is not None:
        lines.append("rope and norm eps: " + ("differ" if rope["findings"] else "match the target"))
    for part in ("embedding", "lm_head"):
        check = checks.get(part)
        if check is None:
            continue
        if check["kind"] == "shared":
            lines.append(f"{part}: shared with the target")
        elif part == "embedding":
            lines.append(
                f"embedding: own copy, mean row cosine to the target's {check['mean_cosine']:.3f}"
            )
        elif "mean_cosine_to_mapped_rows" in check:
            lines.append(
                "lm_head: own, mean row cosine to the target's mapped rows"
                f" {check['mean_cosine_to_mapped_rows']:.3f}"
            )
    vocab = checks.get("vocab_map")
    if vocab and vocab.get("coverage") is not None:
        lines.append(
            f"vocab map: {vocab['draft_vocab_size']} draft tokens hold"
            f" {vocab['coverage']:.0%} of the {vocab['emitted_tokens']} tokens the target emitted"
        )
    agreement = report.get("agreement")
    if agreement:
        steps = " ".join(f"{a:.2f}" for a in agreement["by_step"])
        lines.append(
            f"teacher-forced agreement by draft step: {steps} ({agreement['positions']} positions)"
        )
    if report.get("variants"):
        tried = ", ".join(
            f"{name} {v['step1_agreement']:.2f}" for name, v in report["variants"].items()
        )
        lines.append(f"step-1 agreement of variants: {tried}")
    if report["healthy"]:
        lines.append("healthy: no findings")
        return "\n".join(lines)
    lines.append(f"findings ({len(report['findings'])}):")
    lines += [f"  - [{f['check']}] {f['message']}" for f in report["findings"]]
    if report["likely_causes"]:
        lines.append("likely causes, most likely first:")
        for n, cause in enumerate(report["likely_causes"], 1):
            lines.append(f"  {n}. {cause['cause']}")
            if cause.get("evidence"):
                lines.append(f"     evidence: {cause['evidence']}")
            lines.append(f"     test: {cause['test']}")
    return "\n".join(lines)
