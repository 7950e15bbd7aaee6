"""benchmarks.bench_refit --service: the learning worker's CPU per request, window by window."""

from __future__ import annotations

from benchmarks.bench_refit import time_service


def test_the_service_rows_split_each_window_into_its_parts():
    texts = [f"prompt {i} about topic {i % 7} and more words" for i in range(60)]
    rows = time_service(300, 2, 8, 2, texts, window=100)
    assert [r["requests"] for r in rows] == [100, 200, 300]
    # every request kept while the reservoir grows: the first head after 16, then every refit_every (50)
    assert [r["refits"] for r in rows] == [2, 4, 6]
    for r in rows:
        assert min(r["observe"], r["refit"], r["save"]) >= 0
        assert abs(r["all"] - (r["observe"] + r["refit"] + r["save"])) < 1e-6
    assert rows[0]["refit"] > 0 and rows[0]["save"] > 0


def test_a_window_counts_only_its_own_refits():
    texts = [f"prompt {i} about topic {i % 7} and more words" for i in range(60)]
    rows = time_service(80, 2, 8, 2, texts, window=10)  # refits at requests 16 and 66
    before = [0] + [r["refits"] for r in rows[:-1]]
    assert [r["refits"] - b for r, b in zip(rows, before)] == [0, 1, 0, 0, 0, 0, 1, 0]
    assert [r["refit"] > 0 for r in rows] == [r["refits"] > b for r, b in zip(rows, before)]
