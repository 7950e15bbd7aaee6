"""The continuous-batching replay (one engine, or replicas) against a step-by-step replay of the same router."""

import numpy as np
import pytest

from moe_cohort.eval.policies import Policy, by_embedding, by_profile, random_order
from moe_cohort.eval.replay import decode_profiles, decode_tokens
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


def _brute(ts, lengths, policy, slots, mode, arrivals=None, max_wait=None, seed=0, clients=None, full=None):
    """One step at a time through `policy`'s router: arrivals join (in the policy's order; with `clients`,
    the first `clients` of it, then one more per finished request), free slots fill, every replica loads
    its residents' experts, finished requests leave. -> loads, tokens, order, replica. `full` (a list):
    gets (loads, tokens) of every replica-step with all of the replica's slots busy."""
    n = len(lengths)
    arrivals = np.zeros(n, int) if arrivals is None else arrivals
    router = policy.router(slots, max_wait)
    join = np.random.default_rng(seed).permutation(n) if policy.shuffle else (
        np.arange(n) if policy.order is None else policy.order)
    places = [(r, s) for r in range(len(slots)) for s in range(slots[r])]
    req, t = {p: -1 for p in places}, {p: 0 for p in places}
    added, order, replica, now, loads, tokens, done = set(), [], {}, 0, 0, 0, 0
    while done < n:
        sent = set(join[: n if clients is None else clients + done])
        for i in sorted(range(n), key=lambda q: (arrivals[q], list(join).index(q))):
            if arrivals[i] <= now and i not in added and i in sent:
                router.add(i, None if policy.vectors is None else policy.vectors[i], now)
                added.add(i)
        for key, rep in router.admit(now):
            p = next(p for p in places if p[0] == rep and req[p] < 0)
            req[p], t[p], replica[key] = key, 0, rep
            order.append(key)
        for rep in range(len(slots)):
            union = [set() for _ in range(ts.num_layers)]
            busy = [p for p in places if p[0] == rep and req[p] >= 0]
            for p in busy:
                sets = _token_sets(ts, req[p], t[p], mode)
                for layer in range(ts.num_layers):
                    union[layer] |= sets[layer] if sets else set()
                tokens += 1
            loads += sum(len(u) for u in union)
            if full is not None and len(busy) == slots[rep]:
                full.append((sum(len(u) for u in union), len(busy)))
        now += 1
        for p in places:
            if req[p] >= 0:
                t[p] += 1
                if t[p] >= lengths[req[p]]:
                    router.release(req[p])
                    req[p] = -1
                    done += 1
    return loads, tokens, order, [replica[i] for i in range(n)]


@pytest.mark.parametrize("mode,max_decode", [("proxy", 0), ("real", 5)])
@pytest.mark.parametrize("slots", [1, 3, 5])
def test_one_engine_matches_the_step_by_step_replay(mode, max_decode, slots):
    ts = random_traces(14, max_prompt=6, max_decode=max_decode, seed=slots)
    lengths = np.random.default_rng(slots).integers(1, 9, size=len(ts))
    tok = decode_tokens(ts, mode)
    for policy in (random_order(), by_profile(decode_profiles(tok, ts))):
        got = policy.run(tok, lengths, slots, seed=7)
        loads, tokens, order, _ = _brute(ts, lengths, policy, [slots], mode, seed=7)
        assert (int(got.loads.sum()), got.tokens, got.order.tolist()) == (loads, tokens, order)
        assert got.tokens == lengths.sum() and got.violations == 0


@pytest.mark.parametrize("routing", ["round-robin", "least-loaded", "affinity"])
@pytest.mark.parametrize("slots", [[1, 2], [2, 2, 3]])
def test_replicas_match_the_step_by_step_replay(routing, slots):
    ts = random_traces(16, max_prompt=6, seed=len(slots))
    lengths = np.random.default_rng(3).integers(1, 8, size=len(ts))
    times = np.sort(np.random.default_rng(4).integers(0, 10, size=len(ts)))
    tok = decode_tokens(ts, "proxy")
    policy = Policy(routing, decode_profiles(tok, ts).reshape(len(ts), -1))
    got = policy.run(tok, lengths, slots, times=times)
    loads, tokens, order, replica = _brute(ts, lengths, policy, slots, "proxy", times)
    assert (int(got.loads.sum()), got.tokens, got.order.tolist(), got.replica.tolist()) == (loads, tokens, order, replica)
    assert got.tokens == lengths.sum() and (got.start >= times).all()


def test_fairness_bound_and_arrivals_follow_the_step_by_step_replay():
    ts = random_traces(16, max_prompt=6, seed=4)
    lengths = np.random.default_rng(4).integers(1, 7, size=len(ts))
    times = np.sort(np.random.default_rng(5).integers(0, 12, size=len(ts)))
    policy = by_embedding(np.random.default_rng(6).normal(size=(len(ts), 4)))
    tok = decode_tokens(ts)
    got = policy.run(tok, lengths, 2, max_wait=3, times=times)
    loads, _, order, _ = _brute(ts, lengths, policy, [2], "proxy", times, max_wait=3)
    assert got.order.tolist() == order and int(got.loads.sum()) == loads
    assert (got.start >= times).all()
    assert got.order.tolist() != policy.run(tok, lengths, 2, times=times).order.tolist()  # the bound acted


@pytest.mark.parametrize("clients", [1, 4, 7, 30])
@pytest.mark.parametrize("slots", [[3], [2, 2]])
def test_closed_loop_clients_follow_the_step_by_step_replay(clients, slots):
    ts = random_traces(18, max_prompt=6, max_decode=5, seed=clients)
    lengths = np.random.default_rng(clients).integers(1, 9, size=len(ts))
    tok = decode_tokens(ts, "real")
    for policy in (random_order(), Policy("affinity", decode_profiles(tok, ts).reshape(len(ts), -1))):
        got = policy.run(tok, lengths, slots if len(slots) > 1 else slots[0], seed=5, clients=clients)
        loads, tokens, order, replica = _brute(ts, lengths, policy, slots, "real", seed=5, clients=clients)
        assert (int(got.loads.sum()), got.tokens, got.order.tolist(), got.replica.tolist()) == (loads, tokens, order, replica)
        assert got.tokens == lengths.sum()
    profile = Policy("affinity", decode_profiles(tok, ts).reshape(len(ts), -1))
    open_loop = profile.run(tok, lengths, slots[0], seed=5)
    assert profile.run(tok, lengths, slots[0], seed=5, clients=len(ts)).order.tolist() == open_loop.order.tolist()
    if clients <= slots[0]:  # no more clients than slots: nothing ever waits, so arrival order it is
        assert profile.run(tok, lengths, slots[0], seed=5, clients=clients).order.tolist() == list(range(len(ts)))


@pytest.mark.parametrize("slots,clients", [([3], None), ([4], 6), ([2, 3], None)])
def test_kept_full_counts_the_steps_with_every_slot_busy(slots, clients):
    ts = random_traces(20, max_prompt=6, max_decode=5, seed=len(slots) + 2)
    lengths = np.random.default_rng(9).integers(1, 12, size=len(ts))
    tok = decode_tokens(ts, "real")
    for policy in (random_order(), Policy("affinity", decode_profiles(tok, ts).reshape(len(ts), -1))):
        got = policy.run(tok, lengths, slots if len(slots) > 1 else slots[0], seed=3, clients=clients)
        full = []
        _brute(ts, lengths, policy, slots, "real", seed=3, clients=clients, full=full)
        loads, tokens = np.array(full).sum(axis=0)
        assert got.loads_per_token_full == pytest.approx(loads / tokens)
        assert tokens < got.tokens and got.loads_per_token_full != got.loads_per_token  # the drain left out


def test_clients_refuse_arrival_times_and_zero():
    ts = random_traces(4, max_prompt=4, seed=1)
    tok, lengths = decode_tokens(ts), np.ones(4, np.int64)
    with pytest.raises(ValueError, match="clients must be >= 1"):
        random_order().run(tok, lengths, 2, clients=0)
    with pytest.raises(ValueError, match="without arrivals"):
        random_order().run(tok, lengths, 2, clients=2, times=np.zeros(4, np.int64))


def test_decode_profiles_are_the_training_profiles():
    for max_decode in (0, 4):
        ts = random_traces(10, max_prompt=6, max_decode=max_decode, seed=7)
        tok = decode_tokens(ts)
        np.testing.assert_allclose(decode_profiles(tok, ts), profiles(ts), rtol=1e-6)
