"""The `topk` reference selector and the shared tensor steps."""

import pytest
import torch

from moe_cohort.engine.selection import SELECTORS, gate_scores, select_experts
from moe_cohort.engine.selection.base import compact, request_ids, route_within
from moe_cohort.engine.selection.sets import fill_to_budget, lex_rank


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("renormalize", [True, False])
def test_topk_is_softmax_then_topk(dtype, renormalize):
    logits = (torch.randn(33, 64, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    weights, ids = select_experts(logits, 6, "topk", renormalize=renormalize)
    want_w, want_ids = torch.softmax(logits, dim=-1, dtype=torch.float32).topk(6, dim=-1)
    if renormalize:
        want_w = want_w / want_w.sum(dim=-1, keepdim=True)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_w)


@pytest.mark.parametrize("renormalize", [True, False])
def test_topk_is_sigmoid_then_topk(renormalize):
    logits = torch.randn(17, 32, generator=torch.Generator().manual_seed(1)) * 3
    weights, ids = select_experts(logits, 4, "topk", scoring="sigmoid", renormalize=renormalize)
    want_w, want_ids = logits.float().sigmoid().topk(4, dim=-1)
    if renormalize:
        want_w = want_w / want_w.sum(dim=-1, keepdim=True)
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_w)


def test_gate_scores_rejects_unknown_scoring():
    with pytest.raises(ValueError, match="scoring must be one of"):
        gate_scores(torch.randn(2, 4), "relu")


def test_route_within_fills_spare_slots_with_first_id_and_zero_weight():
    scores = torch.tensor([[0.1, 0.5, 0.3, 0.1], [0.4, 0.3, 0.2, 0.1]])
    allowed = torch.tensor([False, True, True, False])
    weights, ids = route_within(scores, allowed, 3, renormalize=True)
    assert ids.tolist() == [[1, 2, 1], [1, 2, 1]]
    torch.testing.assert_close(weights, torch.tensor([[0.625, 0.375, 0.0], [0.6, 0.4, 0.0]]))


def test_compact_keeps_first_kept_slots_in_order():
    weights = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    ids = torch.tensor([[5, 2, 7, 1]])
    kept = torch.tensor([[False, True, False, True]])
    out_w, out_ids = compact(weights, ids, kept, 3, renormalize=False)
    assert out_ids.tolist() == [[2, 1, 2]]
    torch.testing.assert_close(out_w, torch.tensor([[0.3, 0.1, 0.0]]))


def test_request_ids_make_uncovered_tokens_their_own_requests():
    rid, count = request_ids(8, [(1, 3), (3, 6)], torch.device("cpu"))
    assert rid.tolist() == [0, 1, 1, 2, 2, 2, 3, 4] and count == 5
    rid, count = request_ids(3, None, torch.device("cpu"))
    assert rid.tolist() == [0, 0, 0] and count == 1


def test_fill_to_budget_per_row():
    base = torch.tensor([[True, False, False, False], [True, True, True, False]])
    score = torch.tensor([[0.0, 0.1, 0.9, 0.5], [0.0, 0.0, 0.0, 1.0]])
    candidates = torch.tensor([[True, True, True, False], [True, True, True, True]])
    out = fill_to_budget(base, candidates, score, 2)
    assert out.tolist() == [[True, False, True, False], [True, True, True, False]]


def test_lex_rank_orders_candidates_by_keys_then_index_within_groups():
    votes = torch.tensor([2, 1, 1, 3, 1])
    agg = torch.tensor([0.5, 0.2, 0.2, 0.1, 0.1])
    candidates = torch.tensor([True, True, True, True, False])
    assert lex_rank([votes, agg], candidates)[:4].tolist() == [2, 0, 1, 3]
    groups = torch.tensor([0, 1, 0, 1, 0])
    assert lex_rank([votes, agg], candidates, groups)[:4].tolist() == [1, 0, 0, 1]


def test_registry_covers_every_policy_name():
    from moe_cohort.engine.policy import POLICY_NAMES
    assert set(SELECTORS) == set(POLICY_NAMES)
