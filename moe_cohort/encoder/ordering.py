"""Order batches so that consecutive batches are similar.

Continuous-batching engines (vLLM) slide new requests into the running batch as old ones finish,
so batch i + 1 shares forward passes with the tail of batch i. A nearest-neighbour chain over the
batch centroids keeps those neighbours alike: start at the batch farthest from the mean (an end
of the cloud), then always move to the most similar batch not yet placed.
"""

from __future__ import annotations

import numpy as np


def centroids(x: np.ndarray, batches: list[np.ndarray]) -> np.ndarray:
    """Unit-length mean vectors [nb, D] of the batches' rows of x [N, D]."""
    c = np.stack([x[b].mean(axis=0) for b in batches]).astype(np.float32)  # [nb, D]
    return c / np.maximum(np.linalg.norm(c, axis=1, keepdims=True), 1e-12)


def chain_order(c: np.ndarray, start: int | None = None) -> np.ndarray:
    """Nearest-neighbour chain over unit vectors c [nb, D]; returns a permutation [nb].

    `start` is the first index; by default the vector least similar to the mean of all.
    """
    nb = len(c)
    if nb == 0:
        return np.zeros(0, dtype=np.int64)
    sim = c @ c.T  # [nb, nb]
    cur = int(np.argmin(c @ c.mean(axis=0))) if start is None else start
    free = np.ones(nb, dtype=bool)
    order = [cur]
    free[cur] = False
    for _ in range(nb - 1):
        cur = int(np.argmax(np.where(free, sim[cur], -np.inf)))
        free[cur] = False
        order.append(cur)
    return np.array(order, dtype=np.int64)


def arrange_members(x: np.ndarray, plan: list[np.ndarray]) -> list[np.ndarray]:
    """Order the members of every batch from most like the previous batch to most like the next.

    When a continuous-batching engine frees slots, the next requests in plan order take them, so the
    tail of batch i runs beside the head of batch i + 1; this puts similar requests on that seam.
    """
    c = centroids(x, plan) if plan else np.zeros((0, x.shape[1]), np.float32)  # [nb, D]
    out = []
    for i, members in enumerate(plan):
        key = np.zeros(len(members))  # [b] toward next minus toward previous
        if i + 1 < len(plan):
            key += x[members] @ c[i + 1]
        if i > 0:
            key -= x[members] @ c[i - 1]
        out.append(members[np.lexsort((members, key))])  # ties: lower index first
    return out


def consecutive_similarity(x: np.ndarray, batches: list[np.ndarray]) -> float:
    """Mean cosine similarity of the centroids of consecutive batches (1.0 for one batch)."""
    if len(batches) < 2:
        return 1.0
    c = centroids(x, batches)  # [nb, D]
    return float((c[:-1] * c[1:]).sum(axis=1).mean())
