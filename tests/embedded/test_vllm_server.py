"""moe_cohort.embedded.vllm_server: a vLLM server that cannot start is reported with its log, and nothing is left
running; the CPUs of vLLM's CPU worker, and moving a process off them."""

import importlib.util
import os

import psutil
import pytest

from moe_cohort.embedded.vllm_server import ServerError, _cpu_list, free_port, start, stay_off_worker_cpus

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")


@pytest.mark.integration
def test_a_server_that_cannot_start_raises_with_its_log(tmp_path):
    model, log_path = tmp_path / "no-such-model", tmp_path / "vllm.log"
    with pytest.raises(ServerError) as info:
        start(model, port=free_port(), log_path=log_path, timeout=120)
    message = str(info.value)
    assert "exited with code" in message and str(log_path) in message
    assert "no-such-model" in message  # the tail of vLLM's own error is quoted
    leftovers = [p for p in psutil.process_iter(["cmdline"]) if str(model) in " ".join(p.info["cmdline"] or [])]
    assert not leftovers


def test_cpu_list_of_a_proc_status_text():
    assert _cpu_list("Name:\tpython\nCpus_allowed_list:\t0-3,6\nMems_allowed:\t1\n") == {0, 1, 2, 3, 6}


def test_worker_cpus_and_staying_off_them(vllm_server):
    cpus = os.sched_getaffinity(0)
    if len(cpus) < 2:
        pytest.skip("one CPU: vLLM pins its worker to the only one")
    pinned = vllm_server.worker_cpus()
    assert pinned and pinned < cpus  # vLLM's auto binding keeps a CPU for the other processes
    try:
        assert stay_off_worker_cpus(vllm_server) == cpus and os.sched_getaffinity(0) == cpus - pinned
        assert stay_off_worker_cpus(vllm_server) is None  # already off them
    finally:
        os.sched_setaffinity(0, cpus)
