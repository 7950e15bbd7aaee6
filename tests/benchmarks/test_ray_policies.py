"""benchmarks.ray_policies: Ray Serve's routings replayed over R replicas, against a hand computation; the
rows of bench_replicas with "+inside" and the summary with kept-full spans."""

import numpy as np
import pytest

from benchmarks.ray_policies import RayPolicy, by_prefix, routings_for
from benchmarks.ray_routers import RayRouter
from moe_cohort.eval.cost import PRESETS
from moe_cohort.eval.engine import lengths_from_spec
from moe_cohort.eval.replay import decode_tokens, replay
from moe_cohort.eval.replicas import evaluate_replicas, format_replica_table
from tests.conftest import random_traces
from tests.helpers.replica_traces import HAND, expert_set_traces

# the a requests share a 64-character opening, the b requests another; only the tail differs
HAND_TEXTS = [("Solve step by step and show the work for this algebra exercise: " if i in (0, 1, 4) else
               "Write a short poem about the sea, the wind and the old lighthouse ") + f"case {i}" for i in range(6)]


def test_power_of_two_on_two_replicas_of_two_slots_by_hand():
    # two replicas: the two drawn are both, so the emptier (resident + queued) on arrival: round-robin's pairs,
    # (4 + 4) x 2 steps + (2 + 2) x 2 = 24 (tests/eval/test_replicas.py)
    ts = expert_set_traces(HAND)
    tok = decode_tokens(ts, "proxy")
    got = RayPolicy("power-of-two").run(tok, np.full(6, 2), [2, 2])
    assert (int(got.loads.sum()), got.tokens, got.makespan, got.violations) == (24, 12, 4, 0)


def test_prefix_routing_by_hand_keeps_each_opening_on_one_replica():
    # a0 opens replica 0 (power-of-two on empty replicas: the lower), a1 matches it; b0 matches nothing and
    # goes to the emptier replica 1, b1 and b2 follow it, a2 follows a0: replica 0 runs {0,1} then {0,2},
    # replica 1 {4,5} then {4,6}: (2 + 2) x 2 steps + (2 + 2) x 2 = 16
    ts = expert_set_traces(HAND)
    tok = decode_tokens(ts, "proxy")
    got = by_prefix(HAND_TEXTS).run(tok, np.full(6, 2), [2, 2])
    assert got.replica.tolist() == [0, 0, 1, 1, 0, 1]
    assert (int(got.loads.sum()), got.tokens, got.makespan, got.violations) == (16, 12, 4, 0)


def test_power_of_two_replays_with_the_runs_seed():
    ts = random_traces(30, max_prompt=6, seed=4)
    tok, lengths = decode_tokens(ts), lengths_from_spec("lognormal", ts.request_ids, mean=6)(0)
    runs = {seed: RayPolicy("power-of-two").run(tok, lengths, [2, 2, 2, 2], seed=seed) for seed in (3, 7)}
    for seed, got in runs.items():
        by_hand = replay(tok, lengths, RayRouter([2] * 4, "power-of-two", rng=np.random.default_rng(seed)))
        assert got.replica.tolist() == by_hand.replica.tolist() and int(got.loads.sum()) == int(by_hand.loads.sum())
    assert runs[3].replica.tolist() != runs[7].replica.tolist()


def test_routings_that_bind_on_arrival_may_idle_a_replica_and_are_reported_not_refused():
    ts = expert_set_traces(HAND)
    tok = decode_tokens(ts, "proxy")
    # power-of-two pairs as round-robin does on two replicas; prefix keeps the a requests (short here) on
    # replica 0, which runs dry while replica 1 queues
    assert RayPolicy("power-of-two").run(tok, np.array([1, 9, 1, 9, 1, 9]), [1, 1]).violations > 0
    assert by_prefix(HAND_TEXTS).run(tok, np.array([1, 1, 9, 9, 1, 9]), [1, 1]).violations > 0


def test_evaluate_replicas_kept_full_with_ray_serve_routings():
    ts = random_traces(24, max_prompt=6, seed=2)
    tok = decode_tokens(ts)
    texts = [f"prompt of kind {i % 3} " * 5 + str(i) for i in range(len(ts))]
    routings = routings_for("power-of-two,prefix,least-loaded", texts=texts)
    assert list(routings) == ["power-of-two", "prefix", "least-loaded"] and routings["prefix"].texts == tuple(texts)
    lengths = lengths_from_spec("lognormal", ts.request_ids, mean=6)
    args = (tok, 2, 3, routings, lengths, PRESETS["deepseek-v2-lite"], ts.num_layers)
    full, every = evaluate_replicas(*args, seeds=2, kept_full=True), evaluate_replicas(*args, seeds=2)
    for name, row in full["plans"].items():  # the all-steps figures are the plain run's
        assert row["all_steps"]["loads_per_token"] == pytest.approx(every["plans"][name]["loads_per_token"])
        assert row["all_steps"]["saving"] == pytest.approx(every["plans"][name]["saving"])
    assert any(full["plans"][n]["loads_per_token"] != every["plans"][n]["loads_per_token"] for n in routings)
    assert all(0 < row["full_share"] < 1 for row in full["plans"].values())
    assert "all-steps" in format_replica_table(full)
    with pytest.raises(ValueError, match="texts"):
        routings_for("prefix")


def test_rows_keep_their_order_with_affinitys_last():
    ts = random_traces(12, max_prompt=6, seed=2)
    predicted = np.random.default_rng(0).random((len(ts), ts.num_layers * ts.num_experts)).astype(np.float32)
    rows = routings_for("round-robin,power-of-two,affinity,least-loaded,round-robin+inside", predicted=predicted,
                        reference=predicted)
    assert list(rows) == ["round-robin", "power-of-two", "least-loaded", "round-robin+inside", "affinity",
                          "affinity-reference"]
    assert type(rows["round-robin"]) is not RayPolicy and type(rows["round-robin+inside"]) is RayPolicy
    assert list(routings_for("all")) == ["round-robin", "least-loaded"]


def test_inside_rows_bind_as_their_routing_and_admit_by_the_predicted_profiles():
    ts = random_traces(24, max_prompt=6, seed=2)
    predicted = np.random.default_rng(0).random((len(ts), ts.num_layers * ts.num_experts)).astype(np.float32)
    routings = routings_for("power-of-two,power-of-two+inside", predicted=predicted)
    plain, inside = routings["power-of-two"], routings["power-of-two+inside"]
    assert inside.inside and not plain.inside and inside.routing == "power-of-two"
    assert inside.vectors.shape == predicted.shape and plain.vectors is None
    tok, lengths = decode_tokens(ts), lengths_from_spec("lognormal", ts.request_ids, mean=6)
    first, second = (p.run(tok, lengths(0), [3, 3], 0) for p in (plain, inside))
    assert first.tokens == second.tokens and not np.array_equal(first.order, second.order)  # other batch mates
    with pytest.raises(ValueError, match="predicted profiles"):
        routings_for("prefix+inside", texts=["a"] * len(ts))
