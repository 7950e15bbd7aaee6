"""moe_cohort.embedded.placement: vLLM on all cores but one, our side on that one (with its SMT siblings), never
a core shared; the guard starts vLLM on the CPUs it is given."""

import itertools
import os
import subprocess
import sys
import threading

import pytest

from moe_cohort.embedded.placement import cpu_list, move_process, split_cpus


def test_cpu_list_of_a_linux_cpu_list():
    assert cpu_list("0-3,6\n") == {0, 1, 2, 3, 6} and cpu_list("5") == {5}


def _pairs(cores: int):
    """SMT-2 siblings as Linux numbers them: physical core k holds CPUs k and k + cores."""
    return lambda cpu: {cpu % cores, cpu % cores + cores}


def _brute_force(allowed: set[int], siblings) -> tuple[set[int], set[int]] | None:
    """Our side: the physical core of the highest CPU, as far as allowed; the engine: every other CPU."""
    cores = {frozenset(siblings(c) & allowed) for c in allowed}
    last = next(core for core in cores if max(allowed) in core)
    engine = set().union(*(core for core in cores if core != last))
    return (engine, set(last)) if engine else None


@pytest.mark.parametrize("cores", [1, 2, 3])
def test_the_split_matches_a_brute_force_reference_on_every_subset_of_small_machines(cores):
    siblings = _pairs(cores)
    for n in range(1, 2 * cores + 1):
        for allowed in map(set, itertools.combinations(range(2 * cores), n)):
            placement = split_cpus(allowed, siblings)
            expected = _brute_force(allowed, siblings)
            got = placement and (set(placement.engine), set(placement.ours))
            assert got == expected, allowed
            if placement:
                assert placement.engine | placement.ours == allowed and not placement.engine & placement.ours


def test_a_machine_without_smt_gives_our_side_its_last_cpu():
    placement = split_cpus({0, 1, 2, 3}, lambda cpu: {cpu})
    assert placement.engine == {0, 1, 2} and placement.ours == {3}
    assert split_cpus({7}, lambda cpu: {cpu}) is None  # one core: nothing to split


def test_moving_a_process_moves_the_threads_it_already_runs():
    before = os.sched_getaffinity(0)
    if len(before) < 2:
        pytest.skip("one CPU: nowhere to move")
    target = {min(before)}
    started, stop = threading.Event(), threading.Event()
    worker = threading.Thread(target=lambda: (started.set(), stop.wait()))
    worker.start()
    started.wait()
    try:
        move_process(target)
        assert os.sched_getaffinity(0) == target and os.sched_getaffinity(worker.native_id) == target
    finally:
        stop.set()
        worker.join()
        move_process(before)


@pytest.mark.integration
def test_the_guard_starts_its_command_and_what_that_starts_on_the_cpus_given():
    allowed = os.sched_getaffinity(0)
    target = {max(allowed)}
    child = "import os, subprocess, sys; print(sorted(os.sched_getaffinity(0))); sys.stdout.flush(); " \
            "subprocess.run([sys.executable, '-c', 'import os; print(sorted(os.sched_getaffinity(0)))'])"
    out = subprocess.run([sys.executable, "-m", "moe_cohort.embedded.vllm_guard", str(os.getpid()), "--cpus",
                          str(max(allowed)), sys.executable, "-c", child], capture_output=True, text=True, timeout=60,
                         start_new_session=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == [str(sorted(target))] * 2
    assert os.sched_getaffinity(0) == allowed  # the caller stays where it was
