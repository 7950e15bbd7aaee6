"""benchmarks.ray_routers.RayRouter: Ray Serve's routings against brute force and by hand, and `inside`, each
replica admitting from its own queue by fit."""

import numpy as np
import pytest

from benchmarks.ray_routers import RAY_ROUTINGS, RayRouter, prefix_blocks
from tests.helpers.brute_force import expected_new


def _two_choices(rng, up, load):
    """Brute force: draw two of `up` as the router documents, the one with fewer requests, ties to the lower."""
    if len(up) == 1:
        return up[0]
    pair = sorted(int(r) for r in rng.choice(np.array(up), 2, replace=False))
    return min(pair, key=lambda r: (load[r], r))


def _common_blocks(a, b):
    """Leading blocks of 16 characters (of the first 64) that two texts share."""
    blocks = lambda t: [t[:64][i:i + 16] for i in range(0, len(t[:64]), 16)]  # noqa: E731
    n = 0
    for x, y in zip(blocks(a), blocks(b)):
        if x != y:
            break
        n += 1
    return n


def _by_prefix(history, text, load, threshold, rng, up):
    """Brute force of "prefix": the most recent request sharing the most leading blocks, unless the load is
    imbalanced or nothing is shared, then power of two."""
    shared = [_common_blocks(text, old) for old, _ in history]
    if shared and max(shared) > 0 and max(load) - min(load) <= threshold:
        best = max(shared)
        return [rep for (_, rep), n in zip(history, shared) if n == best][-1]
    return _two_choices(rng, up, load)


def _drive(router, rng, arrive):
    """Random arrivals (arrive(key) -> the replica the brute force expects), admissions and departures;
    asserts each arrival joins that replica's queue. Returns how often the binding was checked."""
    admitted, checked = [], 0
    for key in range(60):
        want = arrive(key)
        assert key in router.queues[want], (key, want, [list(q) for q in router.queues])
        checked += 1
        if rng.random() < 0.5:
            admitted += [k for k, _ in router.admit(float(key))]
        for k in [k for k in admitted if rng.random() < 0.3]:
            router.release(k)
            admitted.remove(k)
    return checked


@pytest.mark.parametrize("seed", range(6))
def test_power_of_two_sends_each_request_to_the_less_loaded_of_the_two_it_drew(seed):
    rng = np.random.default_rng(100 + seed)
    slots = rng.integers(1, 4, size=int(rng.integers(1, 5))).tolist()
    router = RayRouter(slots, "power-of-two", rng=np.random.default_rng(seed))
    mirror = np.random.default_rng(seed)
    up = list(range(len(slots)))

    def arrive(key):
        want = _two_choices(mirror, up, router.load())  # the load before this request joins
        router.add(key, None, now=float(key))
        return want

    assert _drive(router, rng, arrive) == 60


def test_power_of_two_by_hand_and_with_one_healthy_replica():
    low, high = sorted(np.random.default_rng(3).choice(np.arange(3), 2, replace=False).tolist())
    for busy_low, want in ((0, low), (1, high)):  # a tie goes to the lower index; a busier lower one loses
        router = RayRouter([2, 2, 2], "power-of-two", rng=np.random.default_rng(3))
        for k in range(busy_low):
            router.hold(("bg", k), low)
        router.add("a", None, 0.0)
        assert "a" in router.queues[want]
    lone = RayRouter([2, 2], "power-of-two")
    lone.set_healthy(0, False)
    for k in range(3):
        lone.add(k, None, 0.0)
    assert list(lone.queues[1]) == [0, 1, 2]


@pytest.mark.parametrize("seed", range(6))
def test_prefix_matches_brute_force_on_random_texts(seed):
    """Texts built from a few shared openings, so matches of 1 to 4 blocks happen; a low threshold so
    the fallback happens too."""
    rng = np.random.default_rng(200 + seed)
    slots = rng.integers(1, 4, size=int(rng.integers(2, 5))).tolist()
    threshold = int(rng.integers(0, 3))
    router = RayRouter(slots, "prefix", rng=np.random.default_rng(seed), imbalance=threshold)
    mirror, history = np.random.default_rng(seed), []
    up = list(range(len(slots)))
    opens = ["".join(rng.choice(list("abc"), 16)) for _ in range(3)]
    counts = {"matched": 0, "fell back": 0}

    def arrive(key):
        text = "".join(opens[int(rng.integers(0, 3))] if rng.random() < 0.7 else "".join(rng.choice(list("xy"), 16))
                       for _ in range(int(rng.integers(1, 6))))[: int(rng.integers(8, 90))]
        load = router.load()
        want = _by_prefix(history, text, load, threshold, mirror, up)
        matched = any(_common_blocks(text, old) for old, _ in history) and max(load) - min(load) <= threshold
        counts["matched" if matched else "fell back"] += 1
        router.add(key, None, now=float(key), prefix=text)
        history.append((text, want))
        return want

    _drive(router, rng, arrive)
    assert min(counts.values()) > 3, counts


def test_prefix_sends_a_repeated_prefix_to_the_same_replica_until_the_load_is_imbalanced():
    router = RayRouter([4, 4, 4], "prefix", rng=np.random.default_rng(0), imbalance=2)
    system = "You are a helpful assistant. Answer briefly and cite sources. "  # 62 characters: 4 blocks
    assert len(system) == 62
    router.add("first", None, 0.0, prefix=system + "What is 2 + 2?")
    home = next(r for r, q in enumerate(router.queues) if "first" in q)
    for k in range(2):  # imbalance 1 then 2 before each: not above the threshold
        router.add(k, None, 0.0, prefix=system + f"question {k}")
        assert k in router.queues[home]
    router.add("third", None, 0.0, prefix=system + "one more")  # imbalance 3 > 2: power of two, never home
    assert "third" not in router.queues[home]
    router.add("other", None, 0.0, prefix="Translate into French: " + system)  # no block matches
    assert router.admit(0.0) and router.waiting() == 0
    third = int(router.placed["third"][0])
    for k in ("first", 0, 1, "third", "other"):
        router.release(k)
    router.add("again", None, 1.0, prefix=system[:40] + "different after two blocks and a half")
    assert "again" in router.queues[third]  # two blocks shared: the replica last given them


def test_the_routings_of_ray_serve_bind_on_arrival_like_round_robin():
    for routing in RAY_ROUTINGS:
        router = RayRouter([1, 1], routing)
        assert router.place_at_once("k", None) is None  # they queue on arrival, never through the shared pool
        for i in range(4):
            router.add(i, None, 0.0, prefix="same text")
        assert router.waiting() == 4 and not len(router.pool)
        assert len(router.admit(0.0)) == 2
        gone = next(r for r in range(2) if router.queues[r])
        moved = router.set_healthy(gone, False)
        assert moved and all(k in router.queues[1 - gone] for k in moved)
    assert prefix_blocks("a" * 70) == ("a" * 16,) * 4 and prefix_blocks("abc") == ("abc",)
    assert prefix_blocks(("s", 1)) == ("s", 1) and prefix_blocks(None) == ()


@pytest.mark.parametrize("routing", ["round-robin", "power-of-two", "prefix"])
def test_inside_each_replica_admits_from_its_own_queue_by_fit(routing):
    """`inside` (our scheduler in each replica, behind a router that binds on arrival): the same queues as without,
    and each free slot takes, from its own replica's queue, the request that adds the fewest experts there."""
    rng = np.random.default_rng(5)
    plain = RayRouter([2, 2], routing, rng=np.random.default_rng(1), imbalance=100)
    inside = RayRouter([2, 2], routing, rng=np.random.default_rng(1), imbalance=100, inside=True)
    vectors = {k: (rng.random(8) * (rng.random(8) < 0.4)).astype(np.float32) for k in range(16)}
    for k, v in vectors.items():
        plain.add(k, v, 0.0, prefix=f"topic {k % 3}")
        inside.add(k, v, 0.0, prefix=f"topic {k % 3}")
    assert [list(q) for q in inside.queues] == [list(q) for q in plain.queues]
    placed = {0: [], 1: []}
    for now in range(8):
        for r in (0, 1):
            waiting = list(inside.queues[r])
            key = inside.admit_to(r, float(now))
            if key is None:
                continue
            assert key in waiting
            residents = [vectors[k] for k in placed[r]]
            if residents:
                best = min(expected_new(vectors[k], residents) for k in waiting)
                assert expected_new(vectors[key], residents) <= best + 1e-5
            else:
                assert key == waiting[0]  # nothing to fit yet: the oldest
            placed[r].append(key)
        for r in (0, 1):
            if placed[r] and now % 2:
                inside.release(placed[r].pop(0))
    with pytest.raises(ValueError, match="binds on arrival"):
        RayRouter([2], "affinity", inside=True)


def test_inside_queues_follow_a_replica_taken_out_and_keep_updates():
    a, b = np.array([1.0, 1.0, 0, 0, 0, 0]), np.array([0, 0, 0, 0, 1.0, 1.0])  # two experts each, disjoint
    router = RayRouter([2, 1], "round-robin", inside=True)
    for k, v in enumerate([a, b, b, b, b]):
        router.add(k, v, 0.0)
    assert router.set_healthy(1, False) == [1, 3]
    assert list(router.queues[0]) == [0, 2, 4, 1, 3] and not router.queues[1]
    router.update(3, a)  # 3 now fits the first resident, 0: it goes next, before the older ones
    assert router.admit(0.0) == [(0, 0), (3, 0)]
    router.remove(4)
    router.release(0)
    assert router.admit(1.0) == [(2, 0)] and router.waiting() == 1  # equal fit: the older of 2 and 1
