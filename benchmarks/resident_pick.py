"""One admission choice against a resident set, without the waiting pool's fairness rules: the
candidate of lowest cost (admission.resident.Resident.cost) among the allowed ones, what a
benchmark times as the cost of one choice."""

from __future__ import annotations

import numpy as np

from moe_cohort.admission.resident import Resident


def pick(resident: Resident, vectors: np.ndarray, allowed: np.ndarray | None = None) -> int:
    """First index (into `vectors` [n, ...]) of the lowest cost; `allowed` [n] bool masks the others."""
    cost = np.asarray(resident.cost(vectors), dtype=np.float64)  # [n], lower is better
    if allowed is not None:
        if not allowed.any():
            raise ValueError("no allowed candidate to pick from")
        cost = np.where(allowed, cost, np.inf)
    return int(np.argmin(cost))
