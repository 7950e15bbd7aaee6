"""bench_levers' sweep curves against the replay and direct cuts, and its reading at a fidelity."""

import math

import numpy as np
import pytest

from benchmarks.bench_ceiling import _config
from benchmarks.bench_levers import at_fidelity, curves, params
from benchmarks.selection_cut import lynx_cut, step_choices, xshare_cut
from moe_cohort.eval.policies import random_order
from moe_cohort.eval.replay import decode_tokens
from tests.conftest import random_traces


def test_at_fidelity_interpolates_between_the_sweeps_points():
    kept, lpt = np.array([1.0, 0.9, 0.5]), np.array([30.0, 20.0, 10.0])
    assert at_fidelity(lpt, kept, 0.95) == pytest.approx(25.0)
    assert at_fidelity(lpt, kept, 0.9) == 20.0
    assert math.isnan(at_fidelity(lpt, kept, 0.4))


def test_curves_per_token_match_the_replay_and_each_cut():
    ts = random_traces(24, num_experts=9, num_layers=3, top_k=3, max_prompt=2, max_decode=10, seed=2)
    tokens, lengths, slots = decode_tokens(ts, "real"), np.maximum(ts.num_decode_tokens, 1), 4
    run = random_order().run(tokens, lengths, slots, seed=1)
    ids = step_choices(ts.experts, tokens, run, lengths, slots)
    c = curves(ids, ts.num_experts, ts.top_k, slots, ts.num_layers)
    tokens_full = int((run.steps[run.full] * run.resident[run.full]).sum())
    assert c["none"][0][0] == run.loads_per_token_full
    routings = int((ids >= 0).sum())
    for i, m in enumerate(params("xshare", ts.num_experts, ts.top_k)):
        cut = xshare_cut(ids, ts.num_experts, m, 1)
        assert (c["xshare"][0][i], c["xshare"][1][i]) == (cut.loads / tokens_full, cut.kept / routings)
    for i, d in enumerate(params("lynx", ts.num_experts, ts.top_k)):
        cut = lynx_cut(ids, ts.num_experts, d)
        assert (c["lynx"][0][i], c["lynx"][1][i]) == (cut.loads / tokens_full, cut.kept / routings)
    assert c["moe-spec"][0][-1] == run.loads_per_token_full and c["moe-spec"][1][-1] == 1.0


def test_ceiling_configs():
    assert _config("8x16") == (8, 16, True) and _config("4x1000a") == (4, 1000, False)
