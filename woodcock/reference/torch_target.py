"""A transformers causal LM as the drafter's target: logits plus the tapped hidden states in
Woodcock's layer-id convention (id L = residual stream after L decoder layers, pre-final-norm)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from woodcock.errors import DrafterError
from woodcock.loading import resolve_source

Tensor = torch.Tensor


class TorchTarget:
    """path_or_model: a local directory (or a Hugging Face id in the local cache) loaded with
    AutoModelForCausalLM, or an already-built model (moved to `dtype`, put in eval mode)."""

    def __init__(self, path_or_model: str | os.PathLike | nn.Module, dtype=torch.float32):
        if isinstance(path_or_model, str | os.PathLike):
            from transformers import AutoModelForCausalLM

            path: Path = resolve_source(path_or_model)
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
        else:
            model = path_or_model.to(dtype)
        self.model = model.eval()
        self.dtype = dtype
        config = model.config.get_text_config()
        self.num_layers: int = config.num_hidden_layers
        decoder = model.get_decoder()
        self._final_norm = getattr(decoder, "norm", None)
        if not isinstance(self._final_norm, nn.Module):
            raise DrafterError(
                f"{type(model).__name__}: no final norm module at get_decoder().norm; the tap at"
                f" id {self.num_layers} (its input) cannot be captured"
            )

    @torch.no_grad()
    def forward(self, input_ids: Tensor, layer_ids: Sequence[int]) -> tuple[Tensor, Tensor]:
        """input_ids [T] -> (logits [T, V], taps [T, A*Ht]: the states of `layer_ids`, strictly
        ascending, concatenated low to high)."""
        ids = list(layer_ids)
        if not ids or any(b <= a for a, b in zip(ids, ids[1:], strict=False)):
            raise DrafterError(f"layer_ids = {ids}: expected strictly ascending ids")
        if ids[0] < 0 or ids[-1] > self.num_layers:
            raise DrafterError(
                f"layer_ids = {ids}: expected ids in [0, {self.num_layers}] (id L = residual"
                " stream after L layers)"
            )
        captured: list[Tensor] = []

        def grab(_module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
            captured.append(args[0] if args else kwargs["hidden_states"])

        # HF's hidden_states[N] is after the final norm; id N is the norm's input.
        handle = self._final_norm.register_forward_pre_hook(grab, with_kwargs=True)
        try:
            out = self.model(
                input_ids=input_ids.long()[None], output_hidden_states=True, use_cache=False
            )
        finally:
            handle.remove()
        if len(captured) != 1:
            raise DrafterError(
                f"{type(self.model).__name__}: the final norm ran {len(captured)} times, expected"
                " once; cannot tell which call holds the last residual stream"
            )
        states = [captured[0] if i == self.num_layers else out.hidden_states[i] for i in ids]
        return out.logits[0], torch.cat(states, dim=-1)[0]

    __call__ = forward
