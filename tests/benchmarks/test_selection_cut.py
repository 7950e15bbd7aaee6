"""The selectors' cuts over trace routings against per-token brute force, and a replay's full steps gathered."""

from dataclasses import replace

import numpy as np
import pytest

from benchmarks.selection_cut import lynx_cut, moe_spec_cut, oea_cut, step_choices, xshare_cut
from moe_cohort.eval.policies import by_profile, random_order
from moe_cohort.eval.replay import decode_profiles, decode_tokens
from tests.conftest import random_traces

E = 7


def _groups(seed, g=40, t=5, k=3, weights=False):
    """Random ids [G, T, k] (distinct per token, some tokens absent: -1), and weights if asked."""
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((g, t, E)), axis=-1)[..., :k] % rng.integers(3, E + 1, size=(g, 1, 1))
    ids = np.where(rng.random((g, t, 1)) < 0.15, -1, ids)  # a token without decode routing
    for row in ids.reshape(-1, k):  # ids distinct per token (modulo folded some together)
        seen = set()
        for j, v in enumerate(row):
            row[j] = -1 if v in seen else v
            seen.add(int(v))
    return ids, (rng.random(ids.shape).astype(np.float32) if weights else None)


def _score(tok, w):
    agg = {}
    for ti, row in enumerate(tok):
        for j, e in enumerate(row):
            if e >= 0:
                agg[int(e)] = agg.get(int(e), 0.0) + (1.0 if w is None else float(w[ti, j]))
    return agg


def _brute_xshare(tok, w, m, k0):
    agg = _score(tok, w)
    warm = {int(e) for row in tok for e in row[:k0] if e >= 0}
    rest = sorted((e for e in agg if e not in warm), key=lambda e: (-agg[e], e))
    return warm | set(rest[: max(m - len(warm), 0)])


def _brute_moe_spec(tok, w, m):
    agg = _score(tok, w)
    return set(sorted(agg, key=lambda e: (-agg[e], e))[:m])


def _brute_oea(tok, k0):
    return {int(e) for row in tok for e in row[:k0] if e >= 0}


def _brute_lynx(tok, w, drop):
    votes, agg = _score(tok, None), _score(tok, w)
    n = min(drop, max(len(votes) - 1, 0))
    return set(votes) - set(sorted(votes, key=lambda e: (votes[e], agg[e], e))[:n])


def _check(cut, ids, sets):
    for g, s in enumerate(sets):
        assert set(np.flatnonzero(cut.experts[g]).tolist()) == s
        want = np.array([[e >= 0 and int(e) in s for e in row] for row in ids[g]])
        np.testing.assert_array_equal(cut.routings[g], want)


@pytest.mark.parametrize("weights", [False, True])
@pytest.mark.parametrize("m", [1, 2, 4, 7])
@pytest.mark.parametrize("k0", [0, 1, 2])
def test_xshare_keeps_warmup_then_fills_by_summed_weight(weights, m, k0):
    ids, w = _groups(1, weights=weights)
    cut = xshare_cut(ids, E, m, k0, w)
    _check(cut, ids, [_brute_xshare(ids[g], None if w is None else w[g], m, k0) for g in range(len(ids))])


@pytest.mark.parametrize("weights", [False, True])
@pytest.mark.parametrize("m", [1, 3, 5, 7])
def test_moe_spec_keeps_the_budget_of_highest_summed_weight(weights, m):
    ids, w = _groups(2, weights=weights)
    cut = moe_spec_cut(ids, E, m, w)
    _check(cut, ids, [_brute_moe_spec(ids[g], None if w is None else w[g], m) for g in range(len(ids))])
    assert (cut.experts.sum(-1) <= m).all()


@pytest.mark.parametrize("k0", [1, 2, 3])
def test_oea_keeps_the_baseline_union_and_piggybacks(k0):
    ids, _ = _groups(3)
    _check(oea_cut(ids, E, k0), ids, [_brute_oea(ids[g], k0) for g in range(len(ids))])


@pytest.mark.parametrize("weights", [False, True])
@pytest.mark.parametrize("drop", [0, 1, 3, 10])
def test_lynx_drops_the_least_voted(weights, drop):
    ids, w = _groups(4, weights=weights)
    cut = lynx_cut(ids, E, drop, w)
    _check(cut, ids, [_brute_lynx(ids[g], None if w is None else w[g], drop) for g in range(len(ids))])


@pytest.mark.parametrize("policy", ["random", "reference"])
def test_step_choices_are_the_replays_full_steps(policy):
    """Uncut, the gathered steps load what the replay counted over its full spans, token by token."""
    ts = random_traces(20, num_experts=9, num_layers=3, top_k=2, max_prompt=2, max_decode=12, seed=7)
    tokens = decode_tokens(ts, "real")
    lengths = np.maximum(ts.num_decode_tokens, 1)
    pol = random_order() if policy == "random" else replace(by_profile(decode_profiles(tokens, ts)), shuffle=True)
    run = pol.run(tokens, lengths, 4, seed=2)
    ids = step_choices(ts.experts, tokens, run, lengths, 4)  # [F * L, S, k]
    uncut = moe_spec_cut(ids, ts.num_experts, ts.num_experts)
    full_tokens = int((run.steps[run.full] * run.resident[run.full]).sum())
    assert ids.shape[0] == full_tokens // 4 * ts.num_layers
    assert uncut.loads == int(run.loads[run.full].sum())
    assert uncut.kept == int((ids >= 0).sum())
    # brute force: step by step, each full step's residents and their tokens' ids from the raw trace
    rows = []
    for step in range(run.makespan):
        live = [r for r in range(len(lengths)) if run.start[r] <= step < run.start[r] + lengths[r]]
        if len(live) == 4:
            for layer in range(ts.num_layers):
                rows.append(sorted(
                    tuple(sorted(ts.experts[ts.token_offsets[r] + ts.num_prompt_tokens[r] + step - run.start[r], layer]))
                    if ts.num_decode_tokens[r] else (-1, -1) for r in live))
    got = [sorted(tuple(sorted(t)) for t in g) for g in ids]
    assert got == rows


@pytest.mark.parametrize("weights", [False, True])
@pytest.mark.parametrize("selector,params", [("xshare", [0, 1, 2, 3, 5, 7]), ("moe-spec", [1, 2, 4, 7]),
                                             ("lynx", [0, 1, 2, 5, 9]), ("oea", [1, 2, 3])])
def test_sweep_equals_each_cut(weights, selector, params):
    from benchmarks.selection_cut import sweep

    ids, w = _groups(5, weights=weights)
    loads, kept = sweep(ids, E, selector, params, k0=1, weights=w)
    one = {"xshare": lambda p: xshare_cut(ids, E, p, 1, w), "moe-spec": lambda p: moe_spec_cut(ids, E, p, w),
           "lynx": lambda p: lynx_cut(ids, E, p, w), "oea": lambda p: oea_cut(ids, E, p)}[selector]
    assert loads.tolist() == [one(p).loads for p in params]
    assert kept.tolist() == [one(p).kept for p in params]
