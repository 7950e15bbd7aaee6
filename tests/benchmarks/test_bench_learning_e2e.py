"""benchmarks.bench_learning_e2e's rounds: each held-out run is compared with the fcfs run of its own round."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks.bench_learning_e2e import FCFS_HELD, OFFLINE_HELD, savings, summary
from benchmarks.bench_replay_vs_engine import print_engine

LEARNING = "learning, held-out after 800"


def _rows() -> list[dict]:
    """Two rounds in which the engine drifted: round 1's fcfs loads 20% more than round 0's, and so do the others."""
    out = []
    for r, drift in enumerate((1.0, 1.2)):
        out += [{"run": FCFS_HELD, "round": r, "loads_per_token": 4.0 * drift, "tokens_per_forward": 15.0},
                {"run": LEARNING, "round": r, "loads_per_token": 3.0 * drift, "tokens_per_forward": 14.0 + r},
                {"run": OFFLINE_HELD, "round": r, "loads_per_token": (2.8 + 0.2 * r) * drift,
                 "tokens_per_forward": 14.5}]
    return out


def test_each_round_is_taken_against_its_own_fcfs():
    rows = _rows()
    assert savings(rows, LEARNING) == pytest.approx([0.25, 0.25])  # the drift cancels within a round
    assert savings(rows, OFFLINE_HELD) == pytest.approx([0.3, 0.25])
    assert savings(rows, FCFS_HELD) == pytest.approx([0.0, 0.0])


def test_the_summary_gives_mean_and_spread_over_rounds():
    line = summary("engine", _rows(), LEARNING)
    assert "over 2 rounds" in line
    assert "learning +25.0% +- 0.0% (14.50 tokens per forward)" in line
    assert "offline head +27.5% +- 2.5% (14.50 tokens per forward)" in line
    assert "fcfs 15.00 tokens per forward" in line


def test_the_replay_prints_the_engine_rows_of_either_format(tmp_path, capsys):
    path = tmp_path / "e2e.json"
    old = [{k: v for k, v in row.items() if k != "round"} for row in _rows()[:3]]  # one run each, no rounds
    path.write_text(json.dumps({"engine": _rows(), "proxy": old}))
    print_engine(str(path))
    out = capsys.readouterr().out
    learning = next(line for line in out.splitlines() if line.startswith(LEARNING))
    assert f"{np.mean([3.0, 3.6]):.3f}" in learning and "+25.0% +- 0.0% over 2 rounds" in learning
    assert "+25.0%   14.00 decode tokens per forward" in out  # the old format: one run, no spread
