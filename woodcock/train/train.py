"""`woodcock train`: a drafter for an mlx-lm target, trained on MLX from distilled answers:
EAGLE-3 (the default, below) or, with --algorithm dflash|dspark, a block drafter on the same
answers, feature cache, batches, optimiser and checkpoints (its recipe is in
`woodcock.train.block_trainer`).

The EAGLE-3 recipe ("seed recipe"):

* Shape: one Llama-style decoder layer with the target's hidden size, heads, head_dim and MLP
  width; it reads three taps (canonical ids 2, N//2, N-3 of an N-layer target; spread over
  1, N//2, N when the target is too shallow for those to be distinct) through a per-tap RMSNorm
  and fc; EAGLE-3.1 post-norm feedback (norm_output) and norm_before_residual. The embedding is
  the target's (shared, frozen). The head is truncated to the --head-size target tokens most
  frequent in the training answers (own lm_head rows, initialised from the target's head rows;
  the final norm from the target's final norm), with a VocabMap and the token counts.
* Data: prompt + answer token sequences from `woodcock distill`, cut to --max-len tokens. The
  target runs once over them; its tapped states and its final (post-norm) hidden state are cached
  on disk in fp16 with the target's argmax, and the soft labels are recomputed per batch from the
  final hidden state and the target's head rows of the draft vocabulary (one [rows, Ht] x [Ht, Vd]
  matmul, about 1/(3K+1) of a step). A cache of the draft-vocabulary distribution itself would
  take Vd/Ht (14x for SmolLM2 with an 8k head) more disk and would be tied to one head size.
* Loss: training-time test (EAGLE-3 TTT) with K unrolled steps. Row i is token x_{i+1} with the
  fused target state g_i at position i+1. Step k (0-based) feeds each row its own fed-back state
  from step k-1 and the teacher-forced token x_{i+1+k}, at position i+1+k; it attends to the
  step-0 keys causally and to its own keys of steps 1..k. Its logits are compared with the
  target's distribution at position t = i+1+k (the target's prediction of x_{t+1}), restricted to
  the draft vocabulary and renormalised: soft-label cross-entropy, on rows whose predicted token
  is an answer token (t >= prompt length - 1, t <= last position) and whose target argmax is in
  the draft vocabulary (EAGLE-3's rule), averaged per step, weighted 0.8^k and summed.
* Optimiser: AdamW (betas 0.9, 0.95), linear warm-up then cosine decay to --min-lr-ratio of the
  peak, gradient-norm clipping. Checkpoints (weights, optimizer state, step) every
  --checkpoint-every steps and at the end; --resume continues from the last one and gives the same
  losses as an uninterrupted run (the batch order is a function of the seed and the step).
* --init: start from a trained drafter (any format woodcock reads) instead of random weights;
  its taps and head rows are kept, and it must have exactly the shape this recipe builds. Its own
  training data is not checked against this run's hold-out: hold-out figures are only clean when
  both runs share the distill directory (the split is a function of the sample ids).
* Hold-out: samples whose sha256(id) falls in the lowest --holdout share are never trained on.
  The hold-out agreement at draft step k+1 is the share of hold-out rows where the drafter's
  argmax at TTT step k equals the target's argmax (over the full vocabulary, so a token outside
  the draft head counts as a miss), among rows that start a draft on an answer position (the
  first draft predicts an answer token after the first) and whose drafts at steps 0..k-1 all
  matched the target's argmax and the teacher-forced token. For greedy distilled answers the
  teacher-forced token is then the drafter's own draft, so this is the acceptance rate of greedy
  chain drafting at position k+1 given the k earlier drafts were accepted, the quantity
  `woodcock generate --policy auto` takes as its prior. The unconditional share (every row whose
  step-k target is an answer token) is recorded too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from woodcock.errors import DrafterError
from woodcock.jsonfile import read_json_object
from woodcock.provenance import portable_path, portable_paths
from woodcock.train.block_trainer import BlockRun
from woodcock.train.data import (
    BatchPlan,
    answer_tokens,
    choose_head,
    coverage,
    eval_batches,
    holdout_split,
    load_samples,
    make_batch,
)
from woodcock.train.distill import META
from woodcock.train.features import FEATURES_VERSION, FeatureCache, TargetRunner, target_fingerprint
from woodcock.train.model import (
    build_model,
    build_spec,
    default_taps,
    load_init,
    start_from,
    trained_weights,
)
from woodcock.train.options import Progress, TrainOptions, TrainReport
from woodcock.train.trainer import (
    Trainer,
    checkpoint_state,
    load_checkpoint,
    save_checkpoint,
    trim_log,
)

COVERAGE_SIZES = (1024, 2048, 4096, 8192, 16384, 32768)


def train(opts: TrainOptions, progress: Progress | None = None) -> TrainReport:
    import mlx.core as mx

    from woodcock.formats import native
    from woodcock.ir import Drafter, VocabCounts, VocabMap

    opts.check()
    out = Path(opts.out)
    if out.exists() and not opts.force:
        raise DrafterError(f"{out}: already exists; pass --force to replace it")
    ckpt = opts.checkpoint_dir()
    log_path = ckpt / "log.jsonl"
    if (ckpt / "latest.json").exists() and not opts.resume:
        if not opts.force:
            raise DrafterError(
                f"{ckpt}: holds a checkpoint; pass --resume to continue it or --force to start over"
            )
        shutil.rmtree(ckpt)
    if opts.resume and not (ckpt / "latest.json").exists():
        raise DrafterError(f"{ckpt}: no checkpoint to resume from")
    if opts.target is None:
        from woodcock.default_target import resolve_target

        opts = dataclasses.replace(opts, target=resolve_target(None))

    report = TrainReport()
    samples = load_samples(opts.data, opts.max_len)
    train_samples, holdout = holdout_split(samples, opts.holdout)
    distill_meta = read_json_object(Path(opts.data) / META)

    # The target (its embedding and head rows are needed even when every feature is cached)
    started = time.perf_counter()
    from woodcock.target_checkpoint import target_from_config

    num_layers = target_from_config(opts.target).num_hidden_layers
    init, init_record = load_init(opts) if opts.init is not None else (None, None)
    if opts.taps:
        taps = tuple(opts.taps)
    else:
        taps = init.spec.taps.layer_ids if init is not None else default_taps(num_layers)
    if list(taps) != sorted(set(taps)):
        raise DrafterError(f"--taps {list(taps)}: expected strictly ascending layer ids")
    runner = TargetRunner(opts.target, taps)
    key = {
        "version": FEATURES_VERSION,
        "target": target_fingerprint(opts.target),
        "taps": list(taps),
        "max_len": opts.max_len,
    }
    cache = FeatureCache(Path(opts.data), key, len(taps) * runner.hidden_size, runner.hidden_size)
    cache.open()
    cache.build(samples, runner, progress=progress)
    report.feature_seconds = time.perf_counter() - started
    arrays = cache.arrays()

    # Vocabulary
    vocab = runner.vocab_size
    train_answers, holdout_answers = answer_tokens(train_samples), answer_tokens(holdout)
    counts = np.bincount(train_answers, minlength=vocab).astype(np.int64)
    head_size = opts.draft_head_size()
    if init is None:
        head_ids = None if head_size is None else choose_head(counts, head_size)
    else:
        head_ids = None if init.vocab.draft_to_target is None else init.vocab.draft_to_target
    draft_vocab = vocab if head_ids is None else len(head_ids)
    info = {
        "source": f"woodcock distill answers in {portable_path(opts.data, out)}",
        "split": "training answers (hold-out excluded)",
        "tokens": int(train_answers.size),
        "distinct_tokens": int((counts > 0).sum()),
        "holdout_tokens": int(holdout_answers.size),
        "holdout_coverage": {
            str(size): coverage(counts, holdout_answers, size)
            for size in sorted({*(s for s in COVERAGE_SIZES if s < vocab), draft_vocab})
        },
        "head_size": draft_vocab,
    }
    train_entries = [cache.index[s.id] for s in train_samples]
    holdout_entries = [cache.index[s.id] for s in holdout]
    kind = BlockRun if opts.is_block else Eagle3Run
    run = kind(opts, runner, taps, head_ids, draft_vocab, init, arrays, holdout_entries)
    spec, model = run.spec, run.model
    runner.model = None  # the target's weights are no longer needed: free them
    plan = BatchPlan(train_entries, opts.batch, opts.seed)

    facts = [(s.id, len(s.tokens), s.prompt_length) for s in samples]
    state: dict[str, Any] = {
        "recipe": opts.recipe(),
        "data_sha256": hashlib.sha256(json.dumps(facts).encode()).hexdigest(),
    }
    start_step = 0
    if opts.resume:
        loaded = checkpoint_state(ckpt)
        if loaded.get("data_sha256") != state["data_sha256"]:
            raise DrafterError(
                f"--resume: the answers in {opts.data} changed since the checkpoint in {ckpt}"
                " was made (other samples, another split and head); start over with --force"
            )
        if loaded["recipe"] != state["recipe"]:
            differing = sorted(
                k
                for k in set(loaded["recipe"]) | set(state["recipe"])
                if loaded["recipe"].get(k) != state["recipe"].get(k)
            )
            k = differing[0]
            raise DrafterError(
                f"--resume: the checkpoint in {ckpt} was made with {k} ="
                f" {loaded['recipe'].get(k)!r}, this run asks for {state['recipe'].get(k)!r}"
            )
        load_checkpoint(loaded, model, run.optimizer)
        start_step = int(loaded["step"])
        state["initial"] = loaded.get("initial")
        state["train_seconds"] = loaded.get("train_seconds", 0.0)
        state["train_tokens"] = loaded.get("train_tokens", 0)
        state["last_eval"] = loaded.get("last_eval")
        trim_log(log_path, start_step)
    else:
        ckpt.mkdir(parents=True, exist_ok=True)
        log_path.write_text("", encoding="utf-8")
        initial = run.evaluate()
        state["initial"] = initial
        state["train_seconds"], state["train_tokens"] = 0.0, 0
        state["last_eval"] = None
        _append(log_path, {"step": 0, "eval": initial})
    report.resumed_from = start_step

    # Training
    run_tokens, run_seconds = 0, 0.0
    last = state.get("last_eval")
    final_step = start_step if opts.finish else opts.steps
    for step in range(start_step + 1, final_step + 1):
        t0 = time.perf_counter()
        tokens_in, metrics = run.train_step(plan.at(step), step)
        seconds = time.perf_counter() - t0
        run_tokens += tokens_in
        run_seconds += seconds
        state["train_seconds"] += seconds
        state["train_tokens"] += tokens_in
        report.losses.append(metrics["loss"])
        entry = {
            "step": step,
            **metrics,
            "tokens": tokens_in,
            "seconds": round(seconds, 4),
            "tokens_per_second": round(tokens_in / seconds, 1),
        }
        if step % opts.eval_every == 0 or step == opts.steps:
            last = run.evaluate()
            state["last_eval"] = last
            entry["eval"] = last
        _append(log_path, entry)
        if step % opts.checkpoint_every == 0 or step == opts.steps:
            save_checkpoint(ckpt, step, model, run.optimizer, state)
        if progress:
            progress("training", step, opts.steps)
    report.steps = final_step
    report.train_seconds = run_seconds
    report.train_tokens_per_second = run_tokens / run_seconds if run_seconds else 0.0
    if last is None or opts.finish:  # resumed from the final checkpoint, or stopped early
        last = run.evaluate()
    holdout_record = run.record(report, state["initial"], last)

    # Output
    vocab_map = VocabMap(head_ids, VocabCounts(counts, info))
    drafter = Drafter(spec, vocab_map, trained_weights(model))
    recipe = {**opts.recipe(), "taps": list(taps), "draft_vocab_size": draft_vocab}
    if spec.is_block:
        recipe["mask_token_id"] = spec.algorithm.mask_token_id
    provenance = {
        "trainer": run.name,
        "command": opts.command or [],
        **holdout_record,
        "recipe": recipe,
        **({"init": init_record} if init is not None else {}),
        "data": {
            "dir": str(Path(opts.data).resolve()),
            "distill": {k: distill_meta.get(k) for k in ("target", "max_tokens", "chat", "system")},
            "samples": len(samples),
            "train_samples": len(train_samples),
            "holdout_samples": len(holdout),
            "train_sequence_tokens": int(sum(len(s.tokens) for s in train_samples)),
            "train_answer_tokens": int(train_answers.size),
            "holdout_answer_tokens": int(holdout_answers.size),
        },
        "training": {
            "steps": final_step,
            "planned_steps": opts.steps,
            "tokens_seen": int(state["train_tokens"]),
            "seconds": round(state["train_seconds"], 1),
            "final_loss": report.losses[-1] if report.losses else None,
            "log": str(log_path.resolve()),
        },
        "machine": {"mlx_device": str(mx.default_device()), "python": sys.version.split()[0]},
    }
    native.write(drafter, out, force=opts.force, provenance=portable_paths(provenance, out))
    report.out = out
    return report


class Eagle3Run:
    """One training run's EAGLE-3 drafter: spec, module, trainer and its hold-out batches."""

    name = "woodcock train (seed recipe: EAGLE-3 TTT, soft labels, truncated head)"

    def __init__(self, opts, runner, taps, head_ids, draft_vocab, init, arrays, holdout_entries):
        self.opts, self.arrays, self.holdout = opts, arrays, holdout_entries
        self.spec = build_spec(runner, opts.target, taps, draft_vocab, opts.ttt_steps)
        head_rows = runner.head if head_ids is None else runner.head[head_ids]
        self.model = build_model(
            self.spec, runner.embedding, head_rows, runner.final_norm_weight(), opts.seed
        )
        if init is not None:
            start_from(self.model, init, self.spec, opts.init)
        self.trainer = Trainer(self.model, head_ids, runner.head, opts)
        self.optimizer = self.trainer.optimizer

    def train_step(self, entries, step: int) -> tuple[int, dict[str, Any]]:
        batch = make_batch(self.arrays, entries, self.opts.ttt_steps)
        return batch.tokens_in, self.trainer.train_step(batch)

    def evaluate(self) -> dict[str, Any]:
        return self.trainer.evaluate(eval_batches(self.arrays, self.holdout, self.opts.ttt_steps))

    def record(self, report: TrainReport, initial: dict, last: dict) -> dict[str, Any]:
        report.holdout_agreement_initial = initial["holdout_agreement"]
        report.holdout_agreement = last["holdout_agreement"]
        report.holdout_agreement_unconditional = last["holdout_agreement_unconditional"]
        return {
            "holdout_agreement": report.holdout_agreement,
            "holdout_agreement_definition": (
                "by draft step k = 1..K: share of hold-out rows where the drafter's argmax at"
                " step k equals the target's full-vocabulary argmax, among rows starting a"
                " draft at an answer position whose k-1 earlier drafts all matched the target's"
                " argmax and the teacher-forced (greedy distilled) token: the greedy acceptance"
                " rate at position k given the earlier drafts were accepted"
            ),
            "holdout_agreement_unconditional": report.holdout_agreement_unconditional,
            "holdout_agreement_initial": report.holdout_agreement_initial,
            "holdout_loss_by_step": last["holdout_loss_by_step"],
            "holdout_rows_by_step": last["holdout_rows"],
        }


def _append(path: Path, entry: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(entry) + "\n")
