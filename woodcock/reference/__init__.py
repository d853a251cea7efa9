"""Torch reference forward of every drafter the IR describes, and a target wrapper that yields
the tapped hidden states. The oracle the MLX runtime and the format converters are checked
against; needs the `torch` extra."""

try:
    import torch  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("woodcock.reference needs PyTorch: pip install -e '.[torch]'") from e

from woodcock.reference.drafter import DraftOutput, DraftResult, KVCache, TorchDrafter
from woodcock.reference.torch_target import TorchTarget

__all__ = ["DraftOutput", "DraftResult", "KVCache", "TorchDrafter", "TorchTarget"]
