"""OEA (simplified and general form) against the brute-force per-token reference."""

import pytest
import torch

from moe_cohort.engine.policy import PolicyError, parse_policy
from moe_cohort.engine.selection import select_experts
from tests.engine.selection.reference import assert_matches_reference, random_batches

OEA = ["oea;k0=1", "oea;k0=2", "oea;k0=4", "oea;k0=0;p=0.5", "oea;k0=1;p=0.7",
       "oea;k0=1;p=1.0", "oea;k0=1;max_p=2", "oea;k0=2;p=0.4;max_p=9", "oea;k0=1;max_p=1"]


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("text", OEA)
def test_oea_matches_reference(text, scoring, renormalize):
    policy = parse_policy(text)
    for logits, top_k in random_batches(len(text), 25):
        try:
            policy.validate_for_model(top_k, logits.shape[1])
        except PolicyError:
            continue
        assert_matches_reference(logits, top_k, policy, scoring=scoring, renormalize=renormalize)


def test_oea_loads_only_the_baseline_union():
    logits = torch.randn(16, 32, generator=torch.Generator().manual_seed(0))
    _, ids = select_experts(logits, 8, "oea;k0=2")
    baseline = logits.topk(2, dim=-1).indices
    assert set(ids.unique().tolist()) == set(baseline.unique().tolist())
    assert torch.equal(ids[:, :2], baseline)


def test_oea_with_k0_equal_top_k_is_plain_topk():
    logits = torch.randn(9, 16, generator=torch.Generator().manual_seed(1))
    assert all(torch.equal(a, b) for a, b in
               zip(select_experts(logits, 4, "oea;k0=4"), select_experts(logits, 4, "topk")))
