"""The speculative acceptance rule alone, on fixed distributions: with 100,000 draws at once
(`mx.vmap` over PRNG keys) it sees biases far smaller than the end-to-end chi-square tests can,
whose every draw is a generation. Each row of p here is the target's distribution at that
position whatever came before, so the token emitted at position j must follow p[j], and a draft
must survive with probability sum(min(p[j], q[j]))."""

import math

import mlx.core as mx
import numpy as np
import pytest
from stats_helpers import chi_square_exceeds

from woodcock.runtime.sampling import accept_drafts

VOCAB, DRAFTS, DRAWS = 12, 3, 100_000


def dirichlet(rng, rows, support=VOCAB):
    """rows distributions over the vocabulary, nonzero on the first `support` tokens only"""
    probs = np.zeros((rows, VOCAB))
    probs[:, :support] = rng.dirichlet(np.ones(support), size=rows)
    return probs


def case(name):
    rng = np.random.default_rng(7)
    p, q = dirichlet(rng, DRAFTS + 1), dirichlet(rng, DRAFTS)
    if name == "reduced draft vocabulary":  # the drafter's head covers 5 of the 12 tokens
        q = dirichlet(rng, DRAFTS, support=5)
    elif name == "a copied token":  # prompt lookup's rows are one-hot
        q[1] = np.eye(VOCAB)[4]
    elif name == "a truncated target":  # top-k: drafts the target cannot emit are rejected
        p = dirichlet(rng, DRAFTS + 1, support=6)
    elif name == "the drafter is the target":
        q = p[:DRAFTS].copy()
    return p.astype(np.float32), q.astype(np.float32)


def draw(p, q, keys):
    """(drafts [n, k] drawn from q, accepted m [n], the token after them [n]) for each key"""
    p, q = mx.array(p), mx.array(q)
    q_logs = mx.log(q)

    def once(key):
        draft_key, accept_key = mx.random.split(key)
        drafts = mx.random.categorical(q_logs, key=draft_key).astype(mx.int32)
        return (drafts, *accept_drafts(drafts, q, p, key=accept_key))

    drafts, m, token = mx.vmap(once)(keys)
    unbatched = [once(key) for key in keys[:8]]
    for i, one in enumerate(unbatched):  # vmap runs the rule as a single call does
        assert [np.array(x).tolist() for x in one] == [
            drafts[i].tolist(),
            m[i].item(),
            token[i].item(),
        ]
    return np.array(drafts), np.array(m), np.array(token)


@pytest.mark.parametrize(
    "name",
    [
        "random",
        "reduced draft vocabulary",
        "a copied token",
        "a truncated target",
        "the drafter is the target",
    ],
)
def test_every_position_follows_the_target(name):
    p, q = case(name)
    drafts, m, token = draw(p, q, mx.random.split(mx.random.key(3), DRAWS))
    emitted = np.concatenate([drafts, token[:, None]], axis=1)
    emitted[np.arange(DRAWS), m] = token  # position m holds the resampled or bonus token
    for j in range(DRAFTS + 1):
        reached = m >= j
        counts = np.bincount(emitted[reached, j], minlength=VOCAB)
        assert not chi_square_exceeds(counts, p[j]), (name, j)
        if j == DRAFTS:
            break
        survive = min(np.minimum(p[j], q[j]).sum(), 1.0)
        rate, n = (m[reached] > j).mean(), reached.sum()
        tolerance = 5 * math.sqrt(survive * (1 - survive) / n) + 1e-6
        assert abs(rate - survive) <= tolerance, (name, j, rate, survive)
