"""Every selector traces as one graph under torch.compile(fullgraph=True).

The default backend here is "aot_eager": Dynamo's full-graph capture plus AOTAutograd's
functionalisation, the steps where data-dependent shapes, .item() or Python branching on tensor
values would fail, in a fraction of Inductor's compile time. Set COHORT_INDUCTOR_TESTS=1 to also
compile with Inductor (C++ codegen; about a minute on two cores); its fused softmax matches
eager up to float32 rounding, so weights are compared with a tolerance there.
"""

import json
import os

import pytest
import torch

from moe_cohort.engine.policy import parse_policy
from moe_cohort.engine.selection import SELECTORS, select_experts, select_experts_mixed
from moe_cohort.engine.selection.base import context_for
from moe_cohort.engine.selection.moe_spec import moe_spec_route

POLICIES = [
    "topk", "xshare;m=6;k0=1", "xshare;tau=0.5;k0=0", "xshare-spec;m=8;mr=4;k0=1",
    "xshare-spec;mr=3;k0=0", "xshare-ep;mg=2;k0=1", "oea;k0=1", "oea;k0=1;p=0.6;max_p=6",
    "lynx-lat;drop=4", "lynx-acc;drop=4;conf=0.3", "moe-spec;budget=5",
    "moe-spec;budget=5;cover=substitute",
]
CONTEXT = dict(request_spans=[(0, 3), (3, 7), (8, 12)], expert_groups=[e // 4 for e in range(16)])
BACKENDS = ["aot_eager"] + (["inductor"] if os.environ.get("COHORT_INDUCTOR_TESTS") else [])


def _logits():
    return torch.randn(12, 16, generator=torch.Generator().manual_seed(0))


def _assert_compiles(fn, *args):
    torch._dynamo.reset()
    for backend in BACKENDS:
        compiled = torch.compile(fn, fullgraph=True, backend=backend)
        (weights, ids), (want_w, want_ids) = compiled(*args), fn(*args)
        assert torch.equal(ids, want_ids), backend
        if backend == "aot_eager":
            assert torch.equal(weights, want_w)
        else:   # Inductor fuses softmax differently: equal up to float32 rounding
            torch.testing.assert_close(weights, want_w)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("text", POLICIES)
def test_selector_compiles_fullgraph(text, scoring):
    policy = parse_policy(text)
    selector = SELECTORS[policy.name]

    def route(logits):
        return selector(logits, 4, policy, scoring=scoring, renormalize=True, **context_for(policy.name, **CONTEXT))

    _assert_compiles(route, _logits())


@pytest.mark.parametrize("substitute", [False, True])
def test_moe_spec_static_core_compiles_fullgraph(substitute):
    static = torch.arange(16.0).flip(0)

    def route(logits):
        scores = logits.softmax(-1)
        return moe_spec_route(scores, 4, 5, substitute, static, True)

    _assert_compiles(route, _logits())


def test_moe_spec_static_selector_compiles_with_loaded_counts(tmp_path):
    path = tmp_path / "counts.json"
    path.write_text(json.dumps(list(range(16))))
    policy = parse_policy(f"moe-spec;budget=5;rank=static;calib={path}")
    SELECTORS["moe-spec"](torch.randn(2, 16), 4, policy)     # file read once, eagerly (cached)

    def route(logits):
        return SELECTORS["moe-spec"](logits, 4, policy)

    _assert_compiles(route, _logits())


def test_entry_points_compile_fullgraph():
    """Policies are parsed outside the compiled region (strings would be parsed while tracing)."""
    policy = parse_policy("xshare-spec;m=8;mr=4")
    policies = [policy, parse_policy("oea;k0=2"), policy]

    def single(logits):
        return select_experts(logits, 4, policy, request_spans=[(0, 6), (6, 12)])

    def mixed(logits):
        return select_experts_mixed(logits, 4, policies, [(0, 4), (4, 8), (8, 12)])

    logits = _logits()
    _assert_compiles(single, logits)
    _assert_compiles(mixed, logits)


def test_the_fused_path_check_compiles_with_nothing_decided_while_tracing(monkeypatch):
    """Whether the Triton kernels can run is a value decided once, when the module loads: a check that looks
    Triton up while tracing breaks the graph where Dynamo cannot trace the lookup (torch 2.11 on a GPU)."""
    import importlib
    import importlib.util

    from moe_cohort.engine.selection import fused

    fused = importlib.reload(fused)  # as in a new process: nothing asked before the first compiled call

    def looked_up(*args, **kwargs):
        raise AssertionError("Triton was looked up after the module loaded")

    monkeypatch.setattr(importlib.util, "find_spec", looked_up)

    def check(logits):
        return logits * 2 if fused.available(logits) else logits

    torch._dynamo.reset()
    compiled = torch.compile(check, fullgraph=True, backend="aot_eager")
    logits = _logits()
    assert torch.equal(compiled(logits), check(logits))
