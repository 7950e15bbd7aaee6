"""Resident sets against brute force: expected new experts, nearest embedding."""

import numpy as np
import pytest

from moe_cohort.admission.resident import ResidentEmbedding, ResidentExperts


def _profiles(n, layers=3, experts=8, seed=0):
    rng = np.random.default_rng(seed)
    p = rng.random((n, layers, experts)) * (rng.random((n, layers, experts)) < 0.5)
    return (p / np.maximum(p.max(axis=-1, keepdims=True), 1e-9)).astype(np.float32)  # [n, L, E] in [0, 1]


def _brute_expected_new(resident, cand):
    """sum_{l,e} u_c[l,e] * prod_r (1 - u_r[l,e]), by loops."""
    total = 0.0
    for l in range(cand.shape[0]):
        for e in range(cand.shape[1]):
            idle = 1.0
            for r in resident:
                idle *= 1.0 - min(float(r[l, e]), 1 - 1e-3)
            total += float(cand[l, e]) * idle
    return total


def test_expected_new_experts_follow_admits_and_releases():
    p = _profiles(9)
    state = ResidentExperts(3, 8)
    for r in (0, 1, 2, 3):
        state.admit(p[r])
    state.release(p[1])
    got = state.scores(p[4:])
    want = [_brute_expected_new([p[0], p[2], p[3]], c) for c in p[4:]]
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_pick_is_the_allowed_candidate_with_the_fewest_expected_new_experts():
    p = _profiles(30, seed=1)
    state = ResidentExperts(3, 8)
    for r in (0, 5):
        state.admit(p[r])
    allowed = np.ones(30, bool)
    allowed[[0, 5, 7]] = False
    brute = [(_brute_expected_new([p[0], p[5]], p[c]), c) for c in range(30) if allowed[c]]
    assert state.pick(p, allowed) == min(brute)[1]


def test_an_empty_resident_set_counts_every_expert_of_the_candidate_as_new():
    p = _profiles(4, seed=2)
    state = ResidentExperts(3, 8)
    state.admit(p[0])
    state.release(p[0])
    np.testing.assert_allclose(state.scores(p), p.sum(axis=(1, 2)), rtol=1e-6)


def test_nearest_embedding_picks_the_largest_cosine_with_the_resident_sum():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(20, 5)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    state = ResidentEmbedding(5)
    for r in (2, 4, 9):
        state.admit(x[r])
    state.release(x[4])
    allowed = np.ones(20, bool)
    allowed[[2, 9]] = False
    centre = x[2] + x[9]
    cos = x @ centre / np.linalg.norm(centre)
    assert state.pick(x, allowed) == int(np.argmax(np.where(allowed, cos, -np.inf)))


def test_pick_refuses_an_empty_choice():
    with pytest.raises(ValueError):
        ResidentExperts(3, 8).pick(_profiles(3), np.zeros(3, bool))
