"""Lynx-Lat and Lynx-Acc against the brute-force vote-count reference."""

import pytest
import torch

from moe_cohort.engine.policy import parse_policy
from moe_cohort.engine.selection import select_experts
from tests.engine.selection.reference import assert_matches_reference, random_batches

LYNX = ["lynx-lat;drop=0", "lynx-lat;drop=1", "lynx-lat;drop=3", "lynx-lat;drop=100",
        "lynx-acc;drop=2;conf=0.5", "lynx-acc;drop=100;conf=0.0", "lynx-acc;drop=3;conf=1.0",
        "lynx-acc;drop=4;conf=0.35"]


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("text", LYNX)
def test_lynx_matches_reference(text, scoring):
    policy = parse_policy(text)
    for logits, top_k in random_batches(len(text) * 3, 25):
        assert_matches_reference(logits, top_k, policy, scoring=scoring)


def test_lynx_lat_drops_exactly_drop_experts():
    logits = torch.randn(16, 64, generator=torch.Generator().manual_seed(2))
    active = logits.topk(4, dim=-1).indices.unique().numel()
    _, ids = select_experts(logits, 4, "lynx-lat;drop=10")
    assert ids.unique().numel() == active - 10


def test_lynx_acc_keeps_primary_expert_of_confident_tokens():
    logits = torch.randn(16, 64, generator=torch.Generator().manual_seed(3))
    logits[:4, 7] += 8.0                     # four confident tokens whose primary is expert 7
    _, ids = select_experts(logits, 4, "lynx-acc;drop=1000;conf=0.6")
    assert (ids[:4, 0] == 7).all()
    assert ids.unique().numel() >= 1


def test_lynx_policies_leave_prefill_unchanged():
    logits = torch.randn(12, 32, generator=torch.Generator().manual_seed(4))
    plain = select_experts(logits, 4, "topk")
    for text in ("lynx-lat;drop=8", "lynx-acc;drop=8"):
        routed = select_experts(logits, 4, text, is_prefill=True)
        assert all(torch.equal(a, b) for a, b in zip(routed, plain))
        assert not torch.equal(select_experts(logits, 4, text)[1], plain[1])
