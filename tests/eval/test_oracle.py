"""The bitmask greedy oracle against a naive Python-set greedy."""

import numpy as np
import pytest

from moe_cohort.eval.oracle import greedy_oracle
from moe_cohort.encoder.plans import validate_plan
from tests.conftest import random_traces
from moe_cohort.traces.loads import expert_masks


def forward_sets(ts, masks):
    """Per request, one Python set of experts per (forward, layer), decoded from nothing but the trace."""
    out = []
    for i in range(len(ts)):
        toks = ts.request_experts(i)
        n = ts.num_prompt_tokens[i]
        forwards = [toks[:n]] + [[toks[1 + t % (n - 1)]] if n >= 2 else [] for t in range(masks.decode_steps)]
        out.append([{int(e) for tok in fwd for e in tok[layer]} for fwd in forwards for layer in range(ts.num_layers)])
    return out


def naive_greedy(sets, batch_size):
    remaining = list(range(len(sets)))
    plan = []
    while remaining:
        batch = [remaining.pop(0)]
        union = [set(s) for s in sets[batch[0]]]
        while len(batch) < batch_size and remaining:
            costs = [sum(len(s - u) for s, u in zip(sets[r], union)) for r in remaining]
            r = remaining.pop(costs.index(min(costs)))
            batch.append(r)
            union = [u | s for u, s in zip(union, sets[r])]
        plan.append(batch)
    return plan


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("batch_size", [1, 3, 4, 40])
def test_bitmask_greedy_equals_naive_greedy(seed, batch_size):
    ts = random_traces(17, num_experts=70, top_k=3, max_prompt=6, seed=seed)
    masks = expert_masks(ts, decode_steps=5)
    got = greedy_oracle(masks.flat(), batch_size)
    validate_plan(got, len(ts), batch_size)
    assert [b.tolist() for b in got] == naive_greedy(forward_sets(ts, masks), batch_size)


def test_greedy_groups_requests_with_identical_experts():
    rows = np.array([[0b0011], [0b1100], [0b0011], [0b1100], [0b0111], [0b1100]], dtype=np.uint64)  # [N=6, P=1]
    plan = greedy_oracle(rows, 3)
    assert [b.tolist() for b in plan] == [[0, 2, 4], [1, 3, 5]]
