"""Greedy growth of batches by nearest unassigned neighbours.

The text-only analogue of the oracle-greedy batching of Doubleword ("MoE expert co-activations"):
open a batch with a seed request, then repeatedly add the unassigned request whose summed cosine
similarity to the batch's members is largest (average linkage, i.e. the request nearest to the
batch's centroid), until the batch holds B requests. The oracle adds the request that adds the
fewest new expert loads; here similarity stands in for expert overlap.

Seeds are taken densest first (largest summed similarity to their B - 1 nearest neighbours): the
tightest batches form while their neighbourhoods are intact, and the loose leftovers that greedy
growth always ends with are few and scattered, which the swap search then repairs.
"""

from __future__ import annotations

import numpy as np


def greedy_growth(sim: np.ndarray, batch_size: int, seed_order: np.ndarray) -> list[np.ndarray]:
    """Batches (int64 arrays of row indices into sim) grown greedily over sim [n, n].

    Each batch is opened by the first still-unassigned index of `seed_order` (a permutation of
    0..n-1) and filled to `batch_size` (the last batch may be short). Ties go to the lowest index.
    """
    n = len(sim)
    free = np.ones(n, dtype=bool)  # [n]
    batches: list[np.ndarray] = []
    for seed in seed_order:
        if free[seed]:
            batches.append(_grow_one(sim, int(seed), batch_size, free))
    return batches


def density_order(sim: np.ndarray, batch_size: int) -> np.ndarray:
    """Indices [n] by decreasing kNN density: summed similarity to the B - 1 nearest others."""
    k = min(batch_size, len(sim))  # self + (B - 1) neighbours
    top = np.partition(sim, len(sim) - k, axis=1)[:, len(sim) - k :]  # [n, k] largest per row
    density = top.sum(axis=1, dtype=np.float64) - np.diag(sim)  # [n] drop the self-similarity
    return np.argsort(-density, kind="stable")


def _grow_one(sim: np.ndarray, seed: int, batch_size: int, free: np.ndarray) -> np.ndarray:
    """Grow one batch from `seed`; marks members as taken in `free` (in place)."""
    free[seed] = False
    members = [seed]
    score = np.where(free, sim[seed], -np.inf).astype(np.float64)  # [n] summed similarity to the batch
    for _ in range(min(batch_size - 1, int(free.sum()))):
        j = int(np.argmax(score))
        free[j] = False
        members.append(j)
        score += sim[j]
        score[j] = -np.inf
    return np.array(members, dtype=np.int64)
