"""MoE-Spec (router and static ranking; truncate and substitute) against the reference."""

import json

import pytest
import torch

from moe_cohort.engine.policy import parse_policy
from moe_cohort.engine.selection import select_experts
from tests.engine.selection.reference import assert_matches_reference, random_batches

ROUTER = ["moe-spec;budget=1", "moe-spec;budget=3", "moe-spec;budget=64",
          "moe-spec;budget=1;cover=substitute", "moe-spec;budget=3;cover=substitute",
          "moe-spec;budget=64;cover=substitute"]


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("text", ROUTER)
def test_moe_spec_router_matches_reference(text, scoring, renormalize):
    policy = parse_policy(text)
    for logits, top_k in random_batches(len(text) * 7, 25):
        assert_matches_reference(logits, top_k, policy, scoring=scoring, renormalize=renormalize)


def _calibration(tmp_path, counts):
    path = tmp_path / "counts.json"
    path.write_text(json.dumps({"counts": counts}))
    return str(path)


@pytest.mark.parametrize("cover", ["truncate", "substitute"])
def test_moe_spec_static_matches_reference(tmp_path, cover):
    gen = torch.Generator().manual_seed(9)
    for case, (logits, top_k) in enumerate(random_batches(11, 20)):
        num_experts = logits.shape[1]
        counts = torch.randint(0, 5, (2, num_experts), generator=gen).tolist()   # ties included
        case_dir = tmp_path / str(case)
        case_dir.mkdir()
        path = _calibration(case_dir, counts)
        policy = parse_policy(f"moe-spec;budget=3;rank=static;cover={cover};calib={path}")
        assert_matches_reference(logits, top_k, policy, layer=1, static=counts[1])


def test_moe_spec_union_never_exceeds_budget():
    logits = torch.randn(40, 64, generator=torch.Generator().manual_seed(1))
    for cover in ("truncate", "substitute"):
        _, ids = select_experts(logits, 6, f"moe-spec;budget=12;cover={cover}")
        assert ids.unique().numel() <= 12


def test_moe_spec_static_single_vector_and_layer_errors(tmp_path):
    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))
    flat = _calibration(tmp_path, list(range(8)))                  # higher index, higher rank
    _, ids = select_experts(logits, 2, f"moe-spec;budget=2;rank=static;calib={flat}")
    used = sorted(logits.topk(2, dim=-1).indices.unique().tolist())
    assert set(ids.unique().tolist()) == set(used[-2:])             # best two the batch uses
    (tmp_path / "l").mkdir()
    layered = _calibration(tmp_path / "l", [list(range(8))] * 3)
    with pytest.raises(ValueError, match="pass layer"):
        select_experts(logits, 2, f"moe-spec;budget=2;rank=static;calib={layered}")
    with pytest.raises(ValueError, match="counts for 8 experts"):
        select_experts(torch.randn(5, 9), 2, f"moe-spec;budget=2;rank=static;calib={flat}")
