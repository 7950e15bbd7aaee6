"""benchmarks.bench_levers_e2e: the fidelity measure and the summary, on rows built here."""

import math

from benchmarks.bench_levers_e2e import identical_share, summary


def test_identical_share_counts_equal_tokens_position_by_position_over_shared_prompts():
    reference = {0: [1, 2, 3, 4], 1: [5, 6], 2: [7]}
    got = {0: [1, 9, 3, 4], 1: [6, 5], 3: [7]}  # prompt 2 missing, prompt 3 not in the reference
    assert identical_share(reference, got) == 3 / 6
    assert identical_share(reference, reference) == 1.0
    assert math.isnan(identical_share(reference, {}))


def test_summary_takes_savings_against_the_same_rounds_fcfs():
    rows = [{"policy": p, "kind": k, "round": r, "loads_per_token": v, "identical": i}
            for p, k, r, v, i in [("topk", "fcfs", 0, 10.0, 1.0), ("topk", "admission", 0, 9.0, 1.0),
                                  ("topk", "fcfs", 1, 20.0, 1.0), ("topk", "admission", 1, 18.0, 1.0),
                                  ("xs", "fcfs", 0, 5.0, 0.8), ("xs", "admission", 0, 4.0, 0.9),
                                  ("xs", "fcfs", 1, 10.0, 0.8), ("xs", "admission", 1, 8.0, 0.9)]]
    topk, xs = summary(rows)
    assert "admission vs fcfs, same policy: +10.0% +- 0.0%" in topk
    assert "fcfs  7.500 (+50.0% vs fcfs topk; 80.0% as topk)" in xs
    assert "admission  6.000 (+60.0% vs fcfs topk; 90.0% as topk)" in xs
    assert "admission vs fcfs, same policy: +20.0% +- 0.0%" in xs
