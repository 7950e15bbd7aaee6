"""benchmarks.resident_pick: the allowed candidate of lowest cost, against brute force for both kinds of
resident set."""

import numpy as np
import pytest

from benchmarks.resident_pick import pick
from moe_cohort.admission.resident import ResidentExperts
from tests.helpers.brute_force import brute_expected_new, embedded_residents, random_profiles


def test_pick_is_the_allowed_candidate_with_the_fewest_expected_new_experts():
    p = random_profiles(30, seed=1)
    state = ResidentExperts(3, 8)
    for r in (0, 5):
        state.add(p[r])
    allowed = np.ones(30, bool)
    allowed[[0, 5, 7]] = False
    brute = [(brute_expected_new([p[0], p[5]], p[c]), c) for c in range(30) if allowed[c]]
    assert pick(state, p, allowed) == min(brute)[1]


def test_pick_is_the_allowed_candidate_nearest_the_resident_embeddings():
    x, state = embedded_residents()
    allowed = np.ones(20, bool)
    allowed[[2, 9]] = False
    centre = x[2] + x[9]
    cos = x @ centre / np.linalg.norm(centre)
    assert pick(state, x, allowed) == int(np.argmax(np.where(allowed, cos, -np.inf)))


def test_pick_refuses_an_empty_choice():
    with pytest.raises(ValueError):
        pick(ResidentExperts(3, 8), random_profiles(3), np.zeros(3, bool))
