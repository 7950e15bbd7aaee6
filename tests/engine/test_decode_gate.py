"""DecodeGate: at most `slots` decode, a free slot never idles while a prefilled request waits, and the held
request admitted is the one a brute-force count of expected new experts prefers (no vLLM needed)."""

import random
from types import SimpleNamespace

import numpy as np
import pytest

from moe_cohort.engine.decode_gate import DecodeGate, prefilled

L, E = 2, 6


def request(rid, arrival, prompt=4):
    return SimpleNamespace(request_id=rid, arrival_time=arrival, num_prompt_tokens=prompt, num_computed_tokens=0,
                           num_tokens=prompt)


def run_prefill(r):
    r.num_computed_tokens, r.num_tokens = r.num_prompt_tokens, r.num_prompt_tokens + 1  # its first token sampled


def brute_force_cost(candidate, decoding):
    """Expected new experts per step, term by term: sum_{l,e} u_c * prod_r (1 - u_r)."""
    total = 0.0
    for layer in range(L):
        for e in range(E):
            idle = 1.0
            for u in decoding:
                idle *= 1.0 - min(u[layer, e], 0.999)
            total += candidate[layer, e] * idle
    return total


def test_prefilled_means_only_the_last_sampled_token_is_left_to_compute():
    r = request("a", 0.0, prompt=5)
    assert not prefilled(r)
    r.num_computed_tokens = 3
    assert not prefilled(r)  # a chunk of its prefill ran
    run_prefill(r)
    assert prefilled(r)
    r.num_computed_tokens, r.num_tokens = 0, 9  # preempted after 3 generated tokens: recompute first
    assert not prefilled(r)
    r.num_computed_tokens = 8
    assert prefilled(r)


@pytest.mark.parametrize("seed", range(8))
def test_a_simulated_engine_decodes_at_most_slots_never_idles_and_admits_the_best_fit(seed):
    rng, prng = random.Random(seed), np.random.default_rng(seed)
    slots, ahead = 3, 3
    profiles = {}
    gate = DecodeGate(slots, clock=lambda: 0.0)  # no fairness bound: the rule alone
    waiting = [request(f"r{i}", float(i)) for i in range(20)]
    running, left = [], {f"r{i}": rng.randint(1, 6) for i in range(20)}
    for _ in range(200):
        while waiting and len(running) < slots + ahead:  # vLLM admits into RUNNING up to the runner's slots
            running.append(waiting.pop(0))
        alive = {r.request_id for r in running}
        decoding_before = [profiles[rid] for rid in gate.decoding if rid in alive]
        held_before = [r for r in running if prefilled(r) and r.request_id not in gate.decoding]
        admitted, held = gate.step(running)
        assert len(gate.decoding) <= slots
        assert not held or len(gate.decoding) == slots  # work-conserving
        if admitted and decoding_before and len(held_before) > 1 and admitted[0] in held_before:
            costs = {r.request_id: brute_force_cost(profiles[r.request_id], decoding_before) for r in held_before}
            assert costs[admitted[0].request_id] <= min(costs.values()) + 1e-6
        routed = {}
        for r in running:  # one step: prefills run (and are routed), decoders emit a token
            if r.request_id in gate.decoding:
                left[r.request_id] -= 1
            elif not prefilled(r):
                run_prefill(r)
                profiles[r.request_id] = prng.random((L, E)) ** 3
                routed[r.request_id] = profiles[r.request_id]
        gate.routed(routed)
        running = [r for r in running if left[r.request_id] > 0]
        if not running and not waiting:
            break
    assert not running and not waiting
    gate.step([])
    assert not gate.decoding and not gate.held and not gate._routing and gate._resident.count == 0


def test_a_held_request_without_routing_goes_first_come_first_served_and_the_fallback_stands_in():
    a, b, c = request("a", 0.0), request("b", 1.0), request("c", 2.0)
    fallback = {"c": np.eye(L, E)}
    gate = DecodeGate(1, clock=lambda: 0.0, fallback=lambda r: fallback.get(r.request_id))
    for r in (a, b, c):
        run_prefill(r)
    gate.routed({"a": np.ones((L, E)) / 2})
    admitted, held = gate.step([a, b, c])
    assert [r.request_id for r in admitted] == ["a"] and {r.request_id for r in held} == {"b", "c"}
    assert gate._pool.profiled[gate._pool.rows["c"]] and not gate._pool.profiled[gate._pool.rows["b"]]
    admitted, _ = gate.step([b, c])  # a finished; b has no routing yet and is the oldest: it goes
    assert [r.request_id for r in admitted] == ["b"]


@pytest.mark.parametrize("now, batch, second", [(0.0, False, "near"), (10.0, False, "far"), (10.0, True, "near")])
def test_the_fairness_bound_admits_a_request_that_waited_too_long_before_a_better_fit_unless_a_batch_line(
        now, batch, second):
    gate = DecodeGate(2, max_wait_s=5.0, clock=lambda: now, bounded=lambda request: not batch)
    first, far, near = request("first", 0.0), request("far", 0.5), request("near", 1.0)
    for r in (first, far, near):
        run_prefill(r)
    gate.routed({"first": np.eye(L, E), "far": np.roll(np.eye(L, E), 3, axis=1), "near": np.eye(L, E)})
    admitted, _ = gate.step([first, far, near])
    assert [r.request_id for r in admitted] == ["first", second]  # the best fit, unless `far` is overdue


def test_a_request_that_leaves_running_leaves_the_gate_and_comes_back_held_after_its_recompute():
    a, b = request("a", 0.0), request("b", 1.0)
    gate = DecodeGate(1, clock=lambda: 0.0)
    run_prefill(a), run_prefill(b)
    gate.step([a, b])
    assert set(gate.decoding) == {"a"} and set(gate.held) == {"b"}
    a.num_computed_tokens = 0  # preempted: back to waiting, its KV freed
    admitted, held = gate.step([b])
    assert [r.request_id for r in admitted] == ["b"] and not held and "a" not in gate.decoding
    run_prefill(a)
    admitted, held = gate.step([b, a])
    assert not admitted and [r.request_id for r in held] == ["a"]


def test_a_request_that_asks_for_first_come_first_served_is_admitted_in_arrival_order_despite_its_routing():
    gate = DecodeGate(1, clock=lambda: 0.0, ordered=lambda request: False)
    first, far, near = request("first", 0.0), request("far", 0.5), request("near", 1.0)
    for r in (first, far, near):
        run_prefill(r)
    gate.routed({"first": np.eye(L, E), "far": np.roll(np.eye(L, E), 3, axis=1), "near": np.eye(L, E)})
    order = [r.request_id for r in gate.step([first, far, near])[0]]
    order += [r.request_id for r in gate.step([far, near])[0]]  # first finished
    assert order == ["first", "far"]  # ordered by routing, "near" (like "first") would go before "far"
    assert not gate._pool.profiled[gate._pool.rows["near"]] and gate._resident is None
