"""Training pairs from traces: pair sampling that teaches batching.

The held-out split is traces.split (the project's one split), by request, never by pair: every
pair is built inside one side, so no held-out request (nor any request with the same text) is
ever seen in training.

A planner needs the encoder to get two things right: which requests are a request's best
batch-mates (the top of the ranking) and which look alike but are not (the base encoder's
mistakes). Random pairs alone mostly teach the bulk of the distribution, so `sample_pairs` mixes

- near neighbours: each anchor with its top partners by the overlap target;
- hard negatives: each anchor with the partners the *base* encoder finds most similar but whose
  target is lowest among them (high base cosine, low target);
- random pairs, for calibration over the whole range.

All pairs are unordered (a < b) and unique; everything is deterministic under `seed`. Memory
is O(chunk * N): targets and cosines are computed in row blocks, never as an N x N matrix.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
import numpy as np

from moe_cohort.traces.split import split_requests  # noqa: F401  (the one split lives in traces.split; re-exported for old callers)
from moe_cohort.train.targets import DEFAULT_TARGET, Target, pair_targets, target_block

log = logging.getLogger(__name__)

NEAR, HARD, RANDOM = 0, 1, 2
KIND_NAMES = ("near", "hard", "random")
_ROW_CHUNK = 256


@dataclass(frozen=True)
class PairSet:
    pairs: np.ndarray  # [P, 2] int64 request indices, a < b
    labels: np.ndarray  # [P] float32 overlap target of each pair
    kinds: np.ndarray  # [P] int8: NEAR, HARD or RANDOM

    def __len__(self) -> int:
        return len(self.pairs)

    def counts(self) -> dict[str, int]:
        return {name: int((self.kinds == i).sum()) for i, name in enumerate(KIND_NAMES)}


def sample_pairs(prof: np.ndarray, top_k: int, max_pairs: int, *, embeddings: np.ndarray | None = None,
                 kind: Target = DEFAULT_TARGET, near_frac: float = 0.4, hard_frac: float = 0.2,
                 candidates: int = 20, seed: int = 0) -> PairSet:
    """Sample up to `max_pairs` unique pairs of the requests of `prof` [N, L, E] and label them.

    `near_frac` of the budget goes to near neighbours, `hard_frac` to hard negatives (only when
    `embeddings` [N, d] of the base encoder are given: per anchor, the lowest-target partners
    among its `candidates` most cosine-similar ones), the rest to random pairs.
    """
    n = len(prof)
    max_pairs = min(max_pairs, n * (n - 1) // 2)
    rng = np.random.default_rng(seed)
    n_near, n_hard = int(near_frac * max_pairs), int(hard_frac * max_pairs)
    near = _fill(lambda m: near_pairs(prof, top_k, m, kind), n_near, n - 1, n)
    hard = np.zeros((0, 2), np.int64)
    if embeddings is not None and n_hard > 0:
        hard = _fill(lambda m: hard_negative_pairs(prof, embeddings, top_k, m, candidates, kind), n_hard, min(candidates, n - 1), n)
    pairs, kinds = _merge([_take(near, n_near, rng), _take(hard, n_hard, rng)], n)
    rand = random_pairs(n, max_pairs - len(pairs), rng, exclude=pairs)
    pairs = np.concatenate([pairs, rand])
    kinds = np.concatenate([kinds, np.full(len(rand), RANDOM, np.int8)])
    out = PairSet(pairs=pairs, labels=pair_targets(prof, pairs, top_k, kind).astype(np.float32), kinds=kinds)
    log.info("sampled %d pairs over %d requests: %s", len(out), n, out.counts())
    return out


def near_pairs(prof: np.ndarray, top_k: int, per_anchor: int, kind: Target = DEFAULT_TARGET) -> np.ndarray:
    """[M, 2] each request with its `per_anchor` highest-target partners (unordered, unique)."""
    n = len(prof)
    chosen = []
    for start in range(0, n, _ROW_CHUNK):
        rows = np.arange(start, min(start + _ROW_CHUNK, n))  # [R]
        t = target_block(prof, rows, top_k, kind)  # [R, N]
        t[np.arange(len(rows)), rows] = -np.inf
        chosen.append(_anchored(rows, _top_columns(t, per_anchor)))
    return _canonical(np.concatenate(chosen), n) if chosen else np.zeros((0, 2), np.int64)


def hard_negative_pairs(prof: np.ndarray, embeddings: np.ndarray, top_k: int, per_anchor: int, candidates: int = 20,
                        kind: Target = DEFAULT_TARGET) -> np.ndarray:
    """[M, 2] per anchor, of its `candidates` nearest by embedding cosine, the `per_anchor` of lowest target."""
    n = len(prof)
    emb = embeddings / np.maximum(np.linalg.norm(embeddings, axis=1, keepdims=True), 1e-12)  # [N, d]
    chosen = []
    for start in range(0, n, _ROW_CHUNK):
        rows = np.arange(start, min(start + _ROW_CHUNK, n))  # [R]
        cos = emb[rows] @ emb.T  # [R, N]
        cos[np.arange(len(rows)), rows] = -np.inf
        near = _top_columns(cos, candidates)  # [R, c] most similar by the base encoder
        t = target_block(prof, rows, top_k, kind)[np.arange(len(rows))[:, None], near]  # [R, c]
        pick = np.take_along_axis(near, _top_columns(-t, per_anchor), axis=1)  # [R, m] lowest targets
        chosen.append(_anchored(rows, pick))
    return _canonical(np.concatenate(chosen), n) if chosen else np.zeros((0, 2), np.int64)


def random_pairs(n: int, count: int, rng: np.random.Generator, exclude: np.ndarray | None = None) -> np.ndarray:
    """[count, 2] uniform random unordered pairs, unique and not in `exclude` (fewer if too few exist)."""
    taken = set() if exclude is None else set((exclude[:, 0] * n + exclude[:, 1]).tolist())
    count = max(0, min(count, n * (n - 1) // 2 - len(taken)))
    out: list[int] = []
    seen = set(taken)
    while len(out) < count:
        a, b = rng.integers(0, n, size=(2, 2 * (count - len(out)) + 16))  # [M] each
        for code in (np.minimum(a, b) * n + np.maximum(a, b))[a != b].tolist():
            if code not in seen and len(out) < count:
                seen.add(code)
                out.append(code)
    codes = np.array(out, dtype=np.int64)
    return np.stack([codes // n, codes % n], axis=1) if len(codes) else np.zeros((0, 2), np.int64)


def _fill(build, budget: int, most: int, n: int) -> np.ndarray:
    """build(per_anchor) with the smallest per_anchor (up to `most`) that yields `budget` unique pairs.

    Mutual neighbours collapse into one pair, so budget / N per anchor can fall short."""
    if budget <= 0 or most <= 0:
        return np.zeros((0, 2), np.int64)
    per = int(np.ceil(budget / n))
    while True:
        pairs = build(min(per, most))
        if len(pairs) >= budget or per >= most:
            return pairs
        per = max(per + 1, int(np.ceil(per * budget / max(len(pairs), 1))))


def _top_columns(scores: np.ndarray, m: int) -> np.ndarray:  # [R, N] -> [R, m], best first, ties to lower index
    m = min(m, scores.shape[1])
    return np.argsort(-scores, axis=1, kind="stable")[:, :m]


def _anchored(rows: np.ndarray, cols: np.ndarray) -> np.ndarray:  # [R], [R, m] -> [R*m, 2]
    return np.stack([np.repeat(rows, cols.shape[1]), cols.ravel()], axis=1)


def _canonical(pairs: np.ndarray, n: int) -> np.ndarray:  # [M, 2] -> unique [M', 2] with a < b, sorted
    pairs = pairs[pairs[:, 0] != pairs[:, 1]]
    codes = np.unique(np.minimum(pairs[:, 0], pairs[:, 1]) * n + np.maximum(pairs[:, 0], pairs[:, 1]))
    return np.stack([codes // n, codes % n], axis=1).astype(np.int64)


def _take(pairs: np.ndarray, count: int, rng: np.random.Generator) -> np.ndarray:
    """At most `count` of `pairs`, a seeded random subset when there are more."""
    if len(pairs) <= count:
        return pairs
    return pairs[np.sort(rng.choice(len(pairs), size=count, replace=False))]


def _merge(groups: list[np.ndarray], n: int) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate pair groups, dropping pairs an earlier group already holds; kinds = group index."""
    seen: set[int] = set()
    pairs, kinds = [], []
    for kind_id, group in enumerate(groups):
        codes = (group[:, 0] * n + group[:, 1]).tolist()
        fresh = np.array([c not in seen for c in codes], dtype=bool)
        seen.update(codes)
        pairs.append(group[fresh])
        kinds.append(np.full(int(fresh.sum()), kind_id, np.int8))
    return np.concatenate(pairs).reshape(-1, 2).astype(np.int64), np.concatenate(kinds).astype(np.int8)
