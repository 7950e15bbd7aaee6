"""Oracle-greedy batching on recorded expert traces: the ceiling a text-only planner aims for.

Greedy (Doubleword, "MoE expert co-activations", oracle): open a batch with the first request
not yet placed, then repeatedly add the request that adds the fewest new expert loads over the
batch's whole inference (prefill and every decode step, every layer), until the batch holds B
requests; repeat until every request is placed. Ties go to the lowest request index.

The speed-up is exact: every request is one row of bitmask words (one word per forward, layer
and 64 experts), so the new loads of all candidates at once are popcount(rows & ~union) summed
along the row, and the candidate matrix is compacted once per batch.
"""

from __future__ import annotations

import numpy as np

from moe_cohort.encoder.plans import Plan


def greedy_oracle(rows: np.ndarray, batch_size: int) -> Plan:
    """Greedy batches over bitmask rows [N, P] uint64 (see traces.loads.ExpertMasks.flat)."""
    remaining = np.arange(len(rows))  # [R] unplaced request indices, ascending
    plan: Plan = []
    while len(remaining):
        batch, remaining = _grow_batch(rows, remaining, batch_size)
        plan.append(batch)
    return plan


def _grow_batch(rows: np.ndarray, remaining: np.ndarray, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Open a batch with remaining[0] and fill it greedily; return (batch, still unplaced)."""
    candidates = remaining[1:]  # [R]
    cand_rows = rows[candidates]  # [R, P] compact copy
    union = rows[remaining[0]].copy()  # [P]
    taken = np.zeros(len(candidates), dtype=bool)  # [R]
    chosen = [int(remaining[0])]
    for _ in range(min(batch_size - 1, len(candidates))):
        new = np.bitwise_count(cand_rows & ~union).sum(axis=1, dtype=np.int64)  # [R] new loads per candidate
        new[taken] = np.iinfo(np.int64).max
        j = int(np.argmin(new))  # first minimum: lowest index on ties
        taken[j] = True
        union |= cand_rows[j]
        chosen.append(int(candidates[j]))
    return np.array(chosen, dtype=np.int64), candidates[~taken]
