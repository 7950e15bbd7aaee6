"""Contract invariants that every selector keeps, on one medium random batch per setting."""

import pytest
import torch

from moe_cohort.engine.policy import PolicyError, parse_policy
from moe_cohort.engine.selection import gate_scores, select_experts

POLICIES = [
    "topk", "xshare;m=8;k0=1", "xshare;m=2;k0=0", "xshare;tau=2.0;k0=0",
    "xshare-spec;m=10;mr=5;k0=1", "xshare-spec;mr=2;k0=0", "xshare-ep;mg=2;k0=1",
    "xshare-ep;mg=1;k0=0", "oea;k0=1", "oea;k0=0;p=0.5;max_p=8", "lynx-lat;drop=12",
    "lynx-acc;drop=30;conf=0.4", "moe-spec;budget=6", "moe-spec;budget=6;cover=substitute",
]
TOKENS, EXPERTS, TOP_K = 24, 32, 4
SPANS = [(0, 4), (4, 8), (9, 13), (13, 24)]
GROUPS = [e // 8 for e in range(EXPERTS)]


def _warm(logits, k0):
    return set(logits.topk(k0, dim=-1).indices.flatten().tolist()) if k0 else set()


def _union_bound(policy, logits):
    """The union size each algorithm promises, or None where it promises none."""
    if policy.name in ("xshare", "xshare-spec") and policy.m is not None:
        return max(policy.m, len(_warm(logits, policy.k0)))
    if policy.name == "moe-spec":
        return policy.budget
    if policy.name == "lynx-lat":
        active = logits.topk(TOP_K, dim=-1).indices.unique().numel()
        return active - min(policy.drop, active - 1)
    if policy.name == "topk":
        return logits.topk(TOP_K, dim=-1).indices.unique().numel()
    return None


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("text", POLICIES)
def test_contract_invariants(text, scoring, renormalize):
    policy = parse_policy(text)
    logits = torch.randn(TOKENS, EXPERTS, generator=torch.Generator().manual_seed(len(text))) * 2
    weights, ids = select_experts(logits, TOP_K, policy, request_spans=SPANS, expert_groups=GROUPS,
                                  scoring=scoring, renormalize=renormalize)
    assert weights.shape == ids.shape == (TOKENS, TOP_K)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert ((ids >= 0) & (ids < EXPERTS)).all()
    used = weights > 0
    assert used[:, 0].all(), "every token keeps >= 1 expert"
    assert (weights[:, :-1] >= weights[:, 1:]).all(), "slots in descending weight"
    for t in range(TOKENS):
        kept = ids[t][used[t]].tolist()
        assert len(set(kept)) == len(kept)
        assert set(ids[t][~used[t]].tolist()) <= set(kept), "spare slots reuse a used id"
    scores = gate_scores(logits, scoring).gather(1, ids) * used
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(TOKENS))
    else:
        torch.testing.assert_close(weights, scores)
    bound = _union_bound(policy, logits)
    if bound is not None:
        assert ids.unique().numel() <= bound


@pytest.mark.parametrize("text", POLICIES)
def test_empty_batch(text):
    weights, ids = select_experts(torch.randn(0, EXPERTS), TOP_K, text, request_spans=[],
                                  expert_groups=GROUPS)
    assert weights.shape == ids.shape == (0, TOP_K)


@pytest.mark.parametrize("text", POLICIES)
def test_all_experts_equal_top_k(text):
    """E == top_k: budgets may shrink a token's set, but every token keeps >= 1 expert."""
    logits = torch.randn(6, TOP_K, generator=torch.Generator().manual_seed(7))
    if (parse_policy(text).__dict__.get("max_p") or 0) > TOP_K:
        with pytest.raises(PolicyError, match="max_p"):
            select_experts(logits, TOP_K, text)
        return
    weights, ids = select_experts(logits, TOP_K, text, expert_groups=[0, 0, 1, 1])
    assert (weights[:, 0] > 0).all() and ((ids >= 0) & (ids < TOP_K)).all()
