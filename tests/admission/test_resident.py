"""Resident sets against brute force: expected new experts, minus the cosine with the residents' sum; each
kind's cost is lower for a candidate like the residents than for one unlike them."""

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


def test_expected_new_experts_follow_adds_and_removes():
    p = _profiles(9)
    state = ResidentExperts(3, 8)
    for r in (0, 1, 2, 3):
        state.add(p[r])
    state.remove(p[1])
    got = state.cost(p[4:])
    want = [_brute_expected_new([p[0], p[2], p[3]], c) for c in p[4:]]
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_an_empty_resident_set_counts_every_expert_of_the_candidate_as_new():
    p = _profiles(4, seed=2)
    state = ResidentExperts(3, 8)
    state.add(p[0])
    state.remove(p[0])
    np.testing.assert_allclose(state.cost(p), p.sum(axis=(1, 2)), rtol=1e-6)


def embedded_residents() -> tuple[np.ndarray, ResidentEmbedding]:
    """20 unit embeddings [20, 5] and a resident set that holds rows 2 and 9 (4 came and left)."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(20, 5)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    state = ResidentEmbedding(5)
    for r in (2, 4, 9):
        state.add(x[r])
    state.remove(x[4])
    return x, state


def test_embedding_cost_is_minus_the_cosine_with_the_resident_sum():
    x, state = embedded_residents()
    centre = x[2] + x[9]
    np.testing.assert_allclose(state.cost(x), -(x @ centre) / np.linalg.norm(centre), rtol=1e-5, atol=1e-6)
    state.remove(x[2])
    state.remove(x[9])
    np.testing.assert_array_equal(state.cost(x), np.zeros(20))  # nobody resident: every candidate alike


def _like_and_unlike(kind):
    """A resident set of `kind` holding one vector, and two candidates: one like it, one unlike it."""
    if kind == "experts":
        state, held = ResidentExperts(2, 4), np.array([[0.9, 0.8, 0, 0], [0, 0.7, 0.9, 0]], np.float32)
        unlike = np.array([[0, 0, 0.9, 0.8], [0.9, 0, 0, 0.7]], np.float32)
    else:
        state, held = ResidentEmbedding(4), np.array([0.8, 0.6, 0, 0], np.float32)
        unlike = np.array([0, 0, 0.6, 0.8], np.float32)
    state.add(held)
    return state, np.stack([held, unlike]).reshape(2, -1)


@pytest.mark.parametrize("kind", ["experts", "embedding"])
def test_a_candidate_like_the_residents_costs_less_than_one_unlike_them(kind):
    state, candidates = _like_and_unlike(kind)
    like, unlike = state.cost(candidates)
    assert like < unlike
    assert state.size == candidates.shape[1] and state.count == 1
