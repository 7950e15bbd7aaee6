"""The naive embedding planner the benchmarks measure the planner against: k-means, sort by cluster, cut.

Cluster the embeddings with FAISS spherical k-means into about N / B clusters, order the requests
by cluster label (arrival order inside a cluster) and cut the order into batches of B. Batches
straddle cluster borders and clusters of unequal size, which is what the planner's balanced
growth and swaps repair.
"""

from __future__ import annotations

import faiss
import numpy as np

from moe_cohort.encoder.partition import single_thread


def kmeans_sort_chunk(x: np.ndarray, batch_size: int, *, num_clusters: int | None = None, seed: int = 0) -> list[np.ndarray]:
    """Batches (int64 index arrays) of FAISS k-means labels sorted and cut; k defaults to ceil(N / B)."""
    x = np.ascontiguousarray(x, dtype=np.float32)  # [N, D]
    k = min(num_clusters or -(-len(x) // batch_size), len(x))
    km = faiss.Kmeans(x.shape[1], k, niter=25, seed=seed, spherical=True, min_points_per_centroid=1)
    with single_thread():
        km.train(x)
        _, labels = km.index.search(x, 1)  # [N, 1]
    order = np.argsort(labels[:, 0], kind="stable")  # [N]
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
