"""engine.parent_death: a process that asked dies with its parent, even one killed outright; one that did not ask
(or whose environment does not say so) runs on."""

import os
import signal
import subprocess
import sys

import pytest

from moe_cohort.engine import parent_death

psutil = pytest.importorskip("psutil")

CHILD = ("import time\n"
         "from moe_cohort.engine.parent_death import follow_parent\n"
         "print(follow_parent(), flush=True)\n"
         "time.sleep(600)\n")


def _child_of_killed_parent(env: dict) -> tuple[str, bool]:
    """Start a parent that starts CHILD with `env`; SIGKILL the parent once the child has asked; (what the child
    printed, whether it is still alive 10 s later)."""
    parent = ("import subprocess, sys\n"
              f"c = subprocess.Popen([sys.executable, '-c', {CHILD!r}], env={env!r}, stdout=subprocess.PIPE, text=True)\n"
              "print(c.pid, c.stdout.readline().strip(), flush=True)\n"
              "import time; time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    pid, said = proc.stdout.readline().split()
    child = psutil.Process(int(pid))
    try:
        proc.kill()
        proc.wait(10)
        _, alive = psutil.wait_procs([child], timeout=10)
        return said, bool(alive)
    finally:
        if child.is_running():
            child.kill()


@pytest.mark.integration
def test_a_process_asked_to_dies_with_its_parent_killed_outright():
    said, alive = _child_of_killed_parent({**os.environ, parent_death.ENV: "1"})
    assert said == "True" and not alive


@pytest.mark.integration
def test_without_the_variable_nothing_changes():
    env = {k: v for k, v in os.environ.items() if k != parent_death.ENV}
    said, alive = _child_of_killed_parent(env)
    assert said == "False" and alive


def test_die_with_parent_reports_what_linux_refused():
    with pytest.raises(OSError, match="PR_SET_PDEATHSIG"):
        parent_death.die_with_parent(signal.NSIG + 10)  # not a signal: EINVAL
