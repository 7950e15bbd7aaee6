"""moe_cohort.admission.router.ReplicaRouter: the three routings against hand-made cases and brute force, and the load bound."""

import numpy as np
import pytest

from moe_cohort.admission.router import ROUTINGS, ReplicaRouter
from tests.helpers.brute_force import expected_new

A, B = np.array([1.0, 1.0, 0, 0, 0, 0]), np.array([0, 0, 0, 0, 1.0, 1.0])  # two experts each, disjoint
A2, B2 = np.array([1.0, 0, 1.0, 0, 0, 0]), np.array([0, 0, 0, 1.0, 0, 1.0])  # one new expert next to A / B


def test_round_robin_binds_on_arrival_and_serves_each_queue_in_order():
    router = ReplicaRouter([1, 1], "round-robin")
    for i in range(5):
        router.add(f"k{i}", None, now=0.0)
    assert router.admit(0.0) == [("k0", 0), ("k1", 1)]
    router.release("k1")
    assert router.admit(1.0) == [("k3", 1)]  # replica 1's own queue, not the older k2 waiting on replica 0
    router.release("k3")
    assert router.admit(2.0) == []  # replica 1 idles while replica 0 has a queue: round-robin breaks the bound
    assert router.idle_while_queued()


def test_least_loaded_shares_one_fcfs_queue_and_fills_the_emptiest_replica_first():
    router = ReplicaRouter([2, 3], "least-loaded")
    for i in range(6):
        router.add(i, None, now=0.0)
    assert router.admit(0.0) == [(0, 1), (1, 0), (2, 1), (3, 0), (4, 1)]
    router.release(3)
    assert router.admit(1.0) == [(5, 0)]
    assert not router.idle_while_queued()


def test_affinity_gives_each_replica_the_request_that_fits_its_own_residents():
    router = ReplicaRouter([2, 2], "affinity")
    for key, vector in (("a", A), ("b", B), ("b2", B2), ("a2", A2)):
        router.add(key, vector, now=0.0)
    # empty replicas take the oldest as seeds; then each takes the one that fits its seed, not the oldest
    assert router.admit(0.0) == [("a", 0), ("b", 1), ("a2", 0), ("b2", 1)]


def test_affinity_matches_brute_force_on_random_pools():
    rng = np.random.default_rng(0)
    for trial in range(100):
        slots = rng.integers(1, 4, size=int(rng.integers(1, 4))).tolist()
        router = ReplicaRouter(slots, "affinity")
        vectors = {k: (rng.random(8) * (rng.random(8) < 0.4)).astype(np.float32) for k in range(12)}
        placed = {r: [] for r in range(len(slots))}
        waiting = list(vectors)
        for k in waiting:
            router.add(k, vectors[k], now=0.0)
        for rnd in range(4):
            for key, rep in router.admit(float(rnd)):
                assert rep == int(np.argmax([s - len(placed[r]) for r, s in enumerate(slots)])), trial
                residents = [vectors[k] for k in placed[rep]]
                if residents:  # the admitting replica's best fit among the waiting ones
                    scores = [expected_new(vectors[k], residents) for k in waiting]
                    assert expected_new(vectors[key], residents) <= min(scores) + 1e-5, trial
                else:  # nothing to fit yet: the oldest
                    assert key == waiting[0], trial
                waiting.remove(key)
                placed[rep].append(key)
            for rep, keys in placed.items():  # one departure per replica that has residents
                if keys:
                    assert router.release(keys.pop(int(rng.integers(0, len(keys))))) == rep


@pytest.mark.parametrize("routing", ["least-loaded", "affinity"])
def test_a_shared_pool_never_leaves_a_replica_idle_while_requests_wait(routing):
    rng = np.random.default_rng(1)
    router = ReplicaRouter([2, 1, 3], routing)
    admitted, key = [], 0
    for step in range(300):
        for _ in range(int(rng.integers(0, 3))):
            router.add(key, rng.random(6).astype(np.float32) if rng.random() < 0.8 else None, float(step))
            key += 1
        admitted += [k for k, _ in router.admit(float(step))]
        assert not router.idle_while_queued(), step
        assert (router.busy <= router.capacity).all()
        for k in [k for k in admitted if rng.random() < 0.3]:
            router.release(k)
            admitted.remove(k)


@pytest.mark.parametrize("max_wait,first", [(5.0, "old"), (None, "fit")])
def test_fairness_bound_goes_first_on_every_replica(max_wait, first):
    router = ReplicaRouter([2, 1], "affinity", max_wait=max_wait)
    for key, vector in (("a", A), ("c", A), ("b", B)):
        router.add(key, vector, now=0.0)
    assert router.admit(0.0) == [("a", 0), ("c", 0), ("b", 1)]
    router.add("old", B, now=1.0)
    router.add("fit", A, now=3.0)
    router.release("c")
    assert router.admit(6.0) == [(first, 0)]  # "old" waited 5 >= max_wait, though "fit" fits replica 0 better


def test_a_replica_taken_out_gets_nothing_and_hands_its_queue_over():
    router = ReplicaRouter([1, 1, 1], "round-robin")
    for i in range(6):
        router.add(i, None, now=0.0)
    assert router.set_healthy(1, False) == [1, 4]
    assert router.free().tolist() == [1, 0, 1]
    assert sorted(k for q in router.queues for k in q) == list(range(6)) and not router.queues[1]
    assert [rep for _, rep in router.admit(0.0)] == [0, 2]
    shared = ReplicaRouter([1, 1], "affinity")
    shared.add("x", A, 0.0)
    shared.set_healthy(0, False)
    assert shared.admit(0.0) == [("x", 1)]


def test_remove_and_errors():
    router = ReplicaRouter([1, 1], "round-robin")
    router.add("x", None, 0.0)
    router.add("y", None, 0.0)
    router.remove("x")
    assert router.waiting() == 1 and router.admit(0.0) == [("y", 1)]
    with pytest.raises(ValueError, match="routed already"):
        router.add("y", None, 0.0)
    for other in ("random", "power-of-two", "prefix"):  # Ray Serve's are benchmarks.ray_routers', not served
        with pytest.raises(ValueError, match="routing must be one of"):
            ReplicaRouter([1], other)
    with pytest.raises(ValueError, match=">= 1 slot"):
        ReplicaRouter([2, 0])
    assert set(ROUTINGS) == {"round-robin", "least-loaded", "affinity"}


@pytest.mark.parametrize("routing", ROUTINGS)
def test_an_update_changes_a_waiting_requests_prediction_and_keeps_its_place(routing):
    """Two replicas, one running A each; B waits first, then A2 and x (no prediction yet). x learns it is A: with
    affinity it goes before B (it adds nothing), in arrival order otherwise; B keeps its place before A2."""
    router = ReplicaRouter([2, 2], routing)
    for key, vector in [("a", A), ("a'", A)]:
        router.add(key, vector, 0.0)
    router.admit(0.0)
    for key, vector in [("b", B), ("a2", A2), ("x", None)]:
        router.add(key, vector, 0.0)
    router.update("x", A)
    got = [key for key, _ in router.admit(0.0)]
    assert got == (["x", "a2"] if routing == "affinity" else ["b", "a2"]), got
    with pytest.raises(KeyError, match="not waiting"):
        router.update("a", B)


def _held(resident) -> tuple[int, np.ndarray]:
    return (0, np.zeros(1)) if resident is None or resident.count == 0 else (resident.count, resident.log_idle)


@pytest.mark.parametrize("late", [False, True])
@pytest.mark.parametrize("routing", ["affinity", "least-loaded"])
def test_place_at_once_places_exactly_as_add_then_admit(routing, late):
    """Random arrivals and departures on two routers: one takes every shortcut it is offered, the other
    always goes through the pool; placements, busy slots and resident sets stay identical. `late`: the
    shortcut places without the vector, and `assign` gives it right after (the proxy's late profile)."""
    rng = np.random.default_rng(1)
    shortcuts = 0
    for trial in range(60):
        slots = rng.integers(1, 4, size=int(rng.integers(1, 4))).tolist()
        fast, slow = ReplicaRouter(slots, routing), ReplicaRouter(slots, routing)
        live = []
        for step in range(30):
            placed = None
            if live and rng.random() < 0.4:  # a departure
                key = live.pop(int(rng.integers(0, len(live))))
                assert fast.release(key) == slow.release(key), trial
            else:  # an arrival: a profile, none, or one of another size (counts as none)
                kind = rng.random()
                vector = (None if kind < 0.2 else rng.random(4).astype(np.float32) if kind < 0.3
                          else (rng.random(8) * (rng.random(8) < 0.4)).astype(np.float32))
                placed = fast.place_at_once(step, None if late else vector)
                if placed is not None and late and vector is not None:
                    fast.assign(step, vector)
                if placed is None:
                    fast.add(step, vector, now=float(step))
                else:
                    shortcuts += 1
                slow.add(step, vector, now=float(step))
            got, want = fast.admit(float(step)), slow.admit(float(step))
            if placed is not None and got == []:
                got = [(step, placed)]
            assert sorted(got) == sorted(want), (trial, step)
            live += [key for key, _ in want]
            assert fast.busy.tolist() == slow.busy.tolist() and fast.waiting() == slow.waiting(), trial
            for r in range(len(slots)):
                a, b = (_held(router.resident(r)) for router in (fast, slow))  # None: nothing held yet
                assert a[0] == b[0] and np.allclose(a[1], b[1]), (trial, r)
    assert shortcuts > 100  # the shortcut was taken, with and without vectors
    assert ReplicaRouter([1, 1], "round-robin").place_at_once("k", None) is None


def test_assign_gives_a_placed_request_its_vector_once():
    router = ReplicaRouter([3], "affinity")
    a, b = np.array([1.0, 1.0, 0.0, 0.0], np.float32), np.array([0.0, 0.0, 1.0, 1.0], np.float32)
    router.place_at_once("x", None), router.place_at_once("y", a), router.place_at_once("w", None)
    assert router.assign("x", b) and router.resident(0).count == 2
    assert not router.assign("x", a) and not router.assign("y", b)  # each holds its vector already
    assert not router.assign("w", np.ones(3)) and router.resident(0).count == 2  # another size counts as none
    router.release("x")
    assert router.resident(0).count == 1 and not router.assign("x", b)  # released: nothing to join
    least = ReplicaRouter([1], "least-loaded")
    least.place_at_once("z", None)
    assert not least.assign("z", a) and least.resident(0) is None  # only affinity keeps resident sets


def test_place_at_once_waits_behind_a_queue_and_when_full():
    router = ReplicaRouter([1], "affinity")
    assert router.place_at_once("first", None) == 0
    assert router.place_at_once("second", None) is None  # no free slot
    router.add("second", None, now=0.0)
    router.release("first")
    assert router.place_at_once("third", None) is None  # "second" waits: it goes first
    assert router.admit(0.0) == [("second", 0)]


@pytest.mark.parametrize("routing", ROUTINGS)
def test_admit_to_one_replica_admits_what_admit_would_give_it(routing):
    """A caller told of one free slot at a time (a Ray Serve router) gets the same choices as `admit`."""
    rng = np.random.default_rng(2)
    whole, single = ReplicaRouter([2, 2], routing), ReplicaRouter([2, 2], routing)
    for key in range(10):
        vector = rng.random(6).astype(np.float32)
        whole.add(key, vector, 0.0)
        single.add(key, vector, 0.0)
    for now in range(4):
        admitted = whole.admit(float(now))
        assert [(single.admit_to(r, float(now)), r) for _, r in admitted] == admitted
        for key, r in admitted[:2]:
            assert whole.release(key) == single.release(key) == r


def test_admit_to_gives_nothing_to_a_full_or_down_replica_or_from_an_empty_pool():
    router = ReplicaRouter([1, 1], "affinity")
    assert router.admit_to(0, 0.0) is None  # nobody waits
    for key in "abc":
        router.add(key, A, 0.0)
    assert router.admit_to(0, 0.0) == "a" and router.admit_to(0, 0.0) is None  # full
    router.set_healthy(1, False)
    assert router.admit_to(1, 0.0) is None  # down
    assert router.waiting() == 2


def test_an_added_replica_takes_requests_and_residents_of_its_own():
    router = ReplicaRouter([1], "affinity")
    for key, vector in (("a", A), ("b", B), ("a2", A2)):
        router.add(key, vector, now=0.0)
    assert router.admit(0.0) == [("a", 0)]
    assert router.add_replica(2) == 1 and router.free().tolist() == [0, 2]
    assert router.admit(0.0) == [("b", 1), ("a2", 1)]  # the new replica: the most free slots
    router.set_healthy(0, False)  # a replica that died stays out; the new one is what serves
    assert router.load().tolist() == [1, 2] and router.resident(1) is not None
    with pytest.raises(ValueError, match=">= 1 slot"):
        router.add_replica(0)
