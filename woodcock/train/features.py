"""The target's side of training: its tapped and final hidden states over every sample, computed
once and cached on disk in fp16 (with a per-row exponent), keyed by the target, taps and length."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from woodcock.errors import DrafterError
from woodcock.jsonfile import read_json_object, write_json
from woodcock.loading import resolve_source
from woodcock.runtime.target import MlxTarget, recording
from woodcock.target_checkpoint import load_mlx_target
from woodcock.train.options import Progress

if TYPE_CHECKING:
    from woodcock.train.data import Sample

FEATURES_VERSION = 2


FP16_RANGE = 2.0**15  # the top of fp16's largest binade


def to_fp16(x, parts: int):
    """x [..., parts * W] (mx) -> (fp16 [..., parts * W], int8 exponents e [..., parts]): each
    part is divided by 2^e, the smallest e >= 0 that brings its largest |value| to at most 2^15.
    Massive activations (SmolLM2's middle layers reach 2.5e4, near fp16's 65504) can then never
    overflow, and every value keeps fp16's relative precision."""
    shape = x.shape
    y = x.reshape(*shape[:-1], parts, -1)
    peak = mx.max(mx.abs(y), axis=-1)
    exponent = mx.maximum(mx.ceil(mx.log2(peak / FP16_RANGE)), 0.0)
    y = y * mx.power(2.0, -exponent)[..., None]
    return y.reshape(shape).astype(mx.float16), exponent.astype(mx.int8)


# 2^e for every int8 exponent e >= 0 that `to_fp16` writes, exactly
POWERS_OF_TWO = 2.0 ** np.arange(128, dtype=np.float32)


def from_fp16(x: np.ndarray, exponent: np.ndarray) -> mx.array:
    """The inverse of `to_fp16`, as a float32 array made on the default device, exactly the
    values the host would compute: the host only copies fp16 rows (a batch of 64 sequences of
    the default target holds about 170 MB of float32 taps) and the arithmetic runs where the
    training step runs."""
    parts = exponent.shape[-1]
    scale = mx.take(mx.array(POWERS_OF_TWO), mx.array(exponent.astype(np.int32)))
    y = mx.array(x).astype(mx.float32).reshape(*x.shape[:-1], parts, -1)
    return (y * scale[..., None]).reshape(x.shape)


class TargetRunner:
    """An mlx-lm model as the teacher: taps, final hidden state, full-vocabulary argmax."""

    def __init__(self, source: str, layer_ids: Sequence[int]):
        self.model, self.tokenizer = load_mlx_target(source)
        if mx.default_device() == mx.cpu:
            self.model.set_dtype(mx.float32)
        self.layer_ids = tuple(layer_ids)
        adapter = MlxTarget(self.model, (), name=f"target {source}")
        if not isinstance(getattr(self.model, "model", None), nn.Module):
            raise DrafterError(
                f"target {source}: no decoder at `model.model` ({type(self.model).__module__}):"
                " training reads the final hidden state there, so this family cannot be a teacher"
            )
        self.num_layers, self.layers = adapter.num_layers, adapter.layers
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
        inner = getattr(self.model, "model", None)
        norm = getattr(inner, "norm", None)
        weight = getattr(norm, "weight", None)
        if isinstance(weight, mx.array) and weight.shape == (self.hidden_size,):
            return np.array(weight.astype(mx.float32))
        return None

    def run(self, tokens: np.ndarray) -> dict[str, np.ndarray]:
        """tokens int32 [B, L] (right-padded) -> taps [B, L, A*Ht] and final hidden [B, L, Ht]
        as `to_fp16` stores them (with their exponents), argmax int32 [B, L]."""
        x = mx.array(tokens)
        inner = self.model.model
        with recording(self.layers, self.layer_ids) as states:
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
        """Compute what is missing, in right-padded batches of <= batch_tokens padded tokens
        over all the samples, longest first. The batches are the same whatever is cached
        already: a batch with any sample missing is computed whole and only the missing rows
        are written, so a run that continues an interrupted cache stores the bits an
        uninterrupted one would (padding into another batch changes the low bits)."""
        missing = {s.id for s in self.missing(samples)}
        if not missing:
            return
        ordered = sorted(samples, key=lambda s: -len(s.tokens))
        groups, i = [], 0
        while i < len(ordered):
            count = max(1, min(16, batch_tokens // len(ordered[i].tokens)))
            groups.append(ordered[i : i + count])
            i += count
        groups = [g for g in groups if any(s.id in missing for s in g)]
        total = sum(len(s.tokens) for s in ordered if s.id in missing)
        done = 0
        handles = {name: open(self.dir / f"{name}.bin", "ab") for name, _, _ in self.FILES}
        try:
            with open(self.dir / "index.jsonl", "a", encoding="utf-8") as index:
                for group in groups:
                    length = len(group[0].tokens)
                    padded = np.zeros((len(group), length), np.int32)
                    for row, s in enumerate(group):
                        padded[row, : len(s.tokens)] = s.tokens
                    computed = runner.run(padded)
                    for row, s in enumerate(group):
                        if s.id not in missing:
                            continue
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
