"""benchmarks.bench_batch_replay: the learned-first schedule against a simulation written from its statement, and the
benchmark on small folders built here."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.bench_batch_replay import FILE, OFFLINE, learned_first, measure_model, seed_orders
from moe_cohort.eval.engine import REFERENCE
from moe_cohort.eval.replay import decode_tokens
from moe_cohort.traces.importers import load_traces
from tests.conftest import random_traces, write_trace_dir


def _embed(texts):  # [N, 6] a deterministic stand-in for an encoder, per text
    rng = np.random.default_rng([len(t) for t in texts])
    return rng.normal(size=(len(texts), 6)).astype(np.float32)


class FakeLearner:
    """Predicts tables[v] [m, P] with v the refits so far - 1 (the last table beyond); a refit is due once `first`
    keys were observed, then after every `every` more (as LearnConfig's first_fit and refit_every)."""

    def __init__(self, tables, first, every):
        self.tables, self.first, self.every = tables, first, every
        self.seen, self.fits = [], []  # keys observed, in order; how many had been observed at each refit

    def observe(self, key):
        self.seen.append(key)

    def due(self):
        return len(self.seen) - (self.fits[-1] if self.fits else 0) >= (self.every if self.fits else self.first)

    def refit(self):
        self.fits.append(len(self.seen))

    def predict(self):
        return self.tables[min(len(self.fits), len(self.tables)) - 1]


def brute_force(lengths, perm, n, tables, first, every, slots, refits=True):
    """The schedule with FakeLearner's head, written from its statement: (keys in admission order, admission step
    per key, switch step, finish step per key, observations at each refit). FCFS in `perm` until n keys have
    finished, then (refit unless the last refit saw every observation) the waiting key of fewest expected new
    experts against the residents' vectors (each expert idle with prob. prod_r (1 - u_r)), ties to the earliest in
    `perm`; residents hold the vector they had when admitted (or at the switch); every finished key is observed
    (after the switch only with `refits`) and a due refit gives the waiting keys the new table's vectors."""
    waiting, resident, held = [int(k) for k in perm], {}, {}
    order, start, finish, switched, step = [], {}, {}, None, 0
    observed, fits, current = 0, [], None

    def refit():
        nonlocal current
        fits.append(observed)
        current = tables[min(len(fits), len(tables)) - 1]

    while waiting or resident:
        if switched is None and len(finish) >= n:
            if not fits or fits[-1] != observed:
                refit()
            held = {r: current[r] for r in resident}
            switched = step
        while len(resident) < slots and waiting:
            key = waiting[0]
            if switched is not None and resident:
                idle = np.prod([1.0 - np.clip(held[r], 0.0, 1.0 - 1e-3) for r in resident], axis=0)  # [P]
                costs = [float(current[c] @ idle) for c in waiting]
                key = waiting[int(np.argmin(costs))]  # the first of the lowest: the earliest in perm
            waiting.remove(key)
            resident[key], start[key] = int(lengths[key]), step
            held[key] = current[key] if switched is not None else None
            order.append(key)
        step += 1
        for key in list(resident):
            resident[key] -= 1
            if resident[key] == 0:
                del resident[key], held[key]
                finish[key] = step
                if switched is None or refits:
                    observed += 1
                    if observed - (fits[-1] if fits else 0) >= (every if fits else first):
                        refit()
    return order, start, switched, finish, fits


def _case(seed, m=24):
    ts = random_traces(m, num_experts=8, num_layers=2, top_k=2, max_prompt=0, max_decode=6, seed=seed)
    rng = np.random.default_rng([seed, 1])
    return decode_tokens(ts), rng.integers(1, 10, m), rng.permutation(m)  # tokens, lengths [m], perm [m]


def _check(seed, slots, n, tables, first=10**9, every=10**9, refits=True):
    """learned_first against brute_force on 24 lines of lengths 1..9 in a seeded permutation; the replay."""
    tokens, lengths, perm = _case(seed, len(tables[0]))
    learner = FakeLearner(tables, first, every)
    got = learned_first(tokens, lengths, slots, perm, n, learner, refits=refits)
    order, start, switched, finish, fits = brute_force(lengths, perm, n, tables, first, every, slots, refits)
    assert got.replay.order.tolist() == order
    assert got.replay.start.tolist() == [start[k] for k in range(len(perm))]
    assert got.switched == switched
    assert sum(f < switched for f in finish.values()) < n <= sum(f <= switched for f in finish.values())  # at once
    before = [k for k in order if start[k] < switched]
    assert before == perm[:len(before)].tolist()  # the permutation, first come first served, until the switch
    assert [finish[k] for k in learner.seen] == sorted(finish[k] for k in learner.seen)  # observed in finish order
    assert learner.fits == fits
    by_switch = sum(f <= switched for f in finish.values())  # observed when the head took over
    assert got.refits == sum(f > by_switch for f in fits)
    if refits:
        assert sorted(learner.seen) == list(range(len(perm)))  # every request observed, the sample's and the rest
    else:
        assert len(learner.seen) == by_switch  # the learner stops at the switch
    return got, finish


@pytest.mark.parametrize("seed, slots, n", [(0, 3, 5), (1, 4, 4), (2, 2, 7), (3, 5, 12), (4, 3, 2)])
def test_the_schedule_is_the_permutation_until_n_finished_then_the_fewest_new_experts(seed, slots, n):
    vectors = np.random.default_rng(seed).random((24, 16)).astype(np.float32) * 0.9  # [m, P] predicted profiles
    got, finish = _check(seed, slots, n, [vectors])
    assert got.replay.order.tolist() != _case(seed)[2].tolist()  # the fit changed the order (else: tests nothing)
    _check(seed, slots, n, [vectors], first=3, every=4)  # refits due before and after the switch: same predictions


@pytest.mark.parametrize("seed, slots, n", [(5, 3, 5), (6, 4, 6)])
def test_ties_go_to_the_earliest_line_of_the_permutation(seed, slots, n):
    # one expert each, of 16, so lines that share it cost exactly the same in float32 whatever the summation order
    # (the pool's costs are float32 products, in which equal rows elsewhere may differ in the last bit)
    vectors = np.zeros((24, 16), np.float32)  # [m, P]
    vectors[np.arange(24), np.random.default_rng(seed).integers(0, 6, 24)] = 0.5
    _check(seed, slots, n, [vectors])


@pytest.mark.parametrize("seed, slots, n", [(7, 3, 4), (8, 4, 6), (9, 2, 3)])
def test_a_refit_after_the_switch_predicts_the_waiting_lines_again(seed, slots, n):
    # every head predicts differently: admissions after a refit follow the new head's predictions of the waiting
    # lines, the residents keep theirs; without refits the switch's head admits to the end
    tables = np.random.default_rng(seed).random((12, 24, 16)).astype(np.float32) * 0.9  # [heads, m, P]
    got, finish = _check(seed, slots, n, tables, first=2, every=3)
    frozen, _ = _check(seed, slots, n, tables, first=2, every=3, refits=False)
    assert got.refits > 0 and frozen.refits == 0
    # the same admissions until the first refit after the switch, other ones after it
    seen_by_switch = sum(f <= got.switched for f in finish.values())
    refit_step = sorted(finish.values())[seen_by_switch + 2]  # the third observation after the switch: due
    same = [k for k in got.replay.order if got.replay.start[k] < refit_step]
    assert frozen.replay.order.tolist()[: len(same)] == same
    assert got.replay.order.tolist() != frozen.replay.order.tolist()


@pytest.mark.parametrize("decode", [True, False])
def test_the_benchmark_measures_every_row_against_file_order(tmp_path, decode):
    ts = random_traces(300, num_experts=12, top_k=2, max_prompt=0 if decode else 9, max_decode=9 if decode else 0,
                       seed=8)
    ts = load_traces(write_trace_dir(tmp_path / "d", ts, decode=decode))
    lines = []
    got = measure_model(ts, [4, 16], [5, 10, 1000], 2, _embed, report=lines.append)
    assert got["heldout"] == 60 and got["samples"] == [5, 10]
    assert got["decode_mode"] == ("real" if decode else "proxy")
    for at in got["by_slots"]:
        rows = at["rows"]
        assert list(rows) == [FILE, "learned-first 5", "learned-first 10", "learned-first 5, no refits", OFFLINE,
                              REFERENCE, "plan up front"]
        for metric in ("all", "full"):
            assert rows[FILE][metric]["saving"] == 0.0 and len(rows[OFFLINE][metric]["per_seed"]) == 2
            assert all(np.isfinite(row[metric]["saving"]) for row in rows.values())
        assert 0.0 < rows["learned-first 5"]["switch_share"] <= 1.0
        # the head of the switch at 5 saw 5 or a few more; the learner's next is due 50 observations later (of 60)
        assert rows["learned-first 5"]["refits_after_switch"] >= 1.0
        assert rows["learned-first 5, no refits"]["refits_after_switch"] == 0.0
    assert "target" not in got["by_slots"][0] and set(got["by_slots"][1]["target"]) == {5, 10}
    assert sum("target: learned-first" in line for line in lines) == 2
    assert any("skipped" in line and "1000" in line for line in lines)


def test_the_file_order_and_the_runners_permutation_differ_per_seed():
    file, perm = seed_orders(50, 3)
    assert sorted(file.tolist()) == sorted(perm.tolist()) == list(range(50))
    assert file.tolist() != perm.tolist() and seed_orders(50, 4)[0].tolist() != file.tolist()


def test_the_plan_up_front_is_the_batch_runners_admission_plan(tmp_path):
    """(b)'s plan: greedy admission by the profiles if requests finish in the order sent, as the runner's
    admission_plan (batch/order.py) plans a --dry-run; its w-window mix keeps every line once."""
    import json

    from benchmarks.bench_batch_replay import PLAN, mixed, planned, replay_seed
    from moe_cohort.admission.resident import ResidentExperts
    from moe_cohort.admission.wire import Prediction
    from moe_cohort.batch.format import read_batch_file
    from moe_cohort.batch.order import admission_plan
    from moe_cohort.send.profiles import Predictor

    rng = np.random.default_rng(3)
    profiles = (rng.random((14, 12)) < 0.3).astype(np.float32)  # [N, L*E] = [14, 2*6]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                                        "body": {"model": "m", "prompt": f"p{i}"}}) + "\n" for i in range(14)))
    requests = read_batch_file(path, default_policy="topk", max_line_bytes=10_000).requests
    predictor = Predictor(lambda texts: [Prediction(profiles[int(t[1:])]) for t in texts],
                          lambda size: ResidentExperts(1, size), "profile")
    runner = [r.line - 1 for r in admission_plan(requests, predictor, 3)[0]]
    assert planned(profiles, np.arange(14), 3).tolist() == runner
    traces = random_traces(14, num_experts=6, num_layers=2, max_decode=5)
    tokens = decode_tokens(traces)
    lengths = np.full(14, 4)
    runs = replay_seed(tokens, lengths, 3, 0, [], {OFFLINE: profiles}, lambda: None, windows=[2])
    for name in (PLAN, mixed(2)):
        assert sorted(runs[name].replay.order.tolist()) == list(range(14))
