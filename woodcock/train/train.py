"""`woodcock train`: an EAGLE-3 drafter for an mlx-lm target, trained on MLX from distilled answers.

The recipe ("seed recipe"):

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

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from woodcock.errors import DrafterError
from woodcock.jsonfile import read_json_object, write_json
from woodcock.provenance import portable_path, portable_paths
from woodcock.train.distill import META, read_answers

FEATURES_VERSION = 2
CHECKPOINT_VERSION = 1
COVERAGE_SIZES = (1024, 2048, 4096, 8192, 16384, 32768)


# ---------------------------------------------------------------------------------------------
# Options


@dataclass
class TrainOptions:
    target: str | None  # None: the default target
    data: Path
    out: Path
    steps: int = 300
    ttt_steps: int = 3
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup: int | None = None  # default: 5 % of the steps
    weight_decay: float = 0.01
    clip: float = 1.0
    step_weight: float = 0.8
    batch: int = 8  # sequences per step
    max_len: int = 384  # tokens per sequence (prompt + answer), longer ones are cut
    head_size: int = 8192
    holdout: float = 0.05
    seed: int = 0
    eval_every: int = 200
    checkpoint_every: int = 50
    taps: tuple[int, ...] | None = None
    init: str | None = None  # a drafter to start from (its taps and head rows), not random weights
    checkpoints: Path | None = None  # default: OUT.ckpt next to OUT
    resume: bool = False
    finish: bool = False  # with resume: write the drafter from the last checkpoint, no more steps
    force: bool = False
    command: list[str] | None = None  # recorded in the provenance

    def checkpoint_dir(self) -> Path:
        if self.checkpoints is not None:
            return Path(self.checkpoints)
        out = Path(self.out)
        return out.with_name(out.name + ".ckpt")

    def recipe(self) -> dict[str, Any]:
        """What a resumed run must share with the run it continues."""
        keys = (
            "steps",
            "ttt_steps",
            "lr",
            "min_lr_ratio",
            "weight_decay",
            "clip",
            "step_weight",
            "batch",
            "max_len",
            "head_size",
            "holdout",
            "seed",
        )
        recipe = {k: getattr(self, k) for k in keys}
        recipe["warmup"] = self.warmup_steps()
        recipe["taps"] = list(self.taps) if self.taps else None
        recipe["target"] = str(self.target)
        recipe["data"] = str(Path(self.data).resolve())
        if self.init is not None:
            recipe["init"] = str(self.init)
        return recipe

    def warmup_steps(self) -> int:
        return self.warmup if self.warmup is not None else max(1, self.steps // 20)

    def check(self) -> None:
        for name in ("steps", "ttt_steps", "batch", "head_size", "eval_every", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise DrafterError(
                    f"--{name.replace('_', '-')} {getattr(self, name)}: expected >= 1"
                )
        if self.max_len < 2:
            raise DrafterError(f"--max-len {self.max_len}: expected at least 2 tokens")
        if not 0.0 < self.holdout < 1.0:
            raise DrafterError(f"--holdout {self.holdout}: expected a share in (0, 1)")
        for name in ("lr", "clip"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise DrafterError(f"--{name} {getattr(self, name)}: expected a positive number")
        if not 0 <= self.min_lr_ratio <= 1:
            raise DrafterError(f"--min-lr-ratio {self.min_lr_ratio}: expected a share in [0, 1]")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise DrafterError(f"--weight-decay {self.weight_decay}: expected 0 or more")
        if self.warmup is not None and self.warmup < 0:
            raise DrafterError(f"--warmup {self.warmup}: expected 0 or more")
        if self.warmup_steps() > self.steps:
            raise DrafterError(f"--warmup {self.warmup}: more than --steps {self.steps}")
        if self.finish and not self.resume:
            raise DrafterError("--finish ends a checkpointed run: pass --resume with it")


@dataclass
class TrainReport:
    steps: int = 0
    resumed_from: int = 0
    losses: list[float] = field(default_factory=list)  # this run's steps
    holdout_agreement: list[float] = field(default_factory=list)
    holdout_agreement_unconditional: list[float] = field(default_factory=list)
    holdout_agreement_initial: list[float] = field(default_factory=list)
    train_tokens_per_second: float = 0.0
    feature_seconds: float = 0.0
    train_seconds: float = 0.0
    out: Path | None = None


Progress = Callable[[str, int, int], None]  # (phase, done, total)


# ---------------------------------------------------------------------------------------------
# Data


@dataclass(frozen=True)
class Sample:
    id: str
    tokens: np.ndarray  # int32 [L], prompt then answer, cut to max_len
    prompt_length: int


def load_samples(data: Path, max_len: int) -> list[Sample]:
    data = Path(data)
    if not (data / META).exists():
        raise DrafterError(f"{data}: no {META}; make the data with `woodcock distill`")
    samples = []
    for row in read_answers(data):
        prompt, answer = row["prompt_ids"], row["answer_ids"]
        tokens = np.array((prompt + answer)[:max_len], dtype=np.int32)
        if len(prompt) < 1 or len(tokens) < len(prompt) + 1:
            continue  # nothing of the answer survives the cut
        samples.append(Sample(row["id"], tokens, len(prompt)))
    if len(samples) < 2:
        raise DrafterError(
            f"{data}: {len(samples)} usable answer(s); training needs at least 2 (one is held out)"
        )
    return samples


def holdout_split(samples: Sequence[Sample], share: float) -> tuple[list[Sample], list[Sample]]:
    """(train, holdout): a sample is held out when sha256(id) lies in the lowest `share` of the
    hash range, so the split does not depend on order or on which other samples exist. At least
    one sample lands on each side."""
    keyed = [(int(hashlib.sha256(s.id.encode()).hexdigest()[:12], 16) / 16**12, s) for s in samples]
    holdout = [s for key, s in keyed if key < share]
    if not holdout:
        holdout = [min(keyed, key=lambda ks: ks[0])[1]]
    if len(holdout) == len(samples):
        holdout = holdout[:-1]
    held = {s.id for s in holdout}
    return [s for s in samples if s.id not in held], holdout


def answer_tokens(samples: Sequence[Sample]) -> np.ndarray:
    if not samples:
        return np.zeros(0, np.int64)
    return np.concatenate([s.tokens[s.prompt_length :] for s in samples]).astype(np.int64)


def choose_head(counts: np.ndarray, head_size: int) -> np.ndarray | None:
    """Target ids of the head rows, ascending: the `head_size` most frequent (ties: lower id);
    None when that is the whole vocabulary."""
    if head_size >= counts.shape[0]:
        return None
    order = np.lexsort((np.arange(counts.shape[0]), -counts))
    return np.sort(order[:head_size]).astype(np.int64)


def coverage(counts: np.ndarray, tokens: np.ndarray, size: int) -> float:
    head = choose_head(counts, size)
    if tokens.size == 0:
        return 0.0
    if head is None:
        return 1.0
    return float(np.isin(tokens, head).mean())


# ---------------------------------------------------------------------------------------------
# The target: taps and final hidden states, cached on disk


@contextlib.contextmanager
def recording(layers: list, layer_ids: Sequence[int]) -> Iterator[list]:
    """Swap the entries of a model's layer list for recorders for the length of a forward; the
    yielded list then holds the tapped states in the canonical convention (id 0: the first
    layer's input, id L: layer L's output), ascending."""
    wanted = set(layer_ids)
    originals = list(layers)
    seen: dict[int, Any] = {}

    class Tap:
        def __init__(self, index: int, layer):
            self.index, self.layer = index, layer

        def __call__(self, x, *args, **kwargs):
            if self.index == 0 and 0 in wanted:
                seen[0] = x
            out = self.layer(x, *args, **kwargs)
            if self.index + 1 in wanted:
                seen[self.index + 1] = out
            return out

        def __getattr__(self, name):
            return getattr(self.layer, name)

    states: list = []
    layers[:] = [Tap(i, layer) for i, layer in enumerate(originals)]
    try:
        yield states
    finally:
        layers[:] = originals
        states.extend(seen[i] for i in sorted(wanted) if i in seen)


FP16_RANGE = 2.0**15  # the top of fp16's largest binade


def to_fp16(x, parts: int):
    """x [..., parts * W] (mx) -> (fp16 [..., parts * W], int8 exponents e [..., parts]): each
    part is divided by 2^e, the smallest e >= 0 that brings its largest |value| to at most 2^15.
    Massive activations (SmolLM2's middle layers reach 2.5e4, near fp16's 65504) can then never
    overflow, and every value keeps fp16's relative precision."""
    import mlx.core as mx

    shape = x.shape
    y = x.reshape(*shape[:-1], parts, -1)
    peak = mx.max(mx.abs(y), axis=-1)
    exponent = mx.maximum(mx.ceil(mx.log2(peak / FP16_RANGE)), 0.0)
    y = y * mx.power(2.0, -exponent)[..., None]
    return y.reshape(shape).astype(mx.float16), exponent.astype(mx.int8)


def from_fp16(x: np.ndarray, exponent: np.ndarray) -> np.ndarray:
    """The inverse of `to_fp16`, as float32 numpy."""
    parts = exponent.shape[-1]
    y = x.astype(np.float32).reshape(*x.shape[:-1], parts, -1)
    y *= np.exp2(exponent.astype(np.float32))[..., None]
    return y.reshape(x.shape)


class TargetRunner:
    """An mlx-lm model as the teacher: taps, final hidden state, full-vocabulary argmax."""

    def __init__(self, source: str, layer_ids: Sequence[int]):
        import mlx.core as mx
        from mlx_lm import load

        from woodcock.runtime.target import MlxTarget

        self.model, _ = load(str(source))
        if mx.default_device() == mx.cpu:
            self.model.set_dtype(mx.float32)
        self.layer_ids = tuple(layer_ids)
        adapter = MlxTarget(self.model, (), name=f"target {source}")
        self.num_layers = adapter.num_layers
        bad = [i for i in self.layer_ids if not 0 <= i <= self.num_layers]
        if bad:
            raise DrafterError(
                f"--taps {list(self.layer_ids)}: ids must lie in [0, {self.num_layers}]"
            )
        shared = adapter.shared_tensors()
        self.embedding = shared["embed_tokens.weight"]  # [V, Ht] float32 numpy
        self.head = shared["lm_head.weight"]  # [V, Ht]
        self.vocab_size, self.hidden_size = self.head.shape
        self._head_t = mx.array(self.head).T  # a view; x @ head_t
        self._checked = False

    def final_norm_weight(self) -> np.ndarray | None:
        import mlx.core as mx

        inner = getattr(self.model, "model", None)
        norm = getattr(inner, "norm", None)
        weight = getattr(norm, "weight", None)
        if isinstance(weight, mx.array) and weight.shape == (self.hidden_size,):
            return np.array(weight.astype(mx.float32))
        return None

    def run(self, tokens: np.ndarray) -> dict[str, np.ndarray]:
        """tokens int32 [B, L] (right-padded) -> taps [B, L, A*Ht] and final hidden [B, L, Ht]
        as `to_fp16` stores them (with their exponents), argmax int32 [B, L]."""
        import mlx.core as mx

        x = mx.array(tokens)
        inner = self.model.model
        with recording(self.model.layers, self.layer_ids) as states:
            hidden = inner(x)
        taps = mx.concatenate(states, axis=-1)
        argmax = []
        rows = hidden.reshape(-1, self.hidden_size)
        for start in range(0, rows.shape[0], 512):
            argmax.append(mx.argmax(rows[start : start + 512] @ self._head_t, axis=-1))
        argmax = mx.concatenate(argmax).reshape(tokens.shape)
        taps16, taps_exp = to_fp16(taps, len(self.layer_ids))
        final16, final_exp = to_fp16(hidden, 1)
        mx.eval(taps16, taps_exp, final16, final_exp, argmax)
        if not self._checked:
            self._check_head(tokens[0], hidden[0])
        out = {
            "taps": np.array(taps16),
            "taps_exp": np.array(taps_exp),
            "final": np.array(final16),
            "final_exp": np.array(final_exp),
            "argmax": np.array(argmax).astype(np.int32),
        }
        if not (np.isfinite(out["taps"]).all() and np.isfinite(out["final"]).all()):
            raise DrafterError("the target's hidden states are not finite (inf or nan)")
        return out

    def _check_head(self, tokens: np.ndarray, hidden) -> None:
        """The soft labels are final hidden @ head rows: make sure that is what the model's own
        forward computes (no logit soft-capping or scaling)."""
        import mlx.core as mx

        n = min(16, tokens.shape[0])
        logits = self.model(mx.array(tokens[None, :n]))[0]
        mine = hidden[:n] @ self._head_t
        scale = float(mx.max(mx.abs(logits)).item()) + 1e-6
        error = float(mx.max(mx.abs(logits - mine)).item())
        if error > 1e-3 * scale + 1e-4:
            raise DrafterError(
                "the target's logits are not its LM head applied to its final hidden state"
                f" (max difference {error:.3g}; soft-capped or scaled logits?): not supported"
            )
        self._checked = True


def target_fingerprint(source: str) -> dict[str, Any]:
    from woodcock.loading import resolve_source

    path = resolve_source(source)
    config = (path / "config.json").read_bytes() if (path / "config.json").exists() else b""
    files = sorted(
        (p.name, p.stat().st_size, int(p.stat().st_mtime)) for p in path.glob("*.safetensors")
    )
    return {
        "path": str(path.resolve()),
        "config_sha256": hashlib.sha256(config).hexdigest(),
        "weights": files,
    }


class FeatureCache:
    """The target's outputs for every sample, appended to flat files as they are computed
    (interrupting and re-running continues where it stopped):

        tokens.bin  int32 [N]            argmax.bin     int32 [N]  (full-vocabulary argmax)
        taps.bin    fp16 [N, A*Ht]       taps_exp.bin   int8 [N, A]  (`to_fp16` exponents)
        final.bin   fp16 [N, Ht]         final_exp.bin  int8 [N, 1]
        index.jsonl {"id", "start", "length", "prompt_length"} per sample, written after its rows
    """

    FILES = (
        ("tokens", np.int32, 1),
        ("taps", np.float16, 2),
        ("taps_exp", np.int8, 2),
        ("final", np.float16, 2),
        ("final_exp", np.int8, 2),
        ("argmax", np.int32, 1),
    )

    def __init__(self, root: Path, key: dict[str, Any], taps_width: int, hidden: int):
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        self.dir = Path(root) / f"features-{digest}"
        self.key = json.loads(json.dumps(key))  # as it reads back from features.json
        self.widths = {"tokens": 1, "taps": taps_width, "final": hidden, "argmax": 1}
        self.widths |= {"taps_exp": taps_width // hidden, "final_exp": 1}
        self.index: dict[str, dict] = {}
        self._arrays: dict[str, np.ndarray] = {}

    def open(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        meta = self.dir / "features.json"
        if meta.exists():
            if read_json_object(meta).get("key") != self.key:
                raise DrafterError(f"{meta}: made for another target or recipe; remove {self.dir}")
        else:
            write_json(meta, {"version": FEATURES_VERSION, "key": self.key})
        rows = 0
        index_path = self.dir / "index.jsonl"
        if index_path.exists():
            lines = index_path.read_text(encoding="utf-8").split("\n")
            good = []
            for line in lines:
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:
                    break  # a torn last line
                if entry["start"] != rows:
                    break
                good.append(line)
                self.index[entry["id"]] = entry
                rows += entry["length"]
            index_path.write_text("".join(line + "\n" for line in good), encoding="utf-8")
        for name, dtype, _ in self.FILES:
            path = self.dir / f"{name}.bin"
            path.touch()
            size = rows * self.widths[name] * np.dtype(dtype).itemsize
            if path.stat().st_size < size:
                raise DrafterError(f"{path}: shorter than its index says; remove {self.dir}")
            with open(path, "r+b") as f:
                f.truncate(size)  # rows of a sample whose index line was never written
        self.rows = rows

    def missing(self, samples: Sequence[Sample]) -> list[Sample]:
        out = []
        for s in samples:
            entry = self.index.get(s.id)
            if entry is None:
                out.append(s)
            elif entry["length"] != len(s.tokens) or entry["prompt_length"] != s.prompt_length:
                raise DrafterError(
                    f"{self.dir}: sample {s.id!r} is cached with another length; the answers"
                    f" changed since: remove {self.dir}"
                )
        return out

    def build(
        self,
        samples: Sequence[Sample],
        runner: TargetRunner,
        *,
        batch_tokens: int = 2048,
        progress: Progress | None = None,
    ) -> None:
        """Compute what is missing (longest first, right-padded batches of <= batch_tokens
        padded tokens)."""
        todo = sorted(self.missing(samples), key=lambda s: -len(s.tokens))
        if not todo:
            return
        total = sum(len(s.tokens) for s in todo)
        done = 0
        handles = {name: open(self.dir / f"{name}.bin", "ab") for name, _, _ in self.FILES}
        try:
            with open(self.dir / "index.jsonl", "a", encoding="utf-8") as index:
                i = 0
                while i < len(todo):
                    length = len(todo[i].tokens)
                    count = max(1, min(16, batch_tokens // length))
                    group = todo[i : i + count]
                    i += len(group)
                    padded = np.zeros((len(group), length), np.int32)
                    for row, s in enumerate(group):
                        padded[row, : len(s.tokens)] = s.tokens
                    computed = runner.run(padded)
                    for row, s in enumerate(group):
                        n = len(s.tokens)
                        parts = {name: array[row, :n] for name, array in computed.items()}
                        parts["tokens"] = s.tokens
                        for name, dtype, _ in self.FILES:
                            handles[name].write(np.ascontiguousarray(parts[name], dtype).tobytes())
                        for handle in handles.values():
                            handle.flush()
                        entry = {
                            "id": s.id,
                            "start": self.rows,
                            "length": n,
                            "prompt_length": s.prompt_length,
                        }
                        index.write(json.dumps(entry) + "\n")
                        index.flush()
                        self.index[s.id] = entry
                        self.rows += n
                        done += n
                    if progress:
                        progress("target features", done, total)
        finally:
            for handle in handles.values():
                handle.close()

    def arrays(self) -> dict[str, np.ndarray]:
        if not self._arrays:
            for name, dtype, ndim in self.FILES:
                path = self.dir / f"{name}.bin"
                shape = (self.rows,) if ndim == 1 else (self.rows, self.widths[name])
                if self.rows == 0:
                    self._arrays[name] = np.zeros(shape, dtype)
                else:
                    self._arrays[name] = np.memmap(path, dtype=dtype, mode="r", shape=shape)
        return self._arrays


# ---------------------------------------------------------------------------------------------
# The drafter


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


def build_spec(
    runner: TargetRunner,
    target: str,
    taps: Sequence[int],
    draft_vocab: int,
    ttt_steps: int,
):
    from woodcock.ir import DecoderLayer, DrafterSpec, Eagle3, Fusion, Head, Taps, Target

    args = runner.model.args
    hidden = runner.hidden_size
    heads = int(args.num_attention_heads)
    kv_heads = int(getattr(args, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(args, "head_dim", None) or hidden // heads)
    from woodcock.target_files import target_from_config

    architectures = target_from_config(target).architectures
    return DrafterSpec(
        algorithm=Eagle3(norm_before_residual=True, norm_output=True, speculative_tokens=ttt_steps),
        target=Target(
            num_hidden_layers=runner.num_layers,
            hidden_size=hidden,
            vocab_size=runner.vocab_size,
            name_or_path=str(target),
            architectures=architectures,
        ),
        taps=Taps(tuple(taps)),
        fusion=Fusion(tap_norm="per_tap", fc_bias=False, hidden_norm=False),
        layers=(
            DecoderLayer(
                style="llama",
                input="embed_and_hidden",
                attention="causal",
                sliding_window=None,
                hidden_size=hidden,
                intermediate_size=int(args.intermediate_size),
                num_attention_heads=heads,
                num_key_value_heads=kv_heads,
                head_dim=head_dim,
                rms_norm_eps=float(getattr(args, "rms_norm_eps", 1e-6)),
                rope_theta=float(getattr(args, "rope_theta", 10000.0)),
                rope_scaling=_rope_scaling(args),
                max_position_embeddings=int(getattr(args, "max_position_embeddings", 4096) or 4096),
            ),
        ),
        head=Head(lm_head="own", embedding="shared"),
        draft_vocab_size=draft_vocab,
    )


def build_model(
    spec, embedding: np.ndarray, head_rows: np.ndarray, norm: np.ndarray | None, seed: int
):
    """The trainable drafter: the runtime's Eagle3Model (canonical parameter names, standard
    [out, in] weights), the target's embedding loaded and frozen."""
    import mlx.core as mx

    from woodcock.runtime.eagle3 import Eagle3Model

    mx.random.seed(seed)
    model = Eagle3Model(spec, head_rows.shape[0])
    model.embed_tokens.weight = mx.array(embedding)
    model.lm_head.weight = mx.array(np.ascontiguousarray(head_rows, np.float32))
    if norm is not None:
        model.norm.weight = mx.array(norm)
    model.embed_tokens.freeze()
    mx.eval(model.parameters())
    return model


def _load_init(opts: TrainOptions):
    """The drafter to start from and the record of it for the provenance."""
    from woodcock.loading import load_drafter_with_format, resolve_source

    init, fmt = load_drafter_with_format(opts.init)
    if init.spec.algorithm.name != "eagle3":
        raise DrafterError(
            f"--init {opts.init}: algorithm = {init.spec.algorithm.name!r}; this trains 'eagle3'"
        )
    if init.spec.draft_vocab_size != opts.head_size and init.vocab.draft_to_target is not None:
        raise DrafterError(
            f"--init {opts.init}: draft_vocab_size = {init.spec.draft_vocab_size}, --head-size"
            f" {opts.head_size}: a drafter to start from keeps its head rows; pass --head-size"
            f" {init.spec.draft_vocab_size}"
        )
    record: dict[str, Any] = {"source": str(opts.init), "format": fmt.NAME}
    if fmt.NAME == "woodcock":
        theirs = fmt.read_provenance(resolve_source(opts.init))
        record["data"] = theirs.get("data", {}).get("dir")
        record["training"] = theirs.get("training")
        record["holdout_agreement"] = theirs.get("holdout_agreement")
    return init, record


def start_from(model, init, spec, source: str) -> None:
    """Load `init`'s weights into the freshly built `model`; `init` must have the spec this run
    builds (the number of TTT steps and the target's name aside)."""
    import mlx.core as mx

    theirs = dataclasses.replace(
        init.spec,
        algorithm=dataclasses.replace(
            init.spec.algorithm, speculative_tokens=spec.algorithm.speculative_tokens
        ),
        target=dataclasses.replace(
            init.spec.target,
            name_or_path=spec.target.name_or_path,
            architectures=spec.target.architectures,
        ),
    )
    if theirs != spec:
        field_name = next(
            f.name
            for f in dataclasses.fields(spec)
            if getattr(theirs, f.name) != getattr(spec, f.name)
        )
        raise DrafterError(
            f"--init {source}: {field_name} = {getattr(init.spec, field_name)!r}; this run trains"
            f" {getattr(spec, field_name)!r}"
        )
    weights = [(name, mx.array(np.asarray(a, np.float32))) for name, a in init.weights.items()]
    model.load_weights(weights, strict=False)  # the embedding is the target's, not the drafter's
    mx.eval(model.parameters())


def trained_weights(model) -> dict[str, np.ndarray]:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    return {
        name: np.array(value.astype(mx.float32))
        for name, value in tree_flatten(model.trainable_parameters())
    }


# ---------------------------------------------------------------------------------------------
# Training-time test forward (batched; the same function as woodcock.runtime.eagle3 computes
# row by row at inference)


def _layer_step(layer, x, embeds, offset: int, store: list, causal, norm_before_residual: bool):
    """One decoder layer at TTT step len(store) for every row: x [B, R, H] -> [B, R, H]; this
    step's keys/values are appended to `store`."""
    import mlx.core as mx

    attn = layer.self_attn
    batch, rows, _ = x.shape
    nh, nkv, hd = attn.num_heads, attn.num_kv_heads, attn.head_dim
    attn_in, residual = layer.attention_input(x, embeds, norm_before_residual)
    q = attn.q_proj(attn_in).reshape(batch, rows, nh, hd)
    k = attn.k_proj(attn_in).reshape(batch, rows, nkv, hd)
    v = attn.v_proj(attn_in).reshape(batch, rows, nkv, hd).transpose(0, 2, 1, 3)
    if attn.qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q = attn.rope(q.transpose(0, 2, 1, 3), offset)
    k = attn.rope(k.transpose(0, 2, 1, 3), offset)
    store.append((k, v))
    groups = nh // nkv
    qg = (q * attn.scale).reshape(batch, nkv, groups, rows, hd)
    k0, v0 = store[0]
    scores = qg @ k0[:, :, None].swapaxes(-1, -2) + causal  # [B, nkv, g, R, R]
    if len(store) == 1:
        out = mx.softmax(scores, axis=-1, precise=True) @ v0[:, :, None]
    else:
        # each row's own keys of steps 1..k: one score per (row, step)
        diagonal = mx.stack([(qg * kj[:, :, None]).sum(-1) for kj, _ in store[1:]], axis=-1)
        probs = mx.softmax(mx.concatenate([scores, diagonal], axis=-1), axis=-1, precise=True)
        out = probs[..., :rows] @ v0[:, :, None]
        values = mx.stack([vj for _, vj in store[1:]], axis=-2)  # [B, nkv, R, k, hd]
        out = out + (probs[..., rows:, None] * values[:, :, None]).sum(-2)
    out = out.reshape(batch, nh, rows, hd).transpose(0, 2, 1, 3).reshape(batch, rows, nh * hd)
    y = residual + attn.o_proj(out)
    return y + layer.mlp(layer.post_attention_layernorm(y))


def ttt_states(model, tokens, taps, steps: int) -> list:
    """tokens int32 [B, R + steps - 1] with tokens[:, j] = x_{j+1}; taps [B, R, A*Ht] with
    taps[:, i] = g_i -> per step the final-norm output [B, R, H], which lm_head turns into
    logits (step k: row i predicts x_{i+2+k})."""
    import mlx.core as mx

    rows = taps.shape[1]
    algorithm = model.algorithm
    causal = mx.triu(mx.full((rows, rows), -math.inf, mx.float32), k=1)
    stores: list[list] = [[] for _ in model.layers]
    hidden = model.fuse(taps)
    out = []
    for k in range(steps):
        embeds = model.embed_tokens(tokens[:, k : k + rows])
        x = hidden
        for i, layer in enumerate(model.layers):
            x = _layer_step(
                layer,
                x,
                embeds if i == 0 else None,
                1 + k,
                stores[i],
                causal,
                algorithm.norm_before_residual,
            )
        normed = model.norm(x)
        out.append(normed)
        hidden = normed if algorithm.norm_output else x
    return out


def ttt_logits(model, tokens, taps, steps: int) -> list:
    """`ttt_states` through the head: logits [B, R, Vd] per step."""
    return [model.lm_head(state) for state in ttt_states(model, tokens, taps, steps)]


@dataclass
class Batch:
    """One padded batch; per-position arrays are [B, Lp] with Lp = R + K + 1 (R rows)."""

    tokens: np.ndarray  # x_j
    final: np.ndarray  # target final hidden at j, float32
    argmax: np.ndarray  # target argmax at j
    taps: np.ndarray  # g_i for rows i < R, float32 [B, R, A*Ht]
    lengths: np.ndarray  # [B]
    prompt_lengths: np.ndarray  # [B]

    @property
    def rows(self) -> int:
        return self.taps.shape[1]

    @property
    def tokens_in(self) -> int:
        return int(self.lengths.sum())


def make_batch(arrays: dict[str, np.ndarray], entries: Sequence[dict], steps: int) -> Batch:
    longest = max(e["length"] for e in entries)
    rows = longest - 1
    width = rows + steps + 1
    b = len(entries)
    hidden = arrays["final"].shape[1]
    tokens = np.zeros((b, width), np.int32)
    argmax = np.full((b, width), -1, np.int32)
    final = np.zeros((b, width, hidden), np.float32)
    taps = np.zeros((b, rows, arrays["taps"].shape[1]), np.float32)
    for j, e in enumerate(entries):
        s, n = e["start"], e["length"]
        tokens[j, :n] = arrays["tokens"][s : s + n]
        argmax[j, :n] = arrays["argmax"][s : s + n]
        final[j, :n] = from_fp16(arrays["final"][s : s + n], arrays["final_exp"][s : s + n])
        taps[j, : n - 1] = from_fp16(
            arrays["taps"][s : s + n - 1], arrays["taps_exp"][s : s + n - 1]
        )
    lengths = np.array([e["length"] for e in entries], np.int64)
    prompts = np.array([e["prompt_length"] for e in entries], np.int64)
    return Batch(tokens, final, argmax, taps, lengths, prompts)


def step_masks(batch: Batch, steps: int, in_head: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(valid [K, B, R]: step k's target position t = i+1+k holds a prediction of an answer
    token; loss [K, B, R]: valid and the target's argmax there is in the draft head)."""
    rows = batch.rows
    i = np.arange(rows)[None, None, :]
    k = np.arange(steps)[:, None, None]
    t = i + 1 + k
    lengths = batch.lengths[None, :, None]
    prompts = batch.prompt_lengths[None, :, None]
    valid = (t <= lengths - 1) & (t >= prompts - 1)
    target = np.take_along_axis(
        np.broadcast_to(batch.argmax[None], (steps, *batch.argmax.shape)),
        np.broadcast_to(t, (steps, batch.argmax.shape[0], rows)),
        axis=2,
    )
    loss = valid & in_head[np.maximum(target, 0)] & (target >= 0)
    return valid, loss


@dataclass
class Agreement:
    """Counts behind the agreement by draft step."""

    steps: int
    hits: np.ndarray = None  # conditional: matched, among rows still on the target's chain
    tried: np.ndarray = None
    full_hits: np.ndarray = None  # unconditional
    full_tried: np.ndarray = None

    def __post_init__(self):
        for name in ("hits", "tried", "full_hits", "full_tried"):
            if getattr(self, name) is None:
                setattr(self, name, np.zeros(self.steps, np.int64))

    def add(self, batch: Batch, drafts: list[np.ndarray], valid: np.ndarray) -> None:
        """drafts: per step the drafter's argmax as target ids [B, R]."""
        rows = batch.rows
        i = np.arange(rows)[None, :]
        starts = valid[0] & (i + 1 >= batch.prompt_lengths[:, None])  # first draft: x_{>=P+1}
        alive = starts
        for k in range(self.steps):
            t = i + 1 + k
            target = np.take_along_axis(batch.argmax, np.broadcast_to(t, drafts[k].shape), 1)
            fed = np.take_along_axis(batch.tokens, np.broadcast_to(t + 1, drafts[k].shape), 1)
            match = drafts[k] == target
            self.full_hits[k] += int((valid[k] & match).sum())
            self.full_tried[k] += int(valid[k].sum())
            here = alive & valid[k]
            self.hits[k] += int((here & match).sum())
            self.tried[k] += int(here.sum())
            alive = here & match & (drafts[k] == fed)

    def conditional(self) -> list[float]:
        return [float(h / t) if t else 0.0 for h, t in zip(self.hits, self.tried, strict=True)]

    def unconditional(self) -> list[float]:
        pairs = zip(self.full_hits, self.full_tried, strict=True)
        return [float(h / t) if t else 0.0 for h, t in pairs]


class Trainer:
    def __init__(
        self, model, head_target_ids: np.ndarray, head_matrix: np.ndarray, opts: TrainOptions
    ):
        import mlx.core as mx
        import mlx.nn as nn
        import mlx.optimizers as optim

        self.model, self.opts = model, opts
        self.steps = opts.ttt_steps
        vocab = int(head_matrix.shape[0])
        self.head_ids = (
            np.arange(vocab, dtype=np.int64) if head_target_ids is None else head_target_ids
        )
        self.in_head = np.zeros(vocab, bool)
        self.in_head[self.head_ids] = True
        rows = head_matrix if head_target_ids is None else head_matrix[head_target_ids]
        self.head_t = mx.array(np.ascontiguousarray(rows.T, np.float32))  # [Ht, Vd]
        self.weights = [opts.step_weight**k for k in range(self.steps)]
        warmup, total, peak, floor = opts.warmup_steps(), opts.steps, opts.lr, opts.min_lr_ratio

        def schedule(step):
            step = step.astype(mx.float32)
            warm = mx.minimum((step + 1) / warmup, 1.0)
            progress = mx.clip((step + 1 - warmup) / max(1, total - warmup), 0.0, 1.0)
            decay = floor + (1 - floor) * 0.5 * (1 + mx.cos(math.pi * progress))
            return peak * warm * decay

        self.optimizer = optim.AdamW(
            learning_rate=schedule, betas=(0.9, 0.95), weight_decay=opts.weight_decay
        )
        self._loss_and_grad = nn.value_and_grad(model, self._loss)

    def _inputs(self, batch: Batch) -> StepInputs:
        """Only rows whose step-k target is an answer position get logits and a loss (prompt
        and padding rows still run the layers: later rows attend to them)."""
        import mlx.core as mx

        valid, loss_mask = step_masks(batch, self.steps, self.in_head)
        batch_size, rows = batch.tokens.shape[0], batch.rows
        # the target distribution at every answer position, once
        t = np.arange(batch.tokens.shape[1])[None, :]
        answer = (t >= batch.prompt_lengths[:, None] - 1) & (t <= batch.lengths[:, None] - 1)
        where = np.full(answer.shape, -1, np.int64)
        where[answer] = np.arange(int(answer.sum()))
        final = mx.array(batch.final[answer])  # [n, Ht]
        target = mx.softmax(final @ self.head_t, axis=-1, precise=True)  # [n, Vd]
        selections = []
        for k in range(self.steps):
            flat = np.flatnonzero(valid[k].ravel())  # b * R + i
            if flat.size == 0:
                selections.append(None)
                continue
            b, i = np.divmod(flat, rows)
            weight = loss_mask[k].ravel()[flat].astype(np.float32)
            selections.append(
                (
                    mx.array(flat.astype(np.int32)),
                    mx.array(where[b, i + 1 + k].astype(np.int32)),
                    mx.array(weight),
                )
            )
        return StepInputs(
            tokens=mx.array(batch.tokens[:, 1 : rows + self.steps]),
            taps=mx.array(batch.taps),
            target=target,
            selections=selections,
            valid=valid,
            shape=(batch_size, rows),
        )

    def _loss(self, model, tokens, taps, target, selections):
        import mlx.core as mx

        states = ttt_states(model, tokens, taps, self.steps)
        total = mx.array(0.0)
        per_step, drafts = [], []
        for k, state in enumerate(states):
            if selections[k] is None:
                per_step.append(mx.array(0.0))
                drafts.append(None)
                continue
            flat, where, weight = selections[k]
            chosen = mx.take(state.reshape(-1, state.shape[-1]), flat, axis=0)
            logits = model.lm_head(chosen)  # [n, Vd]
            ce = mx.logsumexp(logits, axis=-1) - (mx.take(target, where, axis=0) * logits).sum(-1)
            loss = (ce * weight).sum() / mx.maximum(weight.sum(), 1.0)
            total = total + self.weights[k] * loss
            per_step.append(loss)
            drafts.append(mx.argmax(logits, axis=-1))
        return total, (per_step, drafts)

    def _drafts(self, inputs: StepInputs, drafts: list) -> list[np.ndarray]:
        """Per step the drafter's argmax as target ids [B, R] (-1 where no logits were made)."""
        out = []
        for k, d in enumerate(drafts):
            full = np.full(inputs.shape[0] * inputs.shape[1], -1, np.int64)
            if d is not None:
                full[np.flatnonzero(inputs.valid[k].ravel())] = self.head_ids[np.array(d)]
            out.append(full.reshape(inputs.shape))
        return out

    def train_step(self, batch: Batch) -> dict[str, Any]:
        import mlx.core as mx
        import mlx.optimizers as optim

        inputs = self._inputs(batch)
        (loss, (per_step, drafts)), grads = self._loss_and_grad(
            self.model, inputs.tokens, inputs.taps, inputs.target, inputs.selections
        )
        grads, norm = optim.clip_grad_norm(grads, self.opts.clip)
        self.optimizer.update(self.model, grads)
        ready = [d for d in drafts if d is not None]
        mx.eval(self.model.parameters(), self.optimizer.state, loss, norm, per_step, ready)
        agreement = Agreement(self.steps)
        agreement.add(batch, self._drafts(inputs, drafts), inputs.valid)
        return {
            "loss": float(loss.item()),
            "loss_by_step": [float(x.item()) for x in per_step],
            "agreement": agreement.unconditional(),
            "grad_norm": float(norm.item()),
            "lr": float(self.optimizer.learning_rate.item()),  # the rate this step used
        }

    def evaluate(self, batches: Iterable[Batch]) -> dict[str, Any]:
        import mlx.core as mx

        agreement = Agreement(self.steps)
        loss_sum, weight = np.zeros(self.steps), np.zeros(self.steps)
        for batch in batches:
            inputs = self._inputs(batch)
            _, (per_step, drafts) = self._loss(
                self.model, inputs.tokens, inputs.taps, inputs.target, inputs.selections
            )
            mx.eval(per_step, [d for d in drafts if d is not None])
            n = np.array(
                [0.0 if s is None else float(s[2].sum().item()) for s in inputs.selections]
            )
            loss_sum += np.array([float(x.item()) for x in per_step]) * n
            weight += n
            agreement.add(batch, self._drafts(inputs, drafts), inputs.valid)
        losses = [float(s / w) if w else 0.0 for s, w in zip(loss_sum, weight, strict=True)]
        return {
            "holdout_agreement": agreement.conditional(),
            "holdout_agreement_unconditional": agreement.unconditional(),
            "holdout_loss_by_step": losses,
            "holdout_rows": [int(t) for t in agreement.tried],
        }


@dataclass
class StepInputs:
    tokens: Any  # mx int32 [B, R + K - 1]: tokens[:, j] = x_{j+1}
    taps: Any  # mx [B, R, A*Ht]
    target: Any  # mx [n answer positions, Vd]: the target's draft-vocabulary distribution
    selections: list  # per step: (flat row ids, index into target, loss weight) or None
    valid: np.ndarray  # [K, B, R]
    shape: tuple[int, int]


# ---------------------------------------------------------------------------------------------
# Batch order


def epoch_batches(entries: Sequence[dict], batch: int, seed: int, epoch: int) -> list[list[int]]:
    """Indices into `entries` per batch for one epoch: shuffled, then sorted by length within
    windows of 16 batches (less padding), batch order shuffled again. A function of
    (seed, epoch) only, so a resumed run sees the same batches."""
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(entries))
    window = batch * 16
    batches = []
    for start in range(0, len(order), window):
        chunk = sorted(order[start : start + window], key=lambda i: entries[i]["length"])
        batches.extend(chunk[j : j + batch] for j in range(0, len(chunk), batch))
    perm = rng.permutation(len(batches))
    return [[int(i) for i in batches[p]] for p in perm]


class BatchPlan:
    def __init__(self, entries: Sequence[dict], batch: int, seed: int):
        self.entries, self.batch, self.seed = list(entries), batch, seed
        self.per_epoch = len(epoch_batches(self.entries, batch, seed, 0))
        self._cache: dict[int, list[list[int]]] = {}

    def at(self, step: int) -> list[dict]:
        """The batch of 1-based training step `step`."""
        epoch, index = divmod(step - 1, self.per_epoch)
        if epoch not in self._cache:
            self._cache = {epoch: epoch_batches(self.entries, self.batch, self.seed, epoch)}
        return [self.entries[i] for i in self._cache[epoch][index]]


def eval_batches(
    arrays, entries: Sequence[dict], steps: int, tokens: int = 4096
) -> Iterator[Batch]:
    """The hold-out samples in batches of about `tokens` padded tokens, shortest first; made
    as they are consumed."""
    ordered = sorted(entries, key=lambda e: e["length"])
    group: list[dict] = []
    for e in ordered:
        if group and (len(group) + 1) * e["length"] > tokens:
            yield make_batch(arrays, group, steps)
            group = []
        group.append(e)
    if group:
        yield make_batch(arrays, group, steps)


# ---------------------------------------------------------------------------------------------
# Checkpoints


def save_checkpoint(directory: Path, step: int, model, optimizer, state: dict) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    directory.mkdir(parents=True, exist_ok=True)
    folder = directory / f"step-{step:07d}"
    if folder.exists():
        shutil.rmtree(folder)
    partial = directory / f".step-{step:07d}.partial"
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir()
    mx.save_safetensors(
        str(partial / "model.safetensors"), dict(tree_flatten(model.trainable_parameters()))
    )
    mx.save_safetensors(str(partial / "optimizer.safetensors"), dict(tree_flatten(optimizer.state)))
    write_json(partial / "state.json", {**state, "step": step, "version": CHECKPOINT_VERSION})
    os.replace(partial, folder)
    latest = directory / "latest.json"
    tmp = directory / ".latest.json.tmp"
    write_json(tmp, {"step": step, "folder": folder.name})
    os.replace(tmp, latest)
    for old in directory.glob("step-*"):
        if old != folder:
            shutil.rmtree(old, ignore_errors=True)


def checkpoint_state(directory: Path) -> dict:
    latest = read_json_object(directory / "latest.json")
    folder = directory / latest["folder"]
    state = read_json_object(folder / "state.json")
    if state.get("version") != CHECKPOINT_VERSION:
        raise DrafterError(f"{folder}: checkpoint version {state.get('version')!r} unsupported")
    return {**state, "folder": str(folder)}


def load_checkpoint(state: dict, model, optimizer) -> None:
    """Weights and optimizer state of the checkpoint `checkpoint_state` described."""
    import mlx.core as mx
    from mlx.utils import tree_unflatten

    folder = Path(state["folder"])
    params = mx.load(str(folder / "model.safetensors"))
    model.update(tree_unflatten(list(params.items())))
    optimizer.state = tree_unflatten(list(mx.load(str(folder / "optimizer.safetensors")).items()))
    mx.eval(model.parameters(), optimizer.state)


def _trim_log(path: Path, step: int) -> None:
    """Drop log lines written after the checkpoint a run resumes from."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").split("\n"):
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if entry.get("step", 0) <= step:
            kept.append(line)
    path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")


# ---------------------------------------------------------------------------------------------
# The command


def train(opts: TrainOptions, progress: Progress | None = None) -> TrainReport:
    import mlx.core as mx

    from woodcock.formats import woodcock as native
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
    from woodcock.target_files import target_from_config

    num_layers = target_from_config(opts.target).num_hidden_layers
    init, init_record = _load_init(opts) if opts.init is not None else (None, None)
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
    if init is None:
        head_ids = choose_head(counts, opts.head_size)
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
    spec = build_spec(runner, opts.target, taps, draft_vocab, opts.ttt_steps)
    head_rows = runner.head if head_ids is None else runner.head[head_ids]
    model = build_model(spec, runner.embedding, head_rows, runner.final_norm_weight(), opts.seed)
    if init is not None:
        start_from(model, init, spec, opts.init)
    trainer = Trainer(model, head_ids, runner.head, opts)
    runner.model = None  # the target's weights are no longer needed: free them

    train_entries = [cache.index[s.id] for s in train_samples]
    holdout_entries = [cache.index[s.id] for s in holdout]
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
        load_checkpoint(loaded, model, trainer.optimizer)
        start_step = int(loaded["step"])
        state["initial"] = loaded.get("initial")
        state["train_seconds"] = loaded.get("train_seconds", 0.0)
        state["train_tokens"] = loaded.get("train_tokens", 0)
        state["last_eval"] = loaded.get("last_eval")
        _trim_log(log_path, start_step)
    else:
        ckpt.mkdir(parents=True, exist_ok=True)
        log_path.write_text("", encoding="utf-8")
        initial = trainer.evaluate(eval_batches(arrays, holdout_entries, opts.ttt_steps))
        state["initial"] = initial
        state["train_seconds"], state["train_tokens"] = 0.0, 0
        state["last_eval"] = None
        _append(log_path, {"step": 0, "eval": initial})
    report.resumed_from = start_step
    report.holdout_agreement_initial = state["initial"]["holdout_agreement"]

    # Training
    run_tokens, run_seconds = 0, 0.0
    last = state.get("last_eval")
    final_step = start_step if opts.finish else opts.steps
    for step in range(start_step + 1, final_step + 1):
        t0 = time.perf_counter()
        batch = make_batch(arrays, plan.at(step), opts.ttt_steps)
        metrics = trainer.train_step(batch)
        seconds = time.perf_counter() - t0
        run_tokens += batch.tokens_in
        run_seconds += seconds
        state["train_seconds"] += seconds
        state["train_tokens"] += batch.tokens_in
        report.losses.append(metrics["loss"])
        entry = {
            "step": step,
            **metrics,
            "tokens": batch.tokens_in,
            "seconds": round(seconds, 4),
            "tokens_per_second": round(batch.tokens_in / seconds, 1),
        }
        if step % opts.eval_every == 0 or step == opts.steps:
            last = trainer.evaluate(eval_batches(arrays, holdout_entries, opts.ttt_steps))
            state["last_eval"] = last
            entry["eval"] = last
        _append(log_path, entry)
        if step % opts.checkpoint_every == 0 or step == opts.steps:
            save_checkpoint(ckpt, step, model, trainer.optimizer, state)
        if progress:
            progress("training", step, opts.steps)
    report.steps = final_step
    report.train_seconds = run_seconds
    report.train_tokens_per_second = run_tokens / run_seconds if run_seconds else 0.0
    if last is None or opts.finish:  # resumed from the final checkpoint, or stopped early
        last = trainer.evaluate(eval_batches(arrays, holdout_entries, opts.ttt_steps))
    report.holdout_agreement = last["holdout_agreement"]
    report.holdout_agreement_unconditional = last["holdout_agreement_unconditional"]

    # Output
    vocab_map = VocabMap(head_ids, VocabCounts(counts, info))
    drafter = Drafter(spec, vocab_map, trained_weights(model))
    provenance = {
        "trainer": "woodcock train (seed recipe: EAGLE-3 TTT, soft labels, truncated head)",
        "command": opts.command or [],
        "holdout_agreement": report.holdout_agreement,
        "holdout_agreement_definition": (
            "by draft step k = 1..K: share of hold-out rows where the drafter's argmax at step k"
            " equals the target's full-vocabulary argmax, among rows starting a draft at an"
            " answer position whose k-1 earlier drafts all matched the target's argmax and the"
            " teacher-forced (greedy distilled) token: the greedy acceptance rate at position k"
            " given the earlier drafts were accepted"
        ),
        "holdout_agreement_unconditional": report.holdout_agreement_unconditional,
        "holdout_agreement_initial": report.holdout_agreement_initial,
        "holdout_loss_by_step": last["holdout_loss_by_step"],
        "holdout_rows_by_step": last["holdout_rows"],
        "recipe": {**opts.recipe(), "taps": list(taps), "draft_vocab_size": draft_vocab},
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


def _append(path: Path, entry: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(entry) + "\n")
