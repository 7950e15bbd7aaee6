"""Spearman(cosine, target) against a loop over pairs."""

import numpy as np
from scipy.stats import spearmanr

from tests.conftest import random_traces
from moe_cohort.train.correlation import cosine_spearman
from moe_cohort.train.targets import pair_targets, profiles


def test_cosine_spearman_matches_a_loop_over_pairs():
    ts = random_traces(12, num_experts=8, num_layers=2, top_k=2, max_prompt=8, seed=3)
    prof = profiles(ts)
    keep = np.flatnonzero(prof.sum(axis=(1, 2)) > 0)
    prof = prof[keep]
    emb = np.random.default_rng(0).normal(size=(len(keep), 5))
    unit = emb / np.linalg.norm(emb, axis=1, keepdims=True)
    pairs = [(a, b) for a in range(len(keep)) for b in range(a + 1, len(keep))]
    cos = [unit[a] @ unit[b] for a, b in pairs]
    target = pair_targets(prof, pairs, ts.top_k)
    got = cosine_spearman(emb, prof, ts.top_k, near=3)
    assert np.isclose(got["all_pairs"], spearmanr(cos, target).statistic)
    tm = {p: t for p, t in zip(pairs, target)}
    near = set()
    for a in range(len(keep)):
        partners = sorted((b for b in range(len(keep)) if b != a), key=lambda b: (-tm[min(a, b), max(a, b)], b))[:3]
        near |= {(min(a, b), max(a, b)) for b in partners}
    near = sorted(near)
    want = spearmanr([unit[a] @ unit[b] for a, b in near], [tm[p] for p in near]).statistic
    assert np.isclose(got["near_pairs"], want)


def test_embeddings_that_are_the_profiles_correlate_positively():
    ts = random_traces(15, num_experts=6, num_layers=2, top_k=2, max_prompt=9, seed=4)
    prof = profiles(ts)
    prof = prof[prof.sum(axis=(1, 2)) > 0]
    assert cosine_spearman(prof.reshape(len(prof), -1), prof, ts.top_k)["all_pairs"] > 0.5
