"""encoder.waiting.next_to_admit against a brute-force reading of its rules."""

import numpy as np
import pytest

from encoder.admission import ResidentExperts
from encoder.waiting import next_to_admit


def brute_force(waited, profiles, residents, max_wait):
    overdue = [i for i, w in enumerate(waited) if w >= max_wait]
    if overdue:
        return max(overdue, key=lambda i: (waited[i], -i))
    if profiles[0] is None or not residents:
        return 0
    first_plain = next((i for i, p in enumerate(profiles) if p is None), len(profiles))

    def new_experts(u):
        idle = np.prod([1.0 - np.clip(r, 0, 0.999) for r in residents], axis=0)
        return float((u * idle).sum())
    return min(range(first_plain), key=lambda i: (round(new_experts(profiles[i]), 9), i))


def test_matches_brute_force_on_random_pools():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n, size = int(rng.integers(1, 7)), 6
        profiles = [None if rng.random() < 0.2 else rng.random(size) * (rng.random(size) < 0.5) for _ in range(n)]
        residents = [rng.random(size) * (rng.random(size) < 0.5) for _ in range(int(rng.integers(0, 3)))]
        waited = list(rng.integers(0, 12, size=n).astype(float))
        resident = ResidentExperts(1, size)
        for r in residents:
            resident.admit(r)
        assert next_to_admit(waited, profiles, resident, 10.0) == brute_force(waited, profiles, residents, 10.0)


def test_needs_a_candidate_and_a_resident_set_of_the_right_size():
    with pytest.raises(ValueError, match="no waiting request"):
        next_to_admit([], [], None, 1.0)
    resident = ResidentExperts(1, 4)
    resident.admit(np.ones(4) * 0.5)
    with pytest.raises(ValueError, match="resident set holds vectors of 4"):
        next_to_admit([0.0], [np.ones(6)], resident, 1.0)
