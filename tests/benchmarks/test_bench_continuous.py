"""benchmarks.bench_continuous on a small decode folder built here: held-out requests replayed with their own
generated tokens and lengths, as `cohort replay` replays them, the targets and the learning curve."""

from __future__ import annotations

import json

import numpy as np

from benchmarks.bench_continuous import measure_model
from benchmarks.heldout import HeldOut
from moe_cohort.cli import main
from moe_cohort.traces.format import save_traces
from moe_cohort.traces.importers import load_traces
from tests.conftest import random_traces, write_trace_dir


def _embed(texts, encoder):  # [N, 6] a deterministic stand-in for an encoder, per text
    rng = np.random.default_rng([len(t) for t in texts])
    return rng.normal(size=(len(texts), 6)).astype(np.float32)


def test_a_decode_folder_is_measured_on_its_heldout_generated_tokens_as_cohort_replay_does(tmp_path, capsys):
    ts = random_traces(60, num_experts=12, top_k=2, max_prompt=0, max_decode=9, seed=8)
    ts = load_traces(write_trace_dir(tmp_path / "d", ts, decode=True))
    lines = []
    got = measure_model(ts, ["static"], [4], 2, _embed, curve=[10], report=lines.append)
    (result,) = got["results"]
    held = HeldOut.of(ts).held
    assert result["decode_mode"] == "real" and result["num_requests"] == len(held)
    assert {"random", "arrival", "plan", "text-nearest-static", "text-profile-static", "reference"} == set(result["plans"])
    assert main(["replay", "--traces", str(save_traces(tmp_path / "held.npz", held)), "--slots", "4", "--seeds", "2",
                 "--encoder", "none", "--no-kept-full", "--json"]) == 0
    replayed = json.loads(capsys.readouterr().out)["plans"]
    for name in ("random", "arrival"):  # same requests, tokens, lengths and seeds (the bench shuffles the reference's ties)
        assert result["plans"][name]["loads_per_token"] == replayed[name]["loads_per_token"]
    (target,) = got["targets"]
    assert target["slots"] == 4 and target["best"].startswith("text-") and target["reached"] is None
    assert [row["train_prompts"] for row in got["learning_curve"]] == [10, len(HeldOut.of(ts).train_idx)]
    assert any("learning curve" in line for line in lines)
