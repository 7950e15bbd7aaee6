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
