"""The one held-out split: a disjoint seeded cover of the requests, duplicates on one side."""

import numpy as np
import pytest

from moe_cohort.traces.split import heldout_split, split_requests
from moe_cohort.traces.synthetic import synthetic_traces


@pytest.mark.parametrize("n,holdout", [(2, 0.2), (10, 0.2), (101, 0.3), (50, 0.0)])
def test_split_is_a_disjoint_cover_of_the_requests(n, holdout):
    train, held = split_requests(n, holdout, seed=3)
    assert len(np.intersect1d(train, held)) == 0
    np.testing.assert_array_equal(np.sort(np.concatenate([train, held])), np.arange(n))
    assert len(held) == (0 if holdout == 0 else max(1, round(holdout * n)))
    assert len(train) >= 1


def test_split_is_deterministic_under_the_seed():
    a, b, c = (split_requests(200, 0.2, seed=s) for s in (7, 7, 8))
    np.testing.assert_array_equal(a[1], b[1])
    assert not np.array_equal(a[1], c[1])


def test_requests_with_the_same_text_land_on_the_same_side():
    texts = np.array([f"t{i % 13}" for i in range(100)])  # 13 texts, each repeated
    for seed in range(5):
        train, held = split_requests(100, 0.25, seed, groups=texts)
        assert not set(texts[train]) & set(texts[held])
        assert 15 <= len(held) <= 35


def test_split_rejects_a_bad_holdout():
    with pytest.raises(ValueError, match="holdout"):
        split_requests(10, 1.0)


def test_heldout_split_is_the_text_grouped_split_of_the_traces():
    ts = synthetic_traces(80, seed=2)
    train, held = heldout_split(ts)
    ref_train, ref_held = split_requests(len(ts), 0.2, 0, groups=ts.texts)
    np.testing.assert_array_equal(held, ref_held)
    np.testing.assert_array_equal(train, ref_train)
    assert not set(ts.texts[train]) & set(ts.texts[held])
