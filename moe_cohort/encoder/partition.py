"""Balanced recursive bisection: cut embeddings into cells of whole batches.

The planner works on dense similarity matrices, which only fit for a few thousand points. Above
that, the points are split in two by FAISS 2-means, and the split is *balanced*: points are sorted
by how much closer they are to one centroid than to the other, and the cut falls at a multiple of
the batch size B. Recursing until every cell holds at most `max_cell` points gives cells that are
whole batches (only the last cell may hold a remainder) and that lie in a coherent leaf order, so
cell i and cell i + 1 are neighbours in embedding space.

With `max_cell = B` the same recursion is a complete planner on its own (size-constrained
divisive clustering), which the benchmarks use as the "balanced bisection" baseline.
"""

from __future__ import annotations

from contextlib import contextmanager

import faiss
import numpy as np

KMEANS_ITERS = 10
BALANCE_ITERS = 10


def balanced_cells(x: np.ndarray, batch_size: int, max_cell: int, *, seed: int = 0) -> list[np.ndarray]:
    """Split rows of x [N, D] into cells (int64 index arrays) of at most `max_cell` rows.

    Every cell's size is a multiple of `batch_size` except possibly the last one, which holds the
    N mod B remainder. Deterministic under `seed`. `max_cell` is rounded down to a multiple of B.
    """
    if max_cell < batch_size:
        raise ValueError(f"max_cell ({max_cell}) must be >= batch_size ({batch_size})")
    max_cell -= max_cell % batch_size
    cells: list[np.ndarray] = []
    stack = [np.arange(len(x), dtype=np.int64)]  # depth-first, left before right: leaf order
    split = 0
    while stack:
        idx = stack.pop()
        if len(idx) <= max_cell or len(idx) <= batch_size:
            if len(idx):
                cells.append(idx)
            continue
        split += 1
        left, right = balanced_split(x, idx, batch_size, seed=(seed * 100_003 + split) % (2**31 - 1))
        stack.extend([right, left])
    return cells


def balanced_split(x: np.ndarray, idx: np.ndarray, batch_size: int, *, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Split x[idx] in two by balanced 2-means; the left part gets a multiple of B rows, close to half.

    FAISS 2-means gives the first two centroids; then Lloyd steps with a balanced assignment (sort by
    the difference of the similarities to the two centroids, cut at the fixed size) move the cut to
    where the data allow a balanced split: plain 2-means on four equal clusters often ends 1 vs 3,
    and a cut at half then runs through a cluster.
    """
    sub = np.ascontiguousarray(x[idx], dtype=np.float32)  # [n, D]
    half = max(batch_size, int(round(len(idx) / 2 / batch_size)) * batch_size)  # < len(idx) as len(idx) > B
    c = _two_means(sub, seed)  # [2, D]
    left = np.zeros(len(idx), dtype=bool)  # [n]
    for _ in range(BALANCE_ITERS):
        order = np.argsort(-(sub @ (c[0] - c[1])), kind="stable")  # [n] closest to centroid 0 first
        new_left = np.zeros(len(idx), dtype=bool)
        new_left[order[:half]] = True
        if (new_left == left).all():
            break
        left = new_left
        c = np.stack([sub[left].mean(axis=0), sub[~left].mean(axis=0)])  # [2, D]
    return idx[order[:half]], idx[order[half:]]


def _two_means(sub: np.ndarray, seed: int) -> np.ndarray:
    """Centroids [2, D] of FAISS spherical 2-means over sub [n, D]."""
    km = faiss.Kmeans(sub.shape[1], 2, niter=KMEANS_ITERS, seed=seed, spherical=True,
                      min_points_per_centroid=1, max_points_per_centroid=512)  # trains on <= 1,024 points
    with single_thread():
        km.train(sub)
    return km.centroids


@contextmanager
def single_thread():
    """Run FAISS on one OpenMP thread: for k = 2 the threads cost more than they save (docs/results.md)."""
    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    try:
        yield
    finally:
        faiss.omp_set_num_threads(before)
