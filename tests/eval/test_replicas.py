"""moe_cohort.eval.replicas: R replicas behind a router, against a hand computation; the summary rows and the CLI.
(The replay itself against a step-by-step one: tests/eval/test_replay.py; Ray Serve's routings:
tests/benchmarks/test_ray_policies.py.)"""

import json

import numpy as np
import pytest

from moe_cohort.admission.router import ReplicaRouter
from moe_cohort.eval.cost import PRESETS
from moe_cohort.eval.engine import lengths_from_spec
from moe_cohort.eval.policies import Policy, by_profile
from moe_cohort.eval.replay import decode_profiles, decode_tokens, replay
from moe_cohort.eval.replicas import evaluate_replicas, format_replica_table, routings_for
from tests.conftest import random_traces
from tests.helpers.replica_traces import HAND, expert_set_traces


@pytest.mark.parametrize("routing,loads", [
    # rr: replica 0 runs a0 b0 then a2, replica 1 a1 b1 then b2: (4 + 4) x 2 steps + (2 + 2) x 2 = 24
    ("round-robin", 24),
    # one FCFS queue, the emptier replica first: the same pairs as round-robin
    ("least-loaded", 24),
    # seeds a0 and a1 (the oldest), then a2 joins a0 ({0,1,2}: 3) and b0 joins a1 (4): 7 x 2 + (2 + 2) x 2 = 22
    ("affinity", 22),
])
def test_two_replicas_of_two_slots_by_hand(routing, loads):
    ts = expert_set_traces(HAND)
    tok = decode_tokens(ts, "proxy")
    prof = decode_profiles(tok, ts).reshape(len(ts), -1)
    got = Policy(routing, prof).run(tok, np.full(6, 2), [2, 2])
    assert (int(got.loads.sum()), got.tokens, got.makespan, got.violations) == (loads, 12, 4, 0)


def test_round_robin_on_identical_requests_is_least_loaded():
    ts = expert_set_traces([{1, 3}] * 9)
    tok = decode_tokens(ts, "proxy")
    rr, ll = (Policy(name).run(tok, np.full(9, 5), [2, 2]) for name in ("round-robin", "least-loaded"))
    assert (int(rr.loads.sum()), rr.tokens) == (int(ll.loads.sum()), ll.tokens)
    assert rr.replica.tolist() == ll.replica.tolist()


def test_round_robin_can_idle_a_replica_and_a_shared_pool_may_not():
    ts = expert_set_traces(HAND)
    tok = decode_tokens(ts, "proxy")
    lengths = np.array([1, 9, 1, 9, 1, 9])  # replica 0 gets the short ones and runs dry while replica 1 queues
    assert Policy("round-robin").run(tok, lengths, [1, 1]).violations > 0
    assert Policy("least-loaded").run(tok, lengths, [1, 1]).violations == 0

    class Stuck(ReplicaRouter):  # replica 1 never admits: the replay must refuse the run
        def _has_candidate(self, r):
            return r == 0 and super()._has_candidate(r)

    with pytest.raises(RuntimeError, match="free slot while requests waited"):
        replay(tok, lengths, Stuck([1, 1], "least-loaded"))


def test_evaluate_replicas_rows():
    ts = random_traces(24, max_prompt=6, seed=2)
    tok = decode_tokens(ts)
    prof = decode_profiles(tok, ts).reshape(len(ts), -1)
    routings = {"round-robin": Policy("round-robin"), "least-loaded": Policy("least-loaded"),
                "affinity-reference": by_profile(prof)}
    out = evaluate_replicas(tok, 2, 3, routings, lengths_from_spec("lognormal", ts.request_ids, mean=6),
                            PRESETS["deepseek-v2-lite"], ts.num_layers, seeds=2)
    rows = out["plans"]
    assert list(rows) == ["random", "round-robin", "least-loaded", "affinity-reference"]
    assert rows["random"]["saving"] == 0.0 and rows["affinity-reference"]["capture"] == pytest.approx(1.0)
    assert rows["least-loaded"]["violations"] == rows["affinity-reference"]["violations"] == 0
    assert all(r["step_us_per_token"] > r["moe_us_per_token"] > 0 for r in rows.values())
    assert "idle-while-queued" in format_replica_table(out)


def test_evaluate_replicas_kept_full():
    ts = random_traces(24, max_prompt=6, seed=2)
    tok = decode_tokens(ts)
    routings = routings_for("round-robin,least-loaded")
    assert list(routings) == ["round-robin", "least-loaded"]
    lengths = lengths_from_spec("lognormal", ts.request_ids, mean=6)
    args = (tok, 2, 3, routings, lengths, PRESETS["deepseek-v2-lite"], ts.num_layers)
    full, every = evaluate_replicas(*args, seeds=2, kept_full=True), evaluate_replicas(*args, seeds=2)
    assert full["kept_full"] and not every["kept_full"]
    for name, row in full["plans"].items():  # the all-steps figures are the plain run's
        assert row["all_steps"]["loads_per_token"] == pytest.approx(every["plans"][name]["loads_per_token"])
        assert row["all_steps"]["saving"] == pytest.approx(every["plans"][name]["saving"])
    assert any(full["plans"][n]["loads_per_token"] != every["plans"][n]["loads_per_token"] for n in routings)
    assert all(0 < row["full_share"] < 1 for row in full["plans"].values())
    runs = [routings["least-loaded"].run(tok, lengths(seed), [3, 3], seed) for seed in range(2)]
    by_hand = np.mean([sum(int(s * k) for s, k, f in zip(r.steps, r.resident, r.full) if f) / r.tokens for r in runs])
    assert full["plans"]["least-loaded"]["full_share"] == pytest.approx(by_hand)
    assert "all-steps" in format_replica_table(full) and "all-steps" not in format_replica_table(every)


def test_cohort_replay_replicas_json_and_table(tmp_path, capsys):
    from moe_cohort.cli import main
    from moe_cohort.traces.format import save_traces
    from moe_cohort.traces.synthetic import synthetic_traces

    path = save_traces(tmp_path / "s.npz", synthetic_traces(60, num_experts=16, num_layers=3, top_k=2, seed=1))
    base = ["replay", "--traces", str(path), "--slots", "3", "--replicas", "2", "--encoder", "none", "--mean-length", "6",
            "--seeds", "2"]
    assert main([*base, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["replicas"], out["slots"], out["num_requests"]) == (2, 3, 60)
    assert list(out["plans"]) == ["random", "round-robin", "least-loaded", "affinity-reference", "single-reference (1x6)"]
    assert out["plans"]["affinity-reference"]["saving"] > 0 and out["plans"]["affinity-reference"]["violations"] == 0
    assert main([*base, "--replica-routing", "least-loaded"]) == 0
    table = capsys.readouterr().out
    assert "R = 2 replicas x S = 3 slots" in table and "least-loaded" in table and "round-robin" not in table


@pytest.mark.parametrize("extra, flag", [(["--replicas", "0"], "--replicas"), (["--replica-routing", "hash"], "--replica-routing"),
                                         (["--replicas", "2", "--report", "{tmp}/r"], "--report")])
def test_cohort_replay_replicas_rejects_bad_arguments_in_one_line(tmp_path, capsys, extra, flag):
    from moe_cohort.cli import main
    from moe_cohort.traces.format import save_traces

    path = save_traces(tmp_path / "t.npz", random_traces(10, seed=1))
    args = ["replay", "--traces", str(path), "--encoder", "none",
            *[a.replace("{tmp}", str(tmp_path)) for a in extra]]
    try:
        code = main(args)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    assert (code, out) == (2, "") and len(err.strip().splitlines()) == 1 and flag in err, err


def test_arrival_times_go_to_the_requests_in_arrival_order():
    ts = random_traces(12, max_prompt=6, seed=5)
    tok, times = decode_tokens(ts), np.arange(0, 24, 2)
    for routing in (Policy("least-loaded", shuffle=True), Policy("least-loaded")):
        got = routing.run(tok, np.full(12, 3), [12, 12], seed=7, times=times)  # room for all: nobody waits
        order = np.random.default_rng(7).permutation(12) if routing.shuffle else np.arange(12)
        assert got.start[order].tolist() == times.tolist()
