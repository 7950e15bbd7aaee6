"""Hand-made traces for the replica routings: one MoE layer, top-2, one token per request with the experts given."""

from __future__ import annotations

import numpy as np

from moe_cohort.traces.format import TraceSet


def expert_set_traces(sets, num_experts=8):
    """One MoE layer, top-2; request i's prompt is BOS + one token with experts sets[i] (its decode proxy token)."""
    rows = [r for s in sets for r in ([[7, 6]], [sorted(s)])]  # [2N, 1, 2]
    return TraceSet(num_experts=num_experts, num_layers=1, top_k=2,
                    token_offsets=np.arange(0, 2 * len(sets) + 1, 2, dtype=np.int64),
                    experts=np.array(rows, np.uint8), num_prompt_tokens=np.full(len(sets), 2, np.int64),
                    request_ids=np.array([f"r{i}" for i in range(len(sets))]))


# trace order a0, a1, b0, b1, a2, b2: two alike pairs and one neighbour of each
HAND = [{0, 1}, {0, 1}, {4, 5}, {4, 5}, {0, 2}, {4, 6}]
