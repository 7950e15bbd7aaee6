"""benchmarks.bench_expert_counts: one line per shape and number of requests, the counts it times being real."""

from __future__ import annotations

import re

from benchmarks.bench_expert_counts import main, per_step_us


def test_prints_the_cost_per_forward_for_every_shape_and_number_of_requests(capsys):
    main(["--shapes", "2x8x2,3x16x4", "--requests", "1,5", "--steps", "3"])
    lines = capsys.readouterr().out.splitlines()
    assert [re.match(r"(\d+) layers x (\d+) experts, top-(\d+): +(\d+) observed", line).groups() for line in lines] == [
        ("2", "8", "2", "1"), ("2", "8", "2", "5"), ("3", "16", "4", "1"), ("3", "16", "4", "5")]
    assert all(float(line.split()[-4]) >= 0 for line in lines)


def test_times_a_nonzero_amount_of_counting():
    assert per_step_us(2, 8, 2, 4, steps=5) > 0
