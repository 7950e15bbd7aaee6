"""The one held-out split of the project: by request, seeded, defined here and nowhere else.

Every training (the fine-tuned encoder, the expert-profile head) fits on the training side and
every held-out figure (bench_train, bench_continuous, `cohort eval` on held-out requests) is
measured on the other side, so no number is ever taken on a request a model saw. Requests with
the same text land on the same side (a duplicate prompt on both sides would leak).

    train_idx, held_idx = heldout_split(ts)          # the project's split: a fifth held out, seed 0
    train_idx, held_idx = split_requests(n, 0.2, 0)  # the same rule over bare indices
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from moe_cohort.traces.format import TraceSet

DEFAULT_HOLDOUT = 0.2
DEFAULT_SEED = 0


def heldout_split(ts: TraceSet, holdout: float = DEFAULT_HOLDOUT, seed: int = DEFAULT_SEED) -> tuple[np.ndarray, np.ndarray]:
    """(train, heldout) request indices of `ts`, grouped by prompt text when the traces carry texts."""
    return split_requests(len(ts), holdout, seed, groups=ts.texts)


def split_requests(n: int, holdout: float = DEFAULT_HOLDOUT, seed: int = DEFAULT_SEED,
                   groups: Sequence | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(train, heldout): disjoint sorted int64 indices covering range(n), by request.

    About `holdout` of the requests go to the held-out side (at least one of each side when
    0 < holdout < 1 and n >= 2). Requests with equal `groups` keys (e.g. identical texts) land
    on the same side. Deterministic under `seed`.
    """
    if not 0 <= holdout < 1:
        raise ValueError(f"holdout must lie in [0, 1), got {holdout}")
    keys = np.arange(n) if groups is None else np.unique(np.asarray(groups), return_inverse=True)[1].ravel()
    num_groups = int(keys.max()) + 1 if n else 0
    order = np.random.default_rng(seed).permutation(num_groups)  # [G] groups in held-out-first order
    sizes = np.bincount(keys, minlength=num_groups)[order]  # [G]
    want = int(round(holdout * n))
    if holdout > 0 and num_groups >= 2:
        want = min(max(want, 1), n - 1)
    taken = int(np.searchsorted(np.cumsum(sizes), want, side="left")) + 1 if want > 0 else 0
    taken = min(taken, num_groups - 1) if num_groups >= 2 else taken
    held = np.isin(keys, order[:taken])  # [N]
    return np.flatnonzero(~held), np.flatnonzero(held)
