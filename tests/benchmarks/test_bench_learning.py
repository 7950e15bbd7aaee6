"""benchmarks.bench_learning on a small decode folder built here: the online learner's curve against the offline head."""

from __future__ import annotations

import numpy as np

from benchmarks.bench_learning import measure_model, observation
from benchmarks.heldout import HeldOut
from moe_cohort.traces.importers import load_traces
from moe_cohort.train.targets import profiles
from tests.conftest import random_traces, write_trace_dir


def _embed(texts):  # [N, 6] a deterministic stand-in for an encoder, per text
    rng = np.random.default_rng([len(t) for t in texts])
    return rng.normal(size=(len(texts), 6)).astype(np.float32)


def test_observations_of_a_trace_are_its_training_targets():
    ts = random_traces(8, num_experts=12, top_k=2, max_prompt=5, max_decode=9, seed=3)
    want = profiles(ts)
    for i in np.flatnonzero(ts.num_decode_tokens):  # (one that generated nothing is observed by its prompt)
        np.testing.assert_allclose(observation(ts, i).profile(), want[i], rtol=1e-6)
    prompt_only = random_traces(8, num_experts=12, top_k=2, max_prompt=9, max_decode=0, seed=4)
    want = profiles(prompt_only)
    for i in range(len(prompt_only)):
        np.testing.assert_allclose(observation(prompt_only, i).profile(), want[i], rtol=1e-6)


def test_the_curve_ends_at_the_offline_head_when_every_training_request_was_observed(tmp_path):
    ts = load_traces(write_trace_dir(tmp_path / "d", random_traces(150, num_experts=12, top_k=2, max_prompt=0,
                                                                  max_decode=9, seed=8), decode=True))
    lines = []
    rows = measure_model(ts, [0, 20, 1000], [4, 16], 2, _embed, report=lines.append)["curve"]
    train = HeldOut.of(ts).train_idx
    assert [r["observed"] for r in rows] == [0, 20, int((profiles(ts)[train].sum(axis=(1, 2)) > 0).sum())]
    for s in (4, 16):
        assert rows[-1][s]["learned"]["saving"] == rows[-1][s]["offline"]["saving"]
    assert any("target: after 400" in line and "all of them" in line for line in lines)
