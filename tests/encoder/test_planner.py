import itertools

import numpy as np
import pytest

from moe_cohort.encoder.planner import PlannerConfig, plan_batches
from moe_cohort.encoder.swaps import within_similarity
from moe_cohort.encoder.plans import validate_plan
from tests.encoder.conftest import planted, unit

CONFIGS = {
    "default": PlannerConfig(),
    "cells": PlannerConfig(cell_size=64),  # several cells: exercises the FAISS bisection
    "bisect": PlannerConfig(init="bisect"),
    "random-seeds": PlannerConfig(seeds="random"),
    "no-swaps-no-order": PlannerConfig(swaps=False, order=False),
}


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("n, batch_size", [(0, 4), (1, 4), (3, 4), (4, 4), (37, 4), (200, 16), (301, 8), (50, 1), (20, 64)])
def test_plan_invariants(config, n, batch_size):
    x = unit(np.random.default_rng(n).normal(size=(n, 12))) if n else np.zeros((0, 12), np.float32)
    plan = plan_batches(x, batch_size, seed=3, config=config)
    validate_plan(plan, n, batch_size)  # every request exactly once, no batch over B, none empty
    sizes = [len(b) for b in plan]
    assert sum(s < batch_size for s in sizes) <= 1, "at most one partial batch per flush"
    assert all(s == batch_size for s in sizes[:-1]), "the partial batch goes last"
    assert len(plan) == -(-n // batch_size)
    assert all(b.dtype == np.int64 for b in plan)


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_deterministic_under_seed(config):
    x = unit(np.random.default_rng(0).normal(size=(300, 16)))
    first = plan_batches(x, 8, seed=5, config=config)
    again = plan_batches(x.copy(), 8, seed=5, config=config)
    assert [b.tolist() for b in first] == [b.tolist() for b in again]


def test_seed_changes_cells():
    x = unit(np.random.default_rng(0).normal(size=(300, 16)))
    config = PlannerConfig(cell_size=64)
    plans = {tuple(map(tuple, plan_batches(x, 8, seed=s, config=config))) for s in range(3)}
    assert len(plans) > 1


@pytest.mark.parametrize("sizes, batch_size", [([8] * 12, 8), ([16] * 5, 16), ([4] * 25, 4)])
def test_recovers_planted_clusters_of_exactly_b(sizes, batch_size):
    x, labels = planted(sizes, noise=0.1, seed=len(sizes))
    plan = plan_batches(x, batch_size)
    clusters = [np.flatnonzero(labels == c).tolist() for c in range(len(sizes))]
    assert sorted(sorted(b.tolist()) for b in plan) == sorted(clusters)


def test_planted_clusters_of_whole_batches_stay_pure():
    """Clusters of 2B and 3B requests: every batch lies inside one cluster."""
    x, labels = planted([16, 24, 8, 16, 32], noise=0.1, seed=1)
    plan = plan_batches(x, 8)
    assert all(len(set(labels[b])) == 1 for b in plan)


def test_matches_brute_force_optimum_on_tiny_inputs():
    """Planted tiny inputs: the plan's within-batch similarity equals the best over all partitions."""
    for seed in range(5):
        x, _ = planted([4, 4, 4], dim=6, noise=0.4, seed=seed)
        sim = x @ x.T
        assert within_similarity(sim, plan_batches(x, 4)) == pytest.approx(_best_partition(sim, 4), abs=1e-5)


def _best_partition(sim, batch_size):
    """Brute force: the largest within-batch similarity over all partitions into batches of B."""
    def best(rest):
        if not rest:
            return 0.0
        first, others = rest[0], rest[1:]
        top = -np.inf
        for mates in itertools.combinations(others, batch_size - 1):
            b = (first,) + mates
            inside = sim[np.ix_(b, b)]
            top = max(top, (inside.sum() - np.trace(inside)) / 2 + best(tuple(i for i in others if i not in mates)))
        return top
    return best(tuple(range(len(sim))))


def test_orders_consecutive_batches_by_similarity():
    """Clusters strung along a great circle: the batch order walks along it instead of jumping."""
    t = np.repeat(np.linspace(0, np.pi, 12), 8)  # 12 groups of 8 along half a circle
    rng = np.random.default_rng(0)
    x = unit(np.stack([np.cos(t), np.sin(t)], axis=1) + 0.01 * rng.normal(size=(len(t), 2)))
    perm = rng.permutation(len(x))
    plan = plan_batches(x[perm], 8)
    angle = [float(np.mean(t[perm][b])) for b in plan]
    steps = np.abs(np.diff(angle))
    assert steps.max() < 2 * np.pi / 11  # every step moves to an adjacent group


def test_rejects_bad_input():
    with pytest.raises(ValueError, match="batch_size"):
        plan_batches(np.ones((3, 2), np.float32), 0)
    with pytest.raises(ValueError, match="2-D"):
        plan_batches(np.ones(3, np.float32), 2)
    with pytest.raises(ValueError, match="NaN"):
        plan_batches(np.array([[np.nan, 1.0]]), 2)
    with pytest.raises(ValueError, match="init"):
        plan_batches(np.ones((5, 2), np.float32), 2, config=PlannerConfig(init="nope"))
