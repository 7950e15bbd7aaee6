"""Distinct experts per token group and layer, against brute force."""

import numpy as np
import pytest

from moe_cohort.engine.distinct import distinct_experts


@pytest.mark.parametrize("g", [1, 4])
@pytest.mark.parametrize("n", [13, 300])  # Python sets below SMALL_LAYER ids per layer, numpy above
def test_distinct_experts_matches_brute_force(g, n):
    rng = np.random.default_rng(g)
    for _ in range(10):
        layers, k, e = 3, 3, 10
        ids = rng.integers(0, e, (layers, n, k))
        group = rng.integers(0, g, n)
        got = distinct_experts(list(ids), group, g, e)
        assert got == distinct_experts(ids, group, g, e)  # a list of layers or one array
        expected = [[len({x for t in range(n) if group[t] == gi for x in ids[layer, t]}) for gi in range(g)]
                    + [len(set(ids[layer].ravel()))] for layer in range(layers)]
        assert got == expected
