"""benchmarks.bench_ray_serve: the paired summary, on rows built here."""

from benchmarks.bench_ray_serve import summary


def test_summary_pairs_each_round_with_its_own_default_run():
    rows = [{"router": k, "round": r, "loads_per_token": v, "tokens_per_forward": t, "p50_s": p50, "p99_s": p99,
             "ingress_cpu_ms_per_request": cpu}
            for k, r, v, t, p50, p99, cpu in [("default", 0, 10.0, 8.0, 2.0, 4.0, 5.0), ("ours", 0, 9.0, 12.0, 1.0, 2.0, 5.5),
                                              ("default", 1, 20.0, 10.0, 2.0, 4.0, 5.0), ("ours", 1, 14.0, 14.0, 2.0, 4.0, 5.5)]]
    first, second, overall = summary(rows)
    assert first == "round 0: saving +10.0%, p50 -50.0%, p99 -50.0%, router CPU +0.50 ms per request"
    assert second.startswith("round 1: saving +30.0%, p50 +0.0%, p99 +0.0%")
    assert overall == ("over 2 rounds: saving +20.0% +- 10.0%, p99 -25.0%, router CPU +0.50 +- 0.00 ms per request; "
                       "tokens per forward default 9.00, ours 13.00")
