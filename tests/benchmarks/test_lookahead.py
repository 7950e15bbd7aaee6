"""Lookahead admission: the greedy reference when it does not look ahead, the best admission order when it sees all."""

import itertools
from dataclasses import replace

import numpy as np
import pytest

from benchmarks.lookahead import Lookahead
from moe_cohort.eval.policies import by_profile, fixed_order
from moe_cohort.eval.replay import decode_profiles, decode_tokens
from tests.conftest import random_traces


def _setup(n, seed, max_decode=9):
    ts = random_traces(n, num_experts=8, num_layers=3, top_k=2, max_prompt=2, max_decode=max_decode, seed=seed)
    tokens = decode_tokens(ts, "real")
    lengths = np.maximum(ts.num_decode_tokens, 1)
    return tokens, lengths, decode_profiles(tokens, ts)


@pytest.mark.parametrize("candidates,horizon", [(1, 6), (5, 0)])
@pytest.mark.parametrize("slots", [2, 4])
def test_without_lookahead_it_is_the_greedy_reference(candidates, horizon, slots):
    tokens, lengths, prof = _setup(16, seed=3)
    for seed in range(3):
        ref = replace(by_profile(prof), shuffle=True).run(tokens, lengths, slots, seed)
        got = Lookahead(prof.reshape(len(prof), -1), candidates, horizon).run(tokens, lengths, slots, seed)
        np.testing.assert_array_equal(got.order, ref.order)
        np.testing.assert_array_equal(got.start, ref.start)
        assert got.loads_per_token == ref.loads_per_token


def _metric(run, full_only):
    return run.loads_per_token_full if full_only else run.loads_per_token


def _brute_best(tokens, lengths, slots, full_only):
    """The fewest loads per token (over full steps: `full_only`) of any admission order (every order, FCFS)."""
    return min(_metric(fixed_order(p).run(tokens, lengths, slots), full_only)
               for p in itertools.permutations(range(len(lengths))))


@pytest.mark.parametrize("full_only", [False, True])
@pytest.mark.parametrize("seed", [0, 4])
def test_full_lookahead_finds_the_best_admission_order(seed, full_only):
    tokens, lengths, prof = _setup(6, seed=seed, max_decode=6)
    n, slots = len(lengths), 2
    best = _brute_best(tokens, lengths, slots, full_only)
    greedy = _metric(replace(by_profile(prof), shuffle=True).run(tokens, lengths, slots, 0), full_only)
    assert greedy > best + 1e-12  # the case is one the greedy rule gets wrong
    got = Lookahead(prof.reshape(n, -1), candidates=n, horizon=n, width=n, full_only=full_only).run(
        tokens, lengths, slots, 0)
    assert got.violations == 0 and sorted(got.order.tolist()) == list(range(n))
    assert _metric(got, full_only) == pytest.approx(best, rel=1e-12)


def test_bounded_lookahead_fills_every_slot_and_admits_everyone():
    tokens, lengths, prof = _setup(30, seed=5)
    got = Lookahead(prof.reshape(len(prof), -1), candidates=3, horizon=2).run(tokens, lengths, 4, 1)
    assert got.violations == 0 and sorted(got.order.tolist()) == list(range(30))
    assert got.tokens == int(lengths.sum())


def _expected_per_token(run, lengths, prof, slots):
    """Brute force: over the steps with every slot busy, the residents' expected distinct experts
    (sum over layers and experts of 1 - prod_r (1 - u_r), u clipped below 1 as the resident set clips it)
    per generated token."""
    u = np.clip(prof.reshape(len(prof), -1).astype(np.float64), 0.0, 1.0 - 1e-3)
    loads = toks = 0.0
    for step in range(run.makespan):
        live = [r for r in range(len(lengths)) if run.start[r] <= step < run.start[r] + lengths[r]]
        if len(live) == slots:
            loads += (1.0 - np.prod(1.0 - u[live], axis=0)).sum()
            toks += slots
    return loads / toks


@pytest.mark.parametrize("seed", [0, 4])
def test_full_lookahead_on_expected_loads_finds_the_order_of_fewest_expected_loads(seed):
    tokens, lengths, prof = _setup(6, seed=seed, max_decode=6)
    n, slots = len(lengths), 2
    brute = min(_expected_per_token(fixed_order(p).run(tokens, lengths, slots), lengths, prof, slots)
                for p in itertools.permutations(range(n)))
    got = Lookahead(prof.reshape(n, -1), candidates=n, horizon=n, width=n, expected=True).run(tokens, lengths, slots, 0)
    assert _expected_per_token(got, lengths, prof, slots) == pytest.approx(brute, rel=1e-9)
    wrong = Lookahead(prof.reshape(n, -1), candidates=n, horizon=n, width=n, expected=True,
                      plan_lengths=lengths[::-1].copy()).run(tokens, lengths, slots, 0)
    assert _expected_per_token(wrong, lengths, prof, slots) > brute + 1e-9  # planning on wrong lengths misses it
