"""benchmarks.bench_replicas on small trace folders built here: every routing's row, kept full with all steps
beside, and the paired savings against a computation from the rows' own loads per token."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.bench_replicas import AGAINST, PAIRED, measure_model, paired, poisson_arrivals
from benchmarks.heldout import HeldOut
from moe_cohort.traces.importers import load_traces
from tests.conftest import random_traces, write_trace_dir


def _embed(texts, encoder):  # [N, 6] a deterministic stand-in for an encoder, per text
    rng = np.random.default_rng([len(t) for t in texts])
    return rng.normal(size=(len(texts), 6)).astype(np.float32)


@pytest.mark.parametrize("decode", [False, True])
def test_every_routing_is_replayed_on_the_heldout_side_and_compared_seed_by_seed(tmp_path, decode):
    ts = random_traces(80, num_experts=12, top_k=2, max_prompt=0 if decode else 8, max_decode=9 if decode else 0, seed=3)
    ts = load_traces(write_trace_dir(tmp_path / "t", ts, decode=decode))
    lines = []
    results = measure_model(ts, None, [2, 3], [2], 2, [0], embed=_embed, report=lines.append)
    held = HeldOut.of(ts).held
    assert [(r["replicas"], r["slots"], r["num_requests"], r["kept_full"]) for r in results] == [(2, 2, len(held), True),
                                                                                                (3, 2, len(held), True)]
    for r in results:
        rows = r["plans"]
        assert list(rows) == ["random", "round-robin", "power-of-two", "prefix", "least-loaded", "round-robin+inside",
                              "power-of-two+inside", "prefix+inside", "affinity", "affinity-reference"]
        assert r["decode_mode"] == ("real" if decode else "proxy")
        assert rows["least-loaded"]["violations"] == rows["affinity"]["violations"] == 0
        for key, source in (("against", rows), ("against_all_steps", {k: v["all_steps"] for k, v in rows.items()})):
            for name in PAIRED:
                for other in AGAINST:
                    by_hand = [1 - (1 - a) / (1 - b) for a, b in zip(source[name]["saving_per_seed"],
                                                                    source[other]["saving_per_seed"])]
                    assert r[key][name][other][0] == pytest.approx(np.mean(by_hand)), (key, name, other)
    (one,) = measure_model(ts, None, [2], [2], 1, [0], embed=_embed, report=lines.append)  # one seed: the rows' ratio
    for name in PAIRED:
        for other in AGAINST:
            for key, rows in (("against", one["plans"]), ("against_all_steps", {k: v["all_steps"] for k, v in
                                                                                 one["plans"].items()})):
                want = 1 - rows[name]["loads_per_token"] / rows[other]["loads_per_token"]
                assert one[key][name][other] == (pytest.approx(want), 0.0), (key, name, other)
    assert paired(one["plans"]) == one["against"]
    lognormal = measure_model(ts, None, [2], [2], 1, [0], embed=_embed, length_spec="lognormal:0", report=lines.append)
    assert lognormal[0]["plans"]["least-loaded"]["makespan"] == 64 * -(-len(held) // 4)  # 64 tokens each, 4 at a time
    text = "\n".join(lines)
    assert "vs power-of-two" in text and "idle-while-queued steps: round-robin" in text and "all steps;" in text


def test_more_slots_than_requests_leaves_nothing_kept_full_and_says_so(tmp_path):
    ts = load_traces(write_trace_dir(tmp_path / "t", random_traces(40, num_experts=12, top_k=2, seed=4)))
    lines = []
    (result,) = measure_model(ts, None, [len(HeldOut.of(ts).held)], [2], 2, [0], embed=_embed, report=lines.append)
    rows = result["plans"]
    assert rows["least-loaded"]["full_share"] == 0 and np.isnan(result["against"]["affinity"]["least-loaded"][0])
    assert all(np.isfinite(r["all_steps"]["saving"]) and r["step_us_per_token"] == r["step_us_per_token"] for r in
               (rows["random"], rows["round-robin"]))  # the all-steps figures and the non-MoE time stay defined
    text = "\n".join(lines)
    assert "n/a" in text and "nan" not in text


def test_poisson_arrivals_are_sorted_steps_from_zero_at_the_mean_gap():
    times = poisson_arrivals(400, 0.5, seed=3)
    assert times[0] == 0 and (np.diff(times) >= 0).all() and abs(times[-1] / 399 - 2.0) < 0.3  # mean gap 1 / rate
