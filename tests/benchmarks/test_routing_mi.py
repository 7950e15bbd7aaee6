"""category_mi against a brute-force mutual information over (category, expert) pairs."""

import numpy as np
import pytest

from benchmarks.routing_mi import category_mi


def _brute_mi(choices, cats, num_experts, layer):
    labels = sorted(set(cats))
    joint = np.zeros((len(labels), num_experts))
    for ids, c in zip(choices, cats):
        row = np.zeros(num_experts)
        for e in ids[:, layer].ravel():
            row[e] += 1
        joint[labels.index(c)] += row
    joint = joint / joint.sum(1, keepdims=True) / len(labels)  # uniform prior over categories
    pc, pe = joint.sum(1, keepdims=True), joint.sum(0, keepdims=True)
    nz = joint > 0
    return float((joint[nz] * np.log2(joint[nz] / (pc @ pe)[nz])).sum())


def test_matches_brute_force_on_random_choices():
    rng = np.random.default_rng(0)
    choices = [rng.integers(0, 6, size=(int(rng.integers(1, 9)), 3, 2)) for _ in range(12)]
    cats = [["a", "b", "c"][i % 3] for i in range(12)]
    mi = category_mi(choices, cats, num_experts=6)
    assert mi.shape == (3,)
    assert mi == pytest.approx([_brute_mi(choices, cats, 6, layer) for layer in range(3)])


def test_bounds():
    same = [np.array([[[0, 1]], [[2, 3]]]), np.array([[[0, 1]], [[2, 3]]])]
    assert category_mi(same, ["a", "b"], 4) == pytest.approx([0.0])
    disjoint = [np.array([[[0, 1]]]), np.array([[[2, 3]]]), np.array([[[4, 5]]]), np.array([[[6, 7]]])]
    assert category_mi(disjoint, ["a", "b", "c", "d"], 8) == pytest.approx([2.0])  # log2(4 categories)
