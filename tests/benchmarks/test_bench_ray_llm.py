"""benchmarks/bench_ray_llm.py: the local Ray it starts holds every actor and task a run asks for."""

from __future__ import annotations

from unittest import mock

from benchmarks import bench_ray_llm


def test_ray_cpus_hold_the_engines_and_every_stage():
    with mock.patch("os.sched_getaffinity", return_value={0, 1}):
        # one engine: its bundle (1), its template and tokenizer actors (0.25 each), pre- and postprocess (0.25 each)
        assert bench_ray_llm.ray_cpus(1) == 2
        assert bench_ray_llm.ray_cpus(2) == 4  # 2 + 4 x 0.25 + 2 x 0.25 = 3.5: three held the preprocess back
        assert bench_ray_llm.ray_cpus(4) == 7
    with mock.patch("os.sched_getaffinity", return_value=set(range(16))):
        assert bench_ray_llm.ray_cpus(2) == 16  # a larger machine: all of it


def test_the_summary_sets_each_run_against_its_own_rounds_plain_run():
    def row(kind, r, loads, wall, first, cpu):
        return {"kind": kind, "round": r, "loads_per_token": loads, "tokens_per_forward": 15.5, "wall_s": wall,
                "first_answer_s": first, "answers_s": wall - first - 1, "cpu_s": cpu, "answered_once": True}

    rows = [row("plain", 0, 10.0, 100.0, 60.0, 5.0), row("cold", 0, 9.0, 110.0, 70.0, 8.0),
            row("warm", 0, 8.0, 90.0, 50.0, 6.0), row("plain", 1, 20.0, 50.0, 30.0, 5.0),
            row("cold", 1, 19.0, 50.0, 30.0, 8.0), row("warm", 1, 16.0, 40.0, 20.0, 6.0)]
    cold, warm = bench_ray_llm.summary(rows)
    assert cold.startswith("cold: +7.5% +- 2.5% (+10.0%, +5.0%) fewer decode loads per generated token than plain")
    assert "wall +10.0%, +0.0% (first answer after 50.0 s against 45.0 s, answering 29.0 s against 29.0 s)" in cold
    assert warm.startswith("warm: +20.0% +- 0.0% (+20.0%, +20.0%)") and "our CPU 6.0 s against 5.0 s" in warm

