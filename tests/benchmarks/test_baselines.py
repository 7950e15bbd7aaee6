"""The naive planner (benchmarks.baselines): a partition into batches of B by sorted k-means labels, and
the planner beating it where clusters are not multiples of B."""

import numpy as np

from benchmarks.baselines import kmeans_sort_chunk
from moe_cohort.encoder.planner import plan_batches
from moe_cohort.encoder.swaps import within_similarity
from tests.encoder.conftest import planted


def test_sort_and_cut_is_a_partition_into_batches_of_b_in_cluster_order():
    x, labels = planted([8, 16, 8, 5], noise=0.05, seed=4)
    plan = kmeans_sort_chunk(x, 8, num_clusters=4, seed=0)
    assert [len(b) for b in plan] == [8, 8, 8, 8, 5]
    order = np.concatenate(plan)
    np.testing.assert_array_equal(np.sort(order), np.arange(len(x)))
    runs = labels[order][np.r_[True, labels[order][1:] != labels[order][:-1]]]
    assert sorted(runs.tolist()) == [0, 1, 2, 3]  # each planted cluster is one stretch of the order


def test_the_planner_beats_kmeans_chunking_on_uneven_clusters():
    """Cluster sizes that are not multiples of B: sort-and-cut mixes clusters, the planner much less."""
    x, labels = planted([11, 5, 19, 13, 7, 9, 17, 15], noise=0.3, seed=2)
    purity = lambda plan: np.mean([np.bincount(labels[b]).max() / len(b) for b in plan])  # noqa: E731
    ours, naive = plan_batches(x, 8), kmeans_sort_chunk(x, 8, seed=0)
    assert purity(ours) > purity(naive) + 0.05
    sim = x @ x.T
    assert within_similarity(sim, ours) > within_similarity(sim, naive)
