import numpy as np
import pytest

from moe_cohort.encoder.growth import density_order
from moe_cohort.encoder.ordering import chain_order, consecutive_similarity
from moe_cohort.encoder.partition import balanced_cells
from tests.encoder.conftest import planted, unit


@pytest.mark.parametrize("n, batch_size, max_cell", [(1000, 16, 128), (999, 16, 128), (100, 8, 8), (37, 4, 1000), (513, 1, 64)])
def test_cells_are_whole_batches(n, batch_size, max_cell):
    x = unit(np.random.default_rng(n).normal(size=(n, 8)))
    cells = balanced_cells(x, batch_size, max_cell, seed=0)
    assert sorted(np.concatenate(cells).tolist()) == list(range(n))
    assert all(len(c) <= max(max_cell - max_cell % batch_size, batch_size) for c in cells)
    assert all(len(c) % batch_size == 0 for c in cells[:-1])  # only the last cell holds N mod B
    assert all(len(c) > 0 for c in cells)


def test_cells_split_along_planted_clusters():
    x, labels = planted([64, 64, 64, 64], noise=0.05, seed=3)
    cells = balanced_cells(x, 16, 64, seed=0)
    assert sorted(len(set(labels[c])) for c in cells) == [1, 1, 1, 1]


def test_cells_need_room_for_a_batch():
    with pytest.raises(ValueError, match="max_cell"):
        balanced_cells(np.ones((10, 2), np.float32), 8, 4)


def test_density_order_matches_reference():
    x = unit(np.random.default_rng(1).normal(size=(30, 5)))
    sim = x @ x.T
    want = [np.sort(np.delete(sim[i], i))[-3:].sum() for i in range(30)]  # 3 = B - 1 nearest others
    assert density_order(sim, 4).tolist() == np.argsort(-np.array(want), kind="stable").tolist()


def test_chain_order_is_a_nearest_neighbour_walk():
    t = np.linspace(0, np.pi / 2, 9)
    c = unit(np.stack([np.cos(t), np.sin(t)], axis=1))[np.random.default_rng(0).permutation(9)]
    order = chain_order(c)
    assert sorted(order.tolist()) == list(range(9))
    walked = np.arctan2(c[order, 1], c[order, 0])
    assert np.all(np.diff(walked) > 0) or np.all(np.diff(walked) < 0)  # from one end to the other


def test_consecutive_similarity_prefers_the_chain():
    rng = np.random.default_rng(2)
    x = unit(rng.normal(size=(160, 6)))
    batches = [np.arange(i, i + 8) for i in range(0, 160, 8)]
    from moe_cohort.encoder.ordering import centroids

    chained = [batches[i] for i in chain_order(centroids(x, batches))]
    assert consecutive_similarity(x, chained) > consecutive_similarity(x, batches)


def test_arrange_members_puts_the_seams_together():
    """Members most like the previous batch come first, those most like the next batch last."""
    from moe_cohort.encoder.ordering import arrange_members

    t = np.linspace(0, np.pi / 2, 12)  # three batches of four along an arc
    x = unit(np.stack([np.cos(t), np.sin(t)], axis=1))
    plan = [np.array([3, 1, 2, 0]), np.array([6, 4, 7, 5]), np.array([11, 9, 8, 10])]
    assert [b.tolist() for b in arrange_members(x, plan)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
