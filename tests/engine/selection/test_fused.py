"""The Triton kernels and their torch twin against the brute-force references, per policy.

`route_fused` (Triton; on CPU through TRITON_INTERPRET=1, see conftest.py) and
`table_torch.route_tables` (torch) read policies from tables; each must make exactly the choices of
the per-token Python references in reference.py, on the same small random batches the per-policy
tests use (fewer of them: the interpreter is slow).
"""

import importlib.util

import pytest
import torch

from moe_cohort.engine.policy import parse_policy
from moe_cohort.engine.selection import gate_scores
from moe_cohort.engine.selection.table import build_tables
from moe_cohort.engine.selection.table_torch import route_tables
from tests.engine.selection.reference import REFERENCES, expected_outputs, random_batches

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HAS_TRITON = importlib.util.find_spec("triton") is not None


def _fused(*args, **kwargs):
    from moe_cohort.engine.selection.fused import route_fused

    return route_fused(*args, **kwargs)


IMPLS = [pytest.param(route_tables, id="torch"),
         pytest.param(_fused, id="triton", marks=pytest.mark.skipif(not HAS_TRITON, reason="no triton"))]
POLICIES = [
    "xshare;m=3;k0=1", "xshare;m=1;k0=2", "xshare;m=64;k0=1", "xshare;tau=1.0;k0=0", "xshare;tau=100.0;k0=0",
    "xshare;m=4;k0=1;tau=0.5", "xshare-spec;m=4;mr=2;k0=1", "xshare-spec;mr=3;k0=0", "xshare-spec;m=3;k0=0",
    "xshare-ep;mg=1;k0=0", "xshare-ep;mg=2;k0=1", "oea;k0=1", "oea;k0=2", "oea;k0=0;p=0.5",
    "oea;k0=2;p=0.4;max_p=9", "oea;k0=1;max_p=1", "lynx-lat;drop=1", "lynx-lat;drop=100",
    "lynx-acc;drop=2;conf=0.5", "lynx-acc;drop=4;conf=0.35", "moe-spec;budget=1", "moe-spec;budget=3",
    "moe-spec;budget=3;cover=substitute", "moe-spec;budget=3;rank=topk", "topk",
]


def _context(policy, num_tokens, num_experts, gen):
    spans, groups = None, None
    if policy.name == "xshare-spec":
        cuts = sorted(set(torch.randint(0, num_tokens + 1, (3,), generator=gen).tolist()) | {0, num_tokens})
        spans = [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a][::2] or None   # some tokens outside
    if policy.name == "xshare-ep":
        groups = torch.randint(0, 3, (num_experts,), generator=gen).tolist()
    return spans, groups


def check(impl, logits, top_k, policy, *, scoring="softmax", renormalize=True, spans=None, groups=None,
          static=None):
    """Route through `impl` with a one-slot table and compare with the Python reference."""
    num_tokens, num_experts = logits.shape
    tables = build_tables(num_tokens, num_experts, top_k, [policy], None, spans,
                          [None if static is None else torch.tensor(static)], groups, DEVICE)
    weights, ids = impl(logits.to(DEVICE), top_k, tables, scoring=scoring, renormalize=renormalize)
    scores = gate_scores(logits, scoring)
    chosen = REFERENCES[policy.name](scores.tolist(), top_k, policy, request_spans=spans,
                                     expert_groups=groups, static=static)
    want_w, want_ids = expected_outputs(scores, top_k, chosen, renormalize)
    assert torch.equal(ids.cpu(), want_ids), f"{policy}: ids\n{ids}\n!= reference\n{want_ids}"
    torch.testing.assert_close(weights.cpu().double(), want_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("text", POLICIES)
def test_matches_reference(impl, text):
    policy, gen = parse_policy(text), torch.Generator().manual_seed(len(text))
    for case, (logits, top_k) in enumerate(random_batches(len(text) * 5, 6)):
        try:
            policy.validate_for_model(top_k, logits.shape[1])
        except ValueError:
            continue
        spans, groups = _context(policy, *logits.shape, gen)
        scoring = ("softmax", "sigmoid")[case % 2]
        check(impl, logits, top_k, policy, scoring=scoring, renormalize=case % 3 != 2, spans=spans, groups=groups)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("cover", ["truncate", "substitute"])
def test_moe_spec_static_matches_reference(impl, cover, tmp_path):
    gen = torch.Generator().manual_seed(9)
    policy = parse_policy(f"moe-spec;budget=3;rank=static;cover={cover};calib={tmp_path / 'c.json'}")
    for logits, top_k in random_batches(11, 5):
        counts = torch.randint(0, 5, (logits.shape[1],), generator=gen).float().tolist()   # ties included
        check(impl, logits, top_k, policy, static=counts)


@pytest.mark.parametrize("impl", IMPLS)
def test_per_token_policies_match_one_policy_per_sub_batch(impl):
    """Slots in one call = each slot's tokens routed as their own batch; unslotted tokens keep top-k."""
    policies = [parse_policy(t) for t in ("topk", "xshare;m=3;k0=1", "lynx-lat;drop=3", "moe-spec;budget=4")]
    logits = torch.randn(20, 16, generator=torch.Generator().manual_seed(3)) * 2
    pid = torch.randint(0, 4, (20,), generator=torch.Generator().manual_seed(4)).tolist()
    tables = build_tables(20, 16, 4, policies, pid, None, [None] * 4, None, DEVICE)
    weights, ids = impl(logits.to(DEVICE), 4, tables)
    for slot, policy in enumerate(policies):
        rows = [t for t in range(20) if pid[t] == slot]
        one = build_tables(len(rows), 16, 4, [policy], None, None, [None], None, DEVICE)
        want_w, want_ids = impl(logits[rows].to(DEVICE), 4, one)
        assert torch.equal(ids[rows], want_ids), policy
        torch.testing.assert_close(weights[rows], want_w)


@pytest.mark.skipif(not HAS_TRITON, reason="no triton")
def test_router_rows_pass_through_and_scale_applies_to_rerouted_rows():
    policies = [parse_policy("topk"), parse_policy("xshare;m=2;k0=0")]
    logits = torch.randn(6, 8, generator=torch.Generator().manual_seed(5))
    router_w = torch.rand(6, 2, dtype=torch.bfloat16)
    router_ids = torch.randint(0, 8, (6, 2), dtype=torch.int32)
    tables = build_tables(6, 8, 2, policies, [0, 1, 0, 1, 1, 0], None, [None, None], None, DEVICE)
    weights, ids = _fused(logits.to(DEVICE), 2, tables, router=(router_w.to(DEVICE), router_ids.to(DEVICE)),
                          scale=2.5)
    keep = [0, 2, 5]
    assert torch.equal(ids[keep].cpu(), router_ids[keep].long())
    assert torch.equal(weights[keep].cpu(), router_w[keep].float())
    plain_w, plain_ids = route_tables(logits.to(DEVICE), 2, tables)
    assert torch.equal(ids[[1, 3, 4]], plain_ids[[1, 3, 4]])
    torch.testing.assert_close(weights[[1, 3, 4]], 2.5 * plain_w[[1, 3, 4]])


@pytest.mark.skipif(DEVICE.type != "cuda" or not HAS_TRITON, reason="model-sized batches: GPU only")
@pytest.mark.parametrize("num_tokens,num_experts", [(16, 64), (64, 128), (256, 128), (256, 256)])
def test_model_sized_batches_match_torch_twin(num_tokens, num_experts):
    gen = torch.Generator().manual_seed(num_tokens + num_experts)
    logits = torch.randn(num_tokens, num_experts, generator=gen) * 2
    for text in POLICIES:
        policy = parse_policy(text.replace("=100", "=16").replace("max_p=9", "max_p=16"))
        spans, groups = _context(policy, num_tokens, num_experts, gen)
        tables = build_tables(num_tokens, num_experts, 8, [policy], None, spans, [None], groups, DEVICE)
        got, want = _fused(logits.to(DEVICE), 8, tables), route_tables(logits.to(DEVICE), 8, tables)
        assert torch.equal(got[1], want[1]), text
        torch.testing.assert_close(got[0], want[0])


@pytest.mark.skipif(not HAS_TRITON, reason="no triton")
def test_select_fused_takes_groups_as_a_list_or_a_tensor():
    from moe_cohort.engine.selection.fused import select_fused

    logits = torch.randn(10, 16, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    policy, groups = parse_policy("xshare-ep;mg=1;k0=0"), [e // 4 for e in range(16)]
    as_list = select_fused(logits, 4, policy, expert_groups=groups)
    as_tensor = select_fused(logits, 4, policy, expert_groups=torch.tensor(groups, device=DEVICE))
    assert all(torch.equal(a, b) for a, b in zip(as_list, as_tensor))
    check(_fused, logits.cpu(), 4, policy, groups=groups)
    with pytest.raises(ValueError, match="one GPU index per expert"):
        select_fused(logits, 4, policy, expert_groups=torch.zeros(3, dtype=torch.int32, device=DEVICE))
