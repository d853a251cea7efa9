"""Where a drafter's weights start: from the target's embedding, head rows and final norm, or
with --init from a trained drafter's weights, which must have exactly the shape the run builds
(its taps and head rows are kept)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np

from woodcock.default_target import resolve_drafter
from woodcock.errors import DrafterError
from woodcock.ir import Eagle3
from woodcock.loading import load_drafter_with_format, resolve_source
from woodcock.train.options import TrainOptions
from woodcock.train.run import RunInputs


def load_init(opts: TrainOptions):
    """The drafter to start from and the record of it for the provenance."""
    source = resolve_drafter(opts.init)
    init, fmt = load_drafter_with_format(source)
    if init.spec.algorithm.name != opts.algorithm:
        raise DrafterError(
            f"--init {opts.init}: algorithm = {init.spec.algorithm.name!r}; this trains"
            f" {opts.algorithm!r}"
        )
    head_size = opts.draft_head_size()
    kept = init.spec.draft_vocab_size if init.vocab.draft_to_target is not None else None
    if kept is not None and head_size != kept:
        raise DrafterError(
            f"--init {opts.init}: draft_vocab_size = {kept}, --head-size {head_size}: a drafter"
            f" to start from keeps its head rows; pass --head-size {kept}"
        )
    record: dict[str, Any] = {"source": str(opts.init), "format": fmt.NAME}
    if fmt.NAME == "woodcock":
        theirs = fmt.read_provenance(resolve_source(source))
        record["data"] = theirs.get("data", {}).get("dir")
        record["training"] = theirs.get("training")
        for key in ("holdout_agreement", "holdout"):
            if key in theirs:
                record[key] = theirs[key]
    return init, record


def start_from(model, init, spec, source: str) -> None:
    """Load `init`'s weights into the freshly built `model`; `init` must have the spec this run
    builds (the number of TTT steps, the target's name and a layer count its format does not
    record aside). A copy of the target's embedding counts as sharing it (a conversion for vLLM
    copies it in)."""
    algorithm = init.spec.algorithm
    head = init.spec.head
    if (head.embedding, spec.head.embedding) == ("own", "shared") and np.array_equal(
        np.asarray(init.weights["embed_tokens.weight"], np.float32),
        np.asarray(model.embed_tokens.weight.astype(mx.float32)),
    ):
        head = dataclasses.replace(head, embedding="shared")
    if isinstance(algorithm, Eagle3):
        algorithm = dataclasses.replace(
            algorithm, speculative_tokens=spec.algorithm.speculative_tokens
        )
    theirs = dataclasses.replace(
        init.spec,
        algorithm=algorithm,
        head=head,
        target=dataclasses.replace(
            init.spec.target,
            name_or_path=spec.target.name_or_path,
            architectures=spec.target.architectures,
            num_hidden_layers=init.spec.target.num_hidden_layers or spec.target.num_hidden_layers,
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
    # the embedding is the target's, not the drafter's
    weights = [
        (name, mx.array(np.asarray(a, np.float32)))
        for name, a in init.weights.items()
        if name != "embed_tokens.weight"
    ]
    model.load_weights(weights, strict=False)
    mx.eval(model.parameters())


def started_model(inputs: RunInputs, spec, build: Callable):
    """The module `build` makes for `spec`, from the target's embedding, head rows of the draft
    vocabulary and final norm, then --init's weights if given."""
    runner, opts = inputs.runner, inputs.opts
    head_rows = runner.head if inputs.head_ids is None else runner.head[inputs.head_ids]
    model = build(spec, runner.embedding, head_rows, runner.final_norm_weight(), opts.seed)
    if inputs.init is not None:
        start_from(model, inputs.init, spec, opts.init)
    return model
