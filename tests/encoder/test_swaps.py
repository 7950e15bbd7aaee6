import itertools

import numpy as np
import pytest

from moe_cohort.encoder.growth import greedy_growth
from moe_cohort.encoder.swaps import SwapSearch, within_similarity
from tests.encoder.conftest import unit


def _objective_brute(sim, batches):
    return sum(sim[i, j] for b in batches for i, j in itertools.combinations(b.tolist(), 2))


def _random_batches(n, batch_size, seed):
    perm = np.random.default_rng(seed).permutation(n)
    return [perm[i : i + batch_size] for i in range(0, n, batch_size)]


@pytest.mark.parametrize("n, batch_size, seed", [(12, 3, 0), (13, 4, 1), (21, 5, 2), (30, 8, 3), (7, 2, 4)])
def test_ends_at_a_two_swap_local_optimum(n, batch_size, seed):
    x = unit(np.random.default_rng(seed).normal(size=(n, 5)))
    sim = x @ x.T
    start = _random_batches(n, batch_size, seed)
    search = SwapSearch(sim, start, batch_size, min_gain=1e-9)
    batches = search.run(max_rounds=1000)
    assert sorted(map(len, batches)) == sorted(map(len, start))  # sizes kept, the short batch too
    assert sorted(np.concatenate(batches).tolist()) == list(range(n))
    before, after = _objective_brute(sim, start), _objective_brute(sim, batches)
    assert after == pytest.approx(before + search.gained, abs=1e-4)  # the gains it books are real
    assert within_similarity(sim, batches) == pytest.approx(after, abs=1e-4)
    for a, b in itertools.combinations(range(len(batches)), 2):  # brute force: no swap helps any more
        for i, j in itertools.product(batches[a], batches[b]):
            swapped = [bb.copy() for bb in batches]
            swapped[a][swapped[a] == i], swapped[b][swapped[b] == j] = j, i
            assert _objective_brute(sim, swapped) <= after + 1e-4


def test_respects_max_rounds_and_never_loses():
    x = unit(np.random.default_rng(9).normal(size=(64, 6)))
    sim = x @ x.T
    start = _random_batches(64, 8, 9)
    one = SwapSearch(sim, start, 8)
    batches = one.run(max_rounds=1)
    assert one.rounds == 1
    assert within_similarity(sim, batches) >= within_similarity(sim, start)


def test_greedy_growth_matches_reference():
    """Vectorised growth against a direct transcription of the rule."""
    x = unit(np.random.default_rng(4).normal(size=(23, 4)))
    sim = x @ x.T
    order = np.random.default_rng(5).permutation(23)
    got = greedy_growth(sim, 5, order)
    free, want = set(range(23)), []
    for s in order:
        if s in free:
            batch = [int(s)]
            free.discard(s)
            while len(batch) < 5 and free:
                j = max(sorted(free), key=lambda c: sum(sim[c, m] for m in batch))
                batch.append(j)
                free.discard(j)
            want.append(batch)
    assert [b.tolist() for b in got] == want
