"""Distinct experts per token group and layer: what the plugin's expert-load metrics count.

Pure numpy and Python, no vLLM: `routing_hook` calls it once per forward with the step's expert
ids before and after the routing policy.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

SMALL_LAYER = 512  # ids per layer up to which Python sets beat numpy (right after a forward, caches are cold)


def distinct_experts(ids: Sequence[np.ndarray], group: np.ndarray, num_groups: int,
                     num_experts: int) -> list[list[int]]:
    """Distinct experts per token group and for all tokens, per layer.

    ids: L arrays [n, k] (or one [L, n, k] array) of expert ids; group [n] group index of each token
    in [0, num_groups). Returns [L][num_groups + 1]: entry g counts group g's experts, the last entry
    all tokens' experts. Small batches use Python sets, large ones one numpy scatter for all layers.
    """
    if len(ids) == 0:
        return []
    if ids[0].size > SMALL_LAYER:
        return _distinct_numpy(np.stack(ids), group, num_groups, num_experts).tolist()
    if num_groups == 1:
        return [[c, c] for c in (len(set(layer.ravel().tolist())) for layer in ids)]
    groups, counts = group.tolist(), []
    for layer in ids:
        used = [set() for _ in range(num_groups)]
        for g, row in zip(groups, layer.tolist()):
            used[g].update(row)
        counts.append([len(u) for u in used] + [len(set().union(*used))])
    return counts


def _distinct_numpy(ids: np.ndarray, group: np.ndarray, num_groups: int, num_experts: int) -> np.ndarray:
    """`distinct_experts` for ids [L, n, k] as one scatter; returns [L, num_groups + 1]."""
    num_layers = ids.shape[0]
    used = np.zeros((num_layers, num_groups, num_experts), dtype=bool)  # [L, G, E]
    used[np.arange(num_layers)[:, None, None], group[None, :, None], ids] = True
    return np.concatenate([used.sum(2), used.any(1).sum(1, keepdims=True)], axis=1)  # [L, G + 1]
