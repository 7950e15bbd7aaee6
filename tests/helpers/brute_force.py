"""Brute-force references for admission by expected new experts: the count by loops (`brute_expected_new`)
and by numpy (`expected_new`), the order a batch is sent in (`brute_force_order`); and the profiles and
resident set they are checked on."""

from __future__ import annotations

import numpy as np

from moe_cohort.admission.resident import ResidentEmbedding


def random_profiles(n, layers=3, experts=8, seed=0):
    rng = np.random.default_rng(seed)
    p = rng.random((n, layers, experts)) * (rng.random((n, layers, experts)) < 0.5)
    return (p / np.maximum(p.max(axis=-1, keepdims=True), 1e-9)).astype(np.float32)  # [n, L, E] in [0, 1]


def brute_expected_new(resident, cand):
    """sum_{l,e} u_c[l,e] * prod_r (1 - u_r[l,e]), by loops."""
    total = 0.0
    for l in range(cand.shape[0]):
        for e in range(cand.shape[1]):
            idle = 1.0
            for r in resident:
                idle *= 1.0 - min(float(r[l, e]), 1 - 1e-3)
            total += float(cand[l, e]) * idle
    return total


def embedded_residents() -> tuple[np.ndarray, ResidentEmbedding]:
    """20 unit embeddings [20, 5] and a resident set that holds rows 2 and 9 (4 came and left)."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(20, 5)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    state = ResidentEmbedding(5)
    for r in (2, 4, 9):
        state.add(x[r])
    state.remove(x[4])
    return x, state


def expected_new(vector, residents):
    """Brute force: expected new experts of `vector` next to `residents` (independent tokens, u clipped at 0.999)."""
    idle = np.prod([1.0 - np.clip(r, 0, 0.999) for r in residents], axis=0) if residents else np.ones_like(vector)
    return float((vector * idle).sum())


def brute_force_order(vectors, concurrency):
    """Send the oldest while nothing is out, else the one adding the fewest expected experts to those out."""
    waiting, out, sent = list(range(len(vectors))), [], []
    while waiting:
        if len(out) >= concurrency:
            out.pop(0)
        if not out:
            choice = waiting[0]
        else:
            idle = np.prod([1 - np.clip(vectors[o], 0, 0.999) for o in out], axis=0)
            choice = min(waiting, key=lambda i: (round(float(vectors[i] @ idle), 9), i))
        waiting.remove(choice)
        out.append(choice)
        sent.append(choice)
    return sent
