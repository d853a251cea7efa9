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


def exact_two_token_marginals(model, prompt, sampling):
    """P(first token), P(second token) of plain sampling, computed from the target's logits."""
    logits = model(mx.array([prompt]))[0, -1]
    first = np.array(sampling.probabilities(logits))
    batch = mx.array([prompt + [t] for t in range(len(first))])
    second = np.array(sampling.probabilities(model(batch)[:, -1]))
    return first, first @ second
