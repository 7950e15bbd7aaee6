"""`select_experts` argument handling and `select_experts_mixed` (one policy per request)."""

import pytest
import torch

from moe_cohort.engine.policy import PolicyError, parse_policy
from moe_cohort.engine.selection import select_experts, select_experts_mixed


def _logits(tokens=20, experts=32, seed=0):
    return torch.randn(tokens, experts, generator=torch.Generator().manual_seed(seed)) * 2


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_policy_object_and_string_agree():
    logits = _logits()
    assert _same(select_experts(logits, 4, "xshare;m=6"), select_experts(logits, 4, parse_policy("xshare;m=6")))


def test_prefill_applies_only_non_decode_only_policies():
    logits = _logits()
    plain = select_experts(logits, 4, "topk")
    assert _same(select_experts(logits, 4, "oea;k0=1", is_prefill=True), plain)
    assert not _same(select_experts(logits, 4, "xshare;m=4", is_prefill=True), plain)


@pytest.mark.parametrize("call,message", [
    (lambda: select_experts(torch.randn(8), 2, "topk"), r"\[T, E\] float tensor"),
    (lambda: select_experts(torch.randn(3, 4), 5, "topk"), r"top_k must be in 1\.\.4"),
    (lambda: select_experts(torch.randn(3, 4), 2, "topk", scoring="tanh"), "scoring must be"),
    (lambda: select_experts(torch.randn(3, 4), 2, "topk", request_spans=[(1, 2), (0, 3)]),
     "sorted, disjoint"),
    (lambda: select_experts(torch.randn(3, 4), 2, "xshare-spec;m=2", request_spans=[(0, 4)]),
     "sorted, disjoint"),
])
def test_bad_arguments_raise_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_policy_that_does_not_fit_the_model_raises_policy_error():
    with pytest.raises(PolicyError, match="k0.*<= top_k=2"):
        select_experts(torch.randn(3, 8), 2, "oea;k0=3")
    with pytest.raises(PolicyError, match="max_p.*num_experts=8"):
        select_experts(torch.randn(3, 8), 2, "oea;k0=1;max_p=9")


def test_mixed_runs_each_policy_on_its_own_tokens():
    logits = _logits(tokens=20)
    spans = [(0, 4), (4, 7), (8, 12), (12, 20)]
    policies = ["xshare;m=3", "oea;k0=1", "xshare;m=3", "topk"]
    weights, ids = select_experts_mixed(logits, 4, policies, spans)
    group = torch.tensor([0, 1, 2, 3, 8, 9, 10, 11])               # xshare's tokens, one batch
    sub_w, sub_ids = select_experts(logits[group], 4, "xshare;m=3")
    assert torch.equal(ids[group], sub_ids) and torch.equal(weights[group], sub_w)
    assert _same((weights[4:7], ids[4:7]), select_experts(logits[4:7], 4, "oea;k0=1"))
    rest = torch.tensor([7] + list(range(12, 20)))                 # uncovered token 7 -> topk
    assert _same((weights[rest], ids[rest]), select_experts(logits[rest], 4, "topk"))


def test_mixed_rebases_spans_for_xshare_spec():
    logits = _logits(tokens=12)
    spans = [(0, 3), (3, 6), (6, 9), (9, 12)]
    policies = ["xshare-spec;m=6;mr=3", "topk", "xshare-spec;m=6;mr=3", "topk"]
    _, ids = select_experts_mixed(logits, 4, policies, spans)
    group = torch.tensor([0, 1, 2, 6, 7, 8])
    _, sub_ids = select_experts(logits[group], 4, "xshare-spec;m=6;mr=3", request_spans=[(0, 3), (3, 6)])
    assert torch.equal(ids[group], sub_ids)


def test_mixed_with_one_policy_equals_select_experts():
    logits = _logits(tokens=10)
    spans = [(0, 5), (5, 10)]
    assert _same(select_experts_mixed(logits, 4, ["moe-spec;budget=5"] * 2, spans),
                 select_experts(logits, 4, "moe-spec;budget=5"))


def test_mixed_prefill_and_errors():
    logits = _logits(tokens=6)
    routed = select_experts_mixed(logits, 4, ["lynx-lat;drop=5", "xshare;m=3"], [(0, 3), (3, 6)],
                                  is_prefill=True)
    assert _same((routed[0][:3], routed[1][:3]), select_experts(logits[:3], 4, "topk"))
    with pytest.raises(ValueError, match="one policy per request span"):
        select_experts_mixed(logits, 4, ["topk"], [(0, 3), (3, 6)])
    with pytest.raises(PolicyError, match="unknown policy"):
        select_experts_mixed(logits, 4, ["nope"], [(0, 6)])


def test_selectors_reject_misspelt_keywords():
    from moe_cohort.engine.selection import SELECTORS
    from moe_cohort.engine.selection.base import context_for

    logits, policy = _logits(), parse_policy("xshare;m=6")
    with pytest.raises(TypeError):
        SELECTORS["xshare"](logits, 4, policy, scorign="sigmoid")
    with pytest.raises(TypeError):
        SELECTORS["xshare"](logits, 4, policy, request_spans=[(0, 20)])   # xshare reads no spans
    assert context_for("xshare-spec", request_spans=[(0, 2)], expert_groups=None, layer=3) == {
        "request_spans": [(0, 2)]}
    assert context_for("moe-spec", layer=3) == {"layer": 3}
    with pytest.raises(TypeError, match="unknown batch context"):
        context_for("xshare", request_span=[(0, 2)])


def test_decode_only_is_resolved_by_policy_effective():
    oea, xshare = parse_policy("oea;k0=1"), parse_policy("xshare;m=4")
    assert oea.effective(is_prefill=True) == parse_policy("topk") and oea.effective(is_prefill=False) is oea
    assert xshare.effective(is_prefill=True) is xshare
