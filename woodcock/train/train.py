"""`woodcock train`: a drafter for an mlx-lm target, trained on MLX from distilled answers:
EAGLE-3 (the default, its recipe in `woodcock.train.eagle3_trainer`) or, with --algorithm
dflash|dspark, a block drafter (`woodcock.train.block_trainer`). Both take the same steps on the
same answers, feature cache, batches, optimiser and checkpoints:

* Data: prompt + answer token sequences from `woodcock distill`, cut to --max-len tokens. The
  target runs once over them; its tapped states and its final (post-norm) hidden state are cached
  on disk in fp16 with the target's argmax, and the soft labels are recomputed per batch from the
  final hidden state and the target's head rows of the draft vocabulary (one [rows, Ht] x [Ht, Vd]
  matmul, about 1/(3K+1) of a step). A cache of the draft-vocabulary distribution itself would
  take Vd/Ht (14x for SmolLM2 with an 8k head) more disk and would be tied to one head size.
* Optimiser: AdamW (betas 0.9, 0.95), linear warm-up then cosine decay to --min-lr-ratio of the
  peak, gradient-norm clipping. Checkpoints (weights, optimizer state, step) every
  --checkpoint-every steps and at the end; --resume continues from the last one and gives the same
  losses as an uninterrupted run (the batch order is a function of the seed and the step). The
  run's inputs are checked by content, not by path, so a checkpoint folder copied to another
  machine resumes there with the same answers and target wherever they lie. The checkpoints
  may neither hold an input nor OUT, nor lie inside it (--force clears them at the start; OUT is
  replaced whole at the end).
* --init: start from a trained drafter (any format woodcock reads) instead of random weights;
  its taps and head rows are kept, and it must have exactly the shape its recipe builds. Its own
  training data is not checked against this run's hold-out: hold-out figures are only clean when
  both runs share the distill directory (the split is a function of the sample ids).
* Hold-out: samples whose sha256(id) falls in the lowest --holdout share are never trained on;
  each recipe says what it measures on them.
* Several processes (`mlx.launch`, `woodcock.train.distributed`): each takes its share of every
  batch, the step's losses and gradients are summed over them, and the run is the one process
  run, up to the order of floating-point sums. Each evaluates the whole hold-out (the same
  weights give the same figures; the others would wait for rank 0 anyway); rank 0 alone writes
  checkpoints, the log and the drafter, and every rank resumes from the same checkpoint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from woodcock.default_target import resolve_drafter, resolve_target
from woodcock.errors import DrafterError
from woodcock.formats import native
from woodcock.ir import Drafter, VocabCounts, VocabMap
from woodcock.jsonfile import read_json_object
from woodcock.provenance import identity, portable_path, portable_paths, same_content
from woodcock.staging import refuse_replacing_inputs
from woodcock.target_checkpoint import target_from_config
from woodcock.train.block_trainer import BlockRun, anchor_candidates
from woodcock.train.checkpoints import (
    append_log,
    checkpoint_state,
    drafter_weights,
    load_checkpoint,
    remove_partial_checkpoints,
    save_checkpoint,
    trim_log,
)
from woodcock.train.data import (
    BatchPlan,
    Sample,
    answer_tokens,
    choose_head,
    coverage,
    holdout_split,
    load_samples,
)
from woodcock.train.distill import META
from woodcock.train.distributed import Group
from woodcock.train.eagle3_trainer import Eagle3Run
from woodcock.train.features import FEATURES_VERSION, FeatureCache, TargetRunner, target_fingerprint
from woodcock.train.options import Progress, TrainOptions, TrainReport
from woodcock.train.run import RunInputs, TrainingRun
from woodcock.train.target_shape import default_taps
from woodcock.train.warm_start import load_init

COVERAGE_SIZES = (1024, 2048, 4096, 8192, 16384, 32768)
LOG = "log.jsonl"  # in the checkpoint directory


def train(opts: TrainOptions, progress: Progress | None = None) -> TrainReport:
    opts.check()
    group = Group()
    if not group.writes:
        progress = None  # one display: rank 0's
    ckpt = _claim_paths(opts, group.writes)
    if opts.target is None:
        opts = dataclasses.replace(opts, target=resolve_target(None))
    report = TrainReport(wrote=group.writes)
    target_facts = target_from_config(opts.target)
    data = _load_data(opts, target_facts.vocab_size)

    # the target is loaded even when every feature is cached: its embedding and head are needed
    started = time.perf_counter()
    num_layers = target_facts.num_hidden_layers
    init, init_record = load_init(opts) if opts.init is not None else (None, None)
    taps = _taps(opts, init, num_layers)
    runner, cache = _target_features(opts, taps, data, progress, group)
    report.feature_seconds = time.perf_counter() - started

    vocab = _draft_vocabulary(opts, runner.vocab_size, init, data)
    kind: type[TrainingRun] = BlockRun if opts.is_block else Eagle3Run
    holdout_entries = [cache.index[s.id] for s in data.holdout]
    inputs = RunInputs(
        opts,
        runner,
        taps,
        vocab.head_ids,
        vocab.size,
        init,
        cache.arrays(),
        holdout_entries,
        group,
    )
    run = kind(inputs)
    runner.model = None  # the target's weights are no longer needed: free them

    inputs_used = {"target": identity(opts.target), "taps": list(taps)}
    if opts.init is not None:
        inputs_used["init"] = identity(resolve_drafter(opts.init))
    state, start_step = _start_or_resume(opts, run, data, inputs_used, ckpt, group.writes)
    report.resumed_from = start_step
    plan = BatchPlan([cache.index[s.id] for s in data.train], opts.batch, opts.seed)
    last = _train_steps(opts, run, plan, state, start_step, report, progress, group.writes)
    if last is None or opts.finish:  # resumed from the final checkpoint, or stopped early
        last = run.evaluate()
    holdout_record = run.record(report, state["initial"], last)

    if group.writes:
        _write_drafter(
            opts, run, vocab, data, state, report, holdout_record, init_record, group.size
        )
    group.barrier()  # every rank returns once the drafter is written
    report.out = Path(opts.out)
    return report


@dataclass
class TrainingData:
    samples: list[Sample]
    train: list[Sample]
    holdout: list[Sample]
    train_answers: np.ndarray  # the answers' tokens, int64
    holdout_answers: np.ndarray
    distill_meta: dict[str, Any]


@dataclass
class DraftVocabulary:
    head_ids: np.ndarray | None  # target ids of the head rows; None: the whole vocabulary
    size: int
    counts: np.ndarray  # per target token, in the training answers
    info: dict[str, Any]  # what the counts are, for the drafter's VocabCounts


def _claim_paths(opts: TrainOptions, writes: bool) -> Path:
    """The checkpoint directory, once OUT and it may be used as asked (--force clears an
    earlier run's checkpoints: the rank that `writes` does)."""
    out = Path(opts.out)
    inputs = {"answers (--data)": opts.data, "--init drafter": opts.init, "target": opts.target}
    refuse_replacing_inputs(out, inputs)
    ckpt = opts.checkpoint_dir()
    # --force clears the checkpoints at the start and OUT is replaced whole at the end: neither
    # may hold an input, nor the other
    refuse_replacing_inputs(ckpt, inputs, role="checkpoint folder")
    here, there = out.expanduser().resolve(), ckpt.expanduser().resolve()
    if here == there or here in there.parents or there in here.parents:
        raise DrafterError(
            f"{ckpt}: the checkpoint folder and the output {out} must not hold one another"
            " (--force clears the one at the start, the other is replaced whole at the end)"
        )
    if out.exists() and not opts.force:
        raise DrafterError(f"{out}: already exists; pass --force to replace it")
    if (ckpt / "latest.json").exists() and not opts.resume:
        if not opts.force:
            raise DrafterError(
                f"{ckpt}: holds a checkpoint; pass --resume to continue it or --force to start over"
            )
        if writes:
            shutil.rmtree(ckpt)
    if opts.resume and not (ckpt / "latest.json").exists():
        raise DrafterError(f"{ckpt}: no checkpoint to resume from")
    return ckpt


def _load_data(opts: TrainOptions, vocab_size: int) -> TrainingData:
    samples = load_samples(opts.data, opts.max_len, vocab_size=vocab_size)
    train_samples, holdout = holdout_split(samples, opts.holdout)
    if opts.is_block and not any(
        anchor_candidates(len(s.tokens), s.prompt_length, opts.block_size).size
        for s in train_samples
    ):
        raise DrafterError(
            f"--block-size {opts.block_size}: no training answer in {opts.data} has room for a"
            f" block (an answer token and {opts.block_size} more within --max-len"
            f" {opts.max_len}); lower --block-size or raise --max-len"
        )
    distill_meta = read_json_object(Path(opts.data) / META)
    return TrainingData(
        samples,
        train_samples,
        holdout,
        answer_tokens(train_samples),
        answer_tokens(holdout),
        distill_meta,
    )


def _taps(opts: TrainOptions, init: Drafter | None, num_layers: int) -> tuple[int, ...]:
    """--taps, else the drafter started from's, else the default for the target's depth."""
    if opts.taps:
        taps = tuple(opts.taps)
    else:
        taps = init.spec.taps.layer_ids if init is not None else default_taps(num_layers)
    if list(taps) != sorted(set(taps)):
        raise DrafterError(f"--taps {list(taps)}: expected strictly ascending layer ids")
    return taps


def _target_features(
    opts: TrainOptions,
    taps: tuple[int, ...],
    data: TrainingData,
    progress: Progress | None,
    group: Group,
) -> tuple[TargetRunner, FeatureCache]:
    """The loaded target and the cache of its features over every sample, built where missing.

    The ranks of a distributed run take turns, in rank order, to open the cache and compute what
    it lacks (opening it writes too): on one machine rank 0 computes it all and the others find
    it complete; a rank on another machine, with a data directory of its own, computes its copy."""
    runner = TargetRunner(opts.target, taps)
    key = {
        "version": FEATURES_VERSION,
        "target": target_fingerprint(opts.target),
        "taps": list(taps),
        "max_len": opts.max_len,
    }
    cache = FeatureCache(Path(opts.data), key, len(taps) * runner.hidden_size, runner.hidden_size)
    for turn in range(group.size):
        if turn == group.rank:
            cache.open()
            cache.build(data.samples, runner, progress=progress)
        group.barrier()
    return runner, cache


def _draft_vocabulary(
    opts: TrainOptions, vocab: int, init: Drafter | None, data: TrainingData
) -> DraftVocabulary:
    """The head: the drafter started from's rows, else the --head-size tokens most frequent in
    the training answers."""
    counts = np.bincount(data.train_answers, minlength=vocab).astype(np.int64)
    head_size = opts.draft_head_size()
    if init is None:
        head_ids = None if head_size is None else choose_head(counts, head_size)
    else:
        head_ids = None if init.vocab.draft_to_target is None else init.vocab.draft_to_target
    draft_vocab = vocab if head_ids is None else len(head_ids)
    info = {
        "source": f"woodcock distill answers in {portable_path(opts.data, Path(opts.out))}",
        "split": "training answers (hold-out excluded)",
        "tokens": int(data.train_answers.size),
        "distinct_tokens": int((counts > 0).sum()),
        "holdout_tokens": int(data.holdout_answers.size),
        "holdout_coverage": {
            str(size): coverage(counts, data.holdout_answers, size)
            for size in sorted({*(s for s in COVERAGE_SIZES if s < vocab), draft_vocab})
        },
        "head_size": draft_vocab,
    }
    return DraftVocabulary(head_ids, draft_vocab, counts, info)


def _start_or_resume(
    opts: TrainOptions,
    run: TrainingRun,
    data: TrainingData,
    inputs_used: dict[str, Any],
    ckpt: Path,
    writes: bool,
) -> tuple[dict[str, Any], int]:
    """(the state every checkpoint saves, the step the run continues after): the checkpoint's,
    once its answers, recipe and `inputs_used` (by content, not by path: a run moved to
    another machine resumes) are this run's; else a new log (the rank that `writes` makes it)
    and the evaluation at step 0."""
    facts = [(s.id, len(s.tokens), s.prompt_length) for s in data.samples]
    state: dict[str, Any] = {
        "recipe": {**opts.recipe(), **inputs_used},
        "data_sha256": hashlib.sha256(json.dumps(facts).encode()).hexdigest(),
    }
    log_path = ckpt / LOG
    if not opts.resume:
        if writes:
            ckpt.mkdir(parents=True, exist_ok=True)
            log_path.write_text("", encoding="utf-8")
        initial = run.evaluate()
        state["initial"] = initial
        state["train_seconds"], state["train_tokens"] = 0.0, 0
        state["last_eval"] = None
        if writes:
            append_log(log_path, {"step": 0, "eval": initial})
        return state, 0
    loaded = checkpoint_state(ckpt)
    if loaded.get("data_sha256") != state["data_sha256"]:
        raise DrafterError(
            f"--resume: the answers in {opts.data} changed since the checkpoint in {ckpt}"
            " was made (other samples, another split and head); start over with --force"
        )
    # an EAGLE-3 run's recipe names no algorithm (block runs name theirs)
    theirs, ours = ({"algorithm": "eagle3", **r} for r in (loaded["recipe"], state["recipe"]))
    differing = [k for k in set(theirs) | set(ours) if not same_content(theirs.get(k), ours.get(k))]
    if differing:
        k = sorted(differing)[0]
        raise DrafterError(
            f"--resume: the checkpoint in {ckpt} was made with {k} ="
            f" {theirs.get(k)!r}, this run asks for {ours.get(k)!r}"
        )
    load_checkpoint(loaded, run.model, run.optimizer)
    start_step = int(loaded["step"])
    state["initial"] = loaded.get("initial")
    state["train_seconds"] = loaded.get("train_seconds", 0.0)
    state["train_tokens"] = loaded.get("train_tokens", 0)
    state["last_eval"] = loaded.get("last_eval")
    state["last_loss"] = loaded.get("last_loss")
    if writes:
        trim_log(log_path, start_step)
        remove_partial_checkpoints(ckpt)
    return state, start_step


def _train_steps(
    opts: TrainOptions,
    run: TrainingRun,
    plan: BatchPlan,
    state: dict[str, Any],
    start_step: int,
    report: TrainReport,
    progress: Progress | None,
    writes: bool,
) -> dict[str, Any] | None:
    """The steps after `start_step` up to --steps (none with --finish), evaluated as asked, and
    logged and checkpointed by the rank that `writes`; returns the last evaluation (None: none
    yet)."""
    ckpt = opts.checkpoint_dir()
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
        state["last_loss"] = metrics["loss"]
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
        if writes:
            append_log(ckpt / LOG, entry)
            if step % opts.checkpoint_every == 0 or step == opts.steps:
                save_checkpoint(ckpt, step, run.model, run.optimizer, state)
        if progress:
            progress("training", step, opts.steps)
    report.steps = final_step
    report.train_seconds = run_seconds
    report.train_tokens_per_second = run_tokens / run_seconds if run_seconds else 0.0
    return last


def _write_drafter(
    opts: TrainOptions,
    run: TrainingRun,
    vocab: DraftVocabulary,
    data: TrainingData,
    state: dict[str, Any],
    report: TrainReport,
    holdout_record: dict[str, Any],
    init_record: dict[str, Any] | None,
    processes: int,
) -> None:
    """The trained drafter in the woodcock format, with how it was made in its provenance."""
    out, spec = Path(opts.out), run.spec
    vocab_map = VocabMap(vocab.head_ids, VocabCounts(vocab.counts, vocab.info))
    drafter = Drafter(spec, vocab_map, drafter_weights(run.model, spec))
    recipe = {
        **state["recipe"],
        "data": str(Path(opts.data).resolve()),
        "taps": list(spec.taps.layer_ids),
        "draft_vocab_size": spec.draft_vocab_size,
    }
    if spec.is_block:
        recipe["mask_token_id"] = spec.algorithm.mask_token_id
    provenance = {
        "trainer": run.name,
        "command": opts.command or [],
        **holdout_record,
        "recipe": recipe,
        **({"init": init_record} if init_record is not None else {}),
        "data": {
            "dir": str(Path(opts.data).resolve()),
            "distill": {
                k: data.distill_meta.get(k) for k in ("target", "max_tokens", "chat", "system")
            },
            "samples": len(data.samples),
            "train_samples": len(data.train),
            "holdout_samples": len(data.holdout),
            "train_sequence_tokens": int(sum(len(s.tokens) for s in data.train)),
            "train_answer_tokens": int(data.train_answers.size),
            "holdout_answer_tokens": int(data.holdout_answers.size),
        },
        "training": {
            "steps": report.steps,
            "planned_steps": opts.steps,
            "tokens_seen": int(state["train_tokens"]),
            "seconds": round(state["train_seconds"], 1),
            "final_loss": state.get("last_loss"),  # a resumed run's last step may be before it
            "log": str((opts.checkpoint_dir() / LOG).resolve()),
            **({"processes": processes} if processes > 1 else {}),
        },
        "machine": {"mlx_device": str(mx.default_device()), "python": sys.version.split()[0]},
    }
    native.write(drafter, out, force=opts.force, provenance=portable_paths(provenance, out))
