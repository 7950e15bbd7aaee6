"""How well embedding cosine ranks pairs of requests by their overlap target (Spearman's rho).

Used before and after fine-tuning on held-out requests (train.finetune, benchmarks/bench_train.py).
Pure numpy + scipy.
"""

from __future__ import annotations

import numpy as np
from scipy.stats import spearmanr

from moe_cohort.train.targets import DEFAULT_TARGET, pair_targets


def cosine_spearman(embeddings: np.ndarray, prof: np.ndarray, top_k: int, kind: str = DEFAULT_TARGET,
                    near: int = 10) -> dict[str, float]:
    """Spearman(cosine, target) over all pairs of the rows, and over each row's `near` best pairs by target.

    embeddings [n, d], prof [n, L, E]; rows without counted tokens should be left out by the caller.
    """
    n = len(embeddings)
    emb = embeddings / np.maximum(np.linalg.norm(embeddings, axis=1, keepdims=True), 1e-12)  # [n, d]
    a, b = np.triu_indices(n, 1)
    target = pair_targets(prof, np.stack([a, b], 1), top_k, kind)  # [n(n-1)/2]
    cos = np.einsum("pd,pd->p", emb[a], emb[b])
    out = {"all_pairs": float(spearmanr(cos, target).statistic)}
    tm = np.full((n, n), -np.inf)
    tm[a, b] = tm[b, a] = target
    top = np.argsort(-tm, axis=1, kind="stable")[:, :near]  # [n, near]
    codes = np.unique(np.minimum(np.arange(n)[:, None], top) * n + np.maximum(np.arange(n)[:, None], top))
    na, nb = codes // n, codes % n
    out["near_pairs"] = float(spearmanr(np.einsum("pd,pd->p", emb[na], emb[nb]), tm[na, nb]).statistic)
    return out
