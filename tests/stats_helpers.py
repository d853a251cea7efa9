"""Exact distributions of plain sampling and a chi-square check against them."""

import math

import mlx.core as mx
import numpy as np


def chi_square_exceeds(counts: np.ndarray, probs: np.ndarray, z: float = 3.7) -> bool:
    """Pearson's test at about p = 1e-4 (Wilson-Hilferty critical value); cells with an expected
    count under 5 are pooled."""
    expected = probs * counts.sum()
    small = expected < 5
    observed = np.append(counts[~small], counts[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    keep = expected > 0
    observed, expected = observed[keep], expected[keep]
    statistic = ((observed - expected) ** 2 / expected).sum()
    df = len(expected) - 1
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return statistic > critical


def exact_marginals(model, prompt, sampling, tokens):
    """[P(token i) for i = 1..tokens] of plain sampling, computed from the target's logits over
    every continuation (vocab ** (tokens - 1) rows in the last forward)."""
    prefixes, weights, marginals = [list(prompt)], np.ones(1), []
    while True:
        probs = np.array(sampling.probabilities(model(mx.array(prefixes))[:, -1]))  # [N, V]
        joint = weights[:, None] * probs
        marginals.append(joint.sum(axis=0))
        if len(marginals) == tokens:
            return marginals
        prefixes = [p + [t] for p in prefixes for t in range(probs.shape[1])]
        weights = joint.reshape(-1)
