"""XShare Alg. 1-6 against the brute-force greedy references, plus their budget promises."""

import zlib

import pytest
import torch

from moe_cohort.engine.policy import PolicyError, parse_policy
from moe_cohort.engine.selection import select_experts
from tests.engine.selection.reference import assert_matches_reference, random_batches

XSHARE = [
    "xshare;m=3;k0=1", "xshare;m=5;k0=0", "xshare;m=1;k0=2",      # budget < warm-up set
    "xshare;m=64;k0=1",                                            # budget >= union
    "xshare;tau=1.0;k0=0", "xshare;tau=0.3;k0=1", "xshare;tau=100.0;k0=0",  # empty -> argmax
    "xshare;m=4;k0=1;tau=0.5",
]
SPEC = ["xshare-spec;m=4;mr=2;k0=1", "xshare-spec;mr=3;k0=0", "xshare-spec;m=3;k0=0",
        "xshare-spec;m=1;mr=1;k0=2", "xshare-spec;m=64;mr=64;k0=1"]
EP = ["xshare-ep;mg=1;k0=0", "xshare-ep;mg=2;k0=1", "xshare-ep;mg=1;k0=2", "xshare-ep;mg=64;k0=1"]


def _fits(policy, top_k, num_experts):
    try:
        policy.validate_for_model(top_k, num_experts)
        return True
    except PolicyError:
        return False


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("text", XSHARE)
def test_xshare_matches_reference(text, scoring):
    policy = parse_policy(text)
    for logits, top_k in random_batches(zlib.crc32(text.encode()), 25):
        if _fits(policy, top_k, logits.shape[1]):
            assert_matches_reference(logits, top_k, policy, scoring=scoring,
                                     renormalize=scoring == "softmax")


def _random_spans(num_tokens: int, gen: torch.Generator) -> list[tuple[int, int]]:
    """Sorted disjoint spans, sometimes leaving tokens outside every span."""
    spans, start = [], 0
    while start < num_tokens:
        length = int(torch.randint(1, 4, (), generator=gen))
        end = min(start + length, num_tokens)
        if int(torch.randint(0, 4, (), generator=gen)) > 0:
            spans.append((start, end))
        start = end
    return spans


@pytest.mark.parametrize("text", SPEC)
def test_xshare_spec_matches_reference(text):
    policy, gen = parse_policy(text), torch.Generator().manual_seed(5)
    for logits, top_k in random_batches(len(text), 30):
        if _fits(policy, top_k, logits.shape[1]):
            spans = _random_spans(logits.shape[0], gen)
            assert_matches_reference(logits, top_k, policy, request_spans=spans)
            assert_matches_reference(logits, top_k, policy, request_spans=None)


@pytest.mark.parametrize("text", EP)
def test_xshare_ep_matches_round_robin_reference(text):
    policy, gen = parse_policy(text), torch.Generator().manual_seed(6)
    for logits, top_k in random_batches(len(text) + 1, 30):
        if _fits(policy, top_k, logits.shape[1]):
            groups = torch.randint(0, 3, (logits.shape[1],), generator=gen).tolist()
            assert_matches_reference(logits, top_k, policy, expert_groups=groups)
            assert_matches_reference(logits, top_k, policy, expert_groups=None)


def _warm_union(logits, k0):
    return logits.topk(k0, dim=-1).indices.unique().numel() if k0 else 0


@pytest.mark.parametrize("m,k0", [(2, 0), (4, 1), (6, 2), (1, 2)])
def test_xshare_union_within_budget_or_warm_up(m, k0):
    logits = torch.randn(32, 24, generator=torch.Generator().manual_seed(m))
    _, ids = select_experts(logits, 4, f"xshare;m={m};k0={k0}")
    assert ids.unique().numel() <= max(m, _warm_union(logits, k0))
    top_k0 = logits.topk(k0, dim=-1).indices if k0 else ids[:, :0]
    assert torch.equal(ids[:, :k0], top_k0)              # every token keeps its top-k0


def test_xshare_spec_respects_request_and_batch_budgets():
    logits = torch.randn(24, 32, generator=torch.Generator().manual_seed(3))
    spans = [(i, i + 4) for i in range(0, 24, 4)]
    _, ids = select_experts(logits, 4, "xshare-spec;m=10;mr=5;k0=1", request_spans=spans)
    assert ids.unique().numel() <= max(10, _warm_union(logits, 1))
    for start, end in spans:
        warm = _warm_union(logits[start:end], 1)
        assert ids[start:end].unique().numel() <= max(5, warm)


def test_xshare_ep_bounds_per_gpu_load():
    logits = torch.randn(32, 32, generator=torch.Generator().manual_seed(4))
    groups = [e % 4 for e in range(32)]
    _, ids = select_experts(logits, 4, "xshare-ep;mg=3;k0=0", expert_groups=groups)
    loads = torch.bincount(torch.tensor(groups)[ids.unique()], minlength=4)
    assert loads.max() <= 3


def test_xshare_ep_rejects_wrong_group_length():
    with pytest.raises(ValueError, match="one GPU index per expert"):
        select_experts(torch.randn(4, 8), 2, "xshare-ep;mg=2", expert_groups=[0, 1])
