"""Resident sets against brute force: expected new experts, minus the cosine with the residents' sum; each
kind's cost is lower for a candidate like the residents than for one unlike them."""

import numpy as np
import pytest

from moe_cohort.admission.resident import ResidentEmbedding, ResidentExperts
from tests.helpers.brute_force import brute_expected_new, embedded_residents, random_profiles


def test_expected_new_experts_follow_adds_and_removes():
    p = random_profiles(9)
    state = ResidentExperts(3, 8)
    for r in (0, 1, 2, 3):
        state.add(p[r])
    state.remove(p[1])
    got = state.cost(p[4:])
    want = [brute_expected_new([p[0], p[2], p[3]], c) for c in p[4:]]
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_an_empty_resident_set_counts_every_expert_of_the_candidate_as_new():
    p = random_profiles(4, seed=2)
    state = ResidentExperts(3, 8)
    state.add(p[0])
    state.remove(p[0])
    np.testing.assert_allclose(state.cost(p), p.sum(axis=(1, 2)), rtol=1e-6)


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
