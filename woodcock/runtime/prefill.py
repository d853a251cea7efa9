"""How a prompt is cut into prefill forwards, by backend.

A GPU runs a small model's forward in about the time of its launches, whatever its rows, so a
prefill there takes big chunks (and distillation prefills many prompts in one forward). On MLX's
CPU backend a forward's cost grows with its attention scores (chunk x keys a head, each an exp
and several passes over memory) faster than its matmuls shrink per token: on 2 cores a
4,096-token prompt of the default target took 66 s in forwards of 512 tokens and 38 s in these
sizes, and distilling 32 conversations (32 rows x 512 tokens a forward before) 550 s and 233 s
(benchmarks/RESULTS.md, "Prefill in smaller forwards on the CPU").
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True)
class PrefillSizes:
    chunk: int  # a prompt's tokens a forward while the scores fit `scores`
    long_chunk: int  # its tokens a forward once they would not
    scores: int  # query x key pairs a head a forward may score with `chunk` (0: no limit)
    group_tokens: int  # padded tokens a forward when prompts are prefilled together
    # a prompt beginning with another's head starts from that head's cache (woodcock.runtime.
    # greedy_batch): fewer tokens computed, but such a prompt waits for the head's group
    shared_heads: bool = True

    def spans(self, length: int, rows: int = 1, cached: int = 0) -> list[tuple[int, int]]:
        """[(start, end)] of the forwards that prefill `length` new tokens of each of `rows`
        prompts (padded to one length) after `cached` tokens already in their caches."""
        spans, start = [], 0
        while start < length:
            chunk = self.chunk
            if self.scores and rows * chunk * (cached + start + chunk) > self.scores:
                chunk = self.long_chunk
            spans.append((start, min(length, start + chunk)))
            start += chunk
        return spans


# GPU: prompts sharing heads would cut the groups of many prompts that make its prefill fast
# (4-10 times as many groups for the training prompts, simulated); not measured there yet
GPU_SIZES = PrefillSizes(
    chunk=512, long_chunk=512, scores=0, group_tokens=16384, shared_heads=False
)
# measured on 2 cores with OpenBLAS: 256 a forward is as fast as 512 while the keys are few,
# 128 once they pass about 512; groups gain nothing over one prompt at a time beyond 256 tokens
CPU_SIZES = PrefillSizes(chunk=256, long_chunk=128, scores=131072, group_tokens=256)


def prefill_sizes() -> PrefillSizes:
    """The sizes for the backend that computes: MLX's default device."""
    return CPU_SIZES if mx.default_device().type == mx.cpu else GPU_SIZES
