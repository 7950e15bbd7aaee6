"""moe_cohort.admission.waiting.WaitingPool against a brute-force reading of its rules."""

import numpy as np
import pytest

from moe_cohort.admission.resident import ResidentEmbedding, ResidentExperts
from moe_cohort.admission.waiting import WaitingPool


def brute_force(waited, profiles, residents, max_wait, bounded=None):
    """Index (in arrival order) of the request the rules admit; ties go to the earliest arrival."""
    bounded = bounded or [True] * len(waited)
    overdue = [i for i, w in enumerate(waited) if w >= max_wait and bounded[i]]
    if overdue:
        return max(overdue, key=lambda i: (waited[i], -i))
    if profiles[0] is None or not residents:
        return 0
    first_plain = next((i for i, p in enumerate(profiles) if p is None), len(profiles))

    def new_experts(u):
        idle = np.prod([1.0 - np.clip(r, 0, 0.999) for r in residents], axis=0)
        return float((u * idle).sum())
    return min(range(first_plain), key=lambda i: (round(new_experts(profiles[i]), 6), i))


def test_matches_brute_force_on_random_pools_with_arrivals_and_departures():
    rng = np.random.default_rng(0)
    for trial in range(200):
        size, pool = 6, WaitingPool(capacity=2)  # small capacity: the pool grows on the way
        keys = [f"k{i}" for i in range(int(rng.integers(2, 9)))]
        for k in keys:
            vector = None if rng.random() < 0.2 else (rng.random(size) * (rng.random(size) < 0.5)).astype(np.float32)
            pool.add(k, vector, arrived=float(rng.integers(0, 12)), bounded=rng.random() < 0.7)
        gone = keys[int(rng.integers(0, len(keys)))]
        pool.remove(gone)  # a departure leaves a hole that a later arrival fills: rows are not arrival order
        keys.remove(gone)
        keys.append("late")
        pool.add("late", (rng.random(size) * (rng.random(size) < 0.5)).astype(np.float32), float(rng.integers(0, 12)))
        residents = [(rng.random(size) * (rng.random(size) < 0.5)).astype(np.float32) for _ in range(int(rng.integers(0, 3)))]
        resident = ResidentExperts(1, size)
        for r in residents:
            resident.add(r)
        rows = [pool.rows[k] for k in keys]
        profiles = [pool.matrix[r] if pool.profiled[r] else None for r in rows]
        waited = [12.0 - pool.arrived[r] for r in rows]
        bounded = [bool(pool.bounded[r]) for r in rows]
        assert pool.pick(resident, now=12.0, max_wait=10.0) == keys[brute_force(waited, profiles, residents, 10.0,
                                                                                 bounded)], trial


@pytest.mark.parametrize("resident", [ResidentExperts(1, 2), ResidentEmbedding(2)], ids=["experts", "embedding"])
def test_the_candidate_like_the_residents_goes_first_for_either_kind_of_resident_set(resident):
    pool = WaitingPool()
    a, b = np.array([1.0, 0.0]), np.array([0.0, 1.0])
    pool.add("b", b, 0.0)
    pool.add("a", a, 1.0)
    resident.add(a)
    assert pool.pick(resident, now=1.0, max_wait=None) == "a"


def test_errors_name_what_is_wrong():
    pool = WaitingPool()
    with pytest.raises(ValueError, match="no waiting request"):
        pool.pick(None, 0.0, 1.0)
    pool.add("x", np.ones(6), 0.0)
    with pytest.raises(ValueError, match="waiting already"):
        pool.add("x", None, 0.0)
    resident = ResidentExperts(1, 4)
    resident.add(np.ones(4) * 0.5)
    with pytest.raises(ValueError, match="resident set holds vectors of 4, the pool 6"):
        pool.pick(resident, 0.0, 1.0)


def test_a_request_passed_over_max_passed_times_goes_first_counted_against_a_replay_of_the_picks():
    rng = np.random.default_rng(1)
    for trial in range(50):
        pool, resident, max_passed = WaitingPool(capacity=2), ResidentExperts(1, 4), int(rng.integers(1, 4))
        order, passed = [], {}  # arrival order of the waiting keys; brute-force count of later admissions
        for step in range(30):
            if rng.random() < 0.6 or not order:
                key = f"k{trial}-{step}"
                pool.add(key, rng.random(4).astype(np.float32), 0.0, bounded=rng.random() < 0.8)
                order.append(key)
                passed[key] = 0
                continue
            over = [k for k in order if passed[k] >= max_passed and pool.bounded[pool.rows[k]]]
            chosen = pool.pick(resident, 0.0, None, max_passed)
            if over:
                assert chosen == over[0]  # the first to arrive of those passed over enough
            if rng.random() < 0.2:  # a request leaves without a slot (its client hung up): it passes nobody
                pool.remove(chosen)
            else:
                for k in order[: order.index(chosen)]:
                    passed[k] += 1
                pool.remove(chosen, admitted=True)
                resident.add(rng.random(4).astype(np.float32))
            order.remove(chosen)
            del passed[chosen]
        bounded = [passed[k] for k in order if pool.bounded[pool.rows[k]]]
        assert max(bounded, default=0) <= max_passed + len(order)  # the count stays bounded by the rule


def test_without_max_passed_a_poor_fit_may_wait_for_ever():
    pool, resident = WaitingPool(), ResidentExperts(1, 2)
    resident.add(np.array([1.0, 0.0], np.float32))
    pool.add("misfit", np.array([0.0, 1.0], np.float32), 0.0)
    for i in range(5):
        pool.add(f"fit{i}", np.array([1.0, 0.0], np.float32), 0.0)
    picks = []
    for _ in range(5):
        picks.append(pool.pick(resident, 0.0, None, max_passed=None if len(picks) < 3 else 3))
        pool.remove(picks[-1], admitted=True)
    assert picks[:3] == ["fit0", "fit1", "fit2"] and picks[3] == "misfit"  # passed 3 times: its turn


def test_a_batch_line_is_under_neither_bound_and_a_poor_fit_waits_while_better_ones_come():
    pool, resident = WaitingPool(), ResidentExperts(1, 2)
    resident.add(np.array([1.0, 0.0], np.float32))
    pool.add("line", np.array([0.0, 1.0], np.float32), 0.0, bounded=False)  # waited 100 s, passed 4 times below
    for i in range(4):
        pool.add(f"fit{i}", np.array([1.0, 0.0], np.float32), 99.5)
    picks = []
    for _ in range(5):
        picks.append(pool.pick(resident, 100.0, max_wait=5.0, max_passed=1))
        pool.remove(picks[-1], admitted=True)
    assert picks == ["fit0", "fit1", "fit2", "fit3", "line"]  # bounded: "line" would have gone first (waited)
