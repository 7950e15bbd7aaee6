"""moe_cohort.embedded.vllm_server: a vLLM server that cannot start is reported with its log, and nothing is left
running; a server given CPUs runs all its processes there."""

import importlib.util
import os

import psutil
import pytest

from moe_cohort.embedded.placement import split_cpus
from moe_cohort.embedded.vllm_server import ServerError, free_port, group_members, start

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


def test_the_api_server_its_engine_core_and_its_workers_all_run_on_the_cpus_given(vllm_server):
    if split_cpus() is None:
        pytest.skip("one core: nothing to place")
    assert vllm_server.cpus == split_cpus().engine  # as conftest starts it, like the embedded `cohort serve`
    members = {pid: psutil.Process(pid) for pid in group_members(vllm_server.process.pid)}
    names = {p.name() for p in members.values()}
    assert any(n.startswith("VLLM::EngineCor") for n in names) and any(n.startswith("VLLM::Worker") for n in names)
    for pid, process in members.items():
        for thread in process.threads():
            assert os.sched_getaffinity(thread.id) <= vllm_server.cpus, (process.name(), thread.id)
