"""The continuous-batching replay against a step-by-step brute force on small traces."""

import numpy as np
import pytest

from moe_cohort.eval.policies import EmbeddingPolicy, OrderPolicy, ProfilePolicy
from moe_cohort.eval.replay import decode_profiles, decode_tokens, replay
from tests.conftest import random_traces
from moe_cohort.train.targets import profiles


def _token_sets(ts, r, t, mode):
    """Expert sets per layer of request r's decode step t, from the raw trace (None: no token)."""
    start, n_prompt, n_dec = ts.token_offsets[r], ts.num_prompt_tokens[r], ts.num_decode_tokens[r]
    if mode == "real":
        if n_dec == 0:
            return None
        row = start + n_prompt + t % n_dec
    else:
        if n_prompt < 2:
            return None
        row = start + 1 + t % (n_prompt - 1)
    return [set(ts.experts[row, l].tolist()) for l in range(ts.num_layers)]


def _brute(ts, lengths, slots, policy, mode, arrivals, max_wait):
    """One step at a time: fill free slots (overdue first, oldest first), count distinct experts, advance."""
    n = len(lengths)
    slot_req, slot_t = [-1] * slots, [0] * slots
    waiting, done, now, loads, tokens, order = set(), 0, 0, 0, 0, []
    while done < n:
        waiting |= {r for r in range(n) if arrivals[r] <= now and r not in order}
        for s in range(slots):
            if slot_req[s] < 0 and waiting:
                late = [r for r in waiting if max_wait is not None and now - arrivals[r] >= max_wait]
                mask = np.zeros(n, bool)
                mask[list(waiting)] = True
                r = min(late, key=lambda q: (-(now - arrivals[q]), q)) if late else policy.choose(mask)
                waiting.discard(r)
                slot_req[s], slot_t[s] = r, 0
                order.append(r)
                policy.admit(r)
        union = [set() for _ in range(ts.num_layers)]
        for s in range(slots):
            if slot_req[s] >= 0:
                sets = _token_sets(ts, slot_req[s], slot_t[s], mode)
                for l in range(ts.num_layers):
                    union[l] |= sets[l] if sets else set()
                tokens += 1
        loads += sum(len(u) for u in union)
        now += 1
        for s in range(slots):
            if slot_req[s] >= 0:
                slot_t[s] += 1
                if slot_t[s] >= lengths[slot_req[s]]:
                    policy.release(slot_req[s])
                    slot_req[s] = -1
                    done += 1
    return loads, tokens, order


@pytest.mark.parametrize("mode,max_decode", [("proxy", 0), ("real", 5)])
@pytest.mark.parametrize("slots", [1, 3, 5])
def test_replay_matches_the_step_by_step_engine(mode, max_decode, slots):
    ts = random_traces(14, max_prompt=6, max_decode=max_decode, seed=slots)
    lengths = np.random.default_rng(slots).integers(1, 9, size=len(ts))
    tok = decode_tokens(ts, mode)
    prof = decode_profiles(tok, ts)
    for make in (lambda: OrderPolicy(np.random.default_rng(0).permutation(len(ts))), lambda: ProfilePolicy(prof)):
        got = replay(tok, lengths, slots, make())
        loads, tokens, order = _brute(ts, lengths, slots, make(), mode, np.zeros(len(ts), int), None)
        assert (int(got.loads.sum()), got.tokens) == (loads, tokens)
        assert got.order.tolist() == order
        assert got.tokens == lengths.sum()


def test_fairness_bound_and_arrivals_follow_the_brute_force():
    ts = random_traces(16, max_prompt=6, seed=4)
    lengths = np.random.default_rng(4).integers(1, 7, size=len(ts))
    arrivals = np.sort(np.random.default_rng(5).integers(0, 12, size=len(ts)))
    x = np.random.default_rng(6).normal(size=(len(ts), 4))
    tok = decode_tokens(ts)
    got = replay(tok, lengths, 2, EmbeddingPolicy(x), arrivals=arrivals, max_wait=3)
    loads, _, order = _brute(ts, lengths, 2, EmbeddingPolicy(x), "proxy", arrivals, 3)
    assert got.order.tolist() == order and int(got.loads.sum()) == loads
    assert (got.start >= arrivals).all()


def test_decode_profiles_are_the_training_profiles():
    for max_decode in (0, 4):
        ts = random_traces(10, max_prompt=6, max_decode=max_decode, seed=7)
        tok = decode_tokens(ts)
        np.testing.assert_allclose(decode_profiles(tok, ts), profiles(ts), rtol=1e-6)
