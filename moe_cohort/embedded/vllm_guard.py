"""`python -m moe_cohort.embedded.vllm_guard PARENT_PID [--cpus LIST] COMMAND...`: run COMMAND (the vLLM API
server) so that it, and every process it starts, dies with the process PARENT_PID, however that one ends,
and, with `--cpus 0-2,5`, runs on those CPUs only (the processes it starts inherit them).

vLLM's API server starts an engine core, which starts its workers (multiprocessing, fork or spawn);
none of them notices when the process that started the API server dies, so without the guard a
`kill -9` (or the OOM killer) of `cohort serve` leaves them running, orphaned, with their memory. The
guard is the leader of the server's process group (embedded/vllm_server.py starts it in a session of its
own, and vLLM's processes stay in their parent's group), and it asks Linux to signal it when its
parent dies (prctl PR_SET_PDEATHSIG: sent when the *thread* that started the guard ends, so start it
from the main thread or another that lives as long as the server). On that signal it SIGKILLs the
whole group, itself included: nobody is left to want a graceful shutdown. For a guard killed outright,
each vLLM process dies with the one that started it (engine.parent_death: the server runs with
COHORT_DIE_WITH_PARENT=1, and our plugin asks for SIGKILL on its parent's death in every vLLM process;
the API server is asked here too, before it runs, for a server started without the plugin).

Otherwise the guard is transparent: SIGTERM and SIGINT go on to the API server (VllmServer.stop's
graceful shutdown), and it exits with the server's status (128 + N for a server killed by signal N).
Whatever the server leaves behind in the group when it exits (an engine core and its workers, when the
server was stopped before it stopped them: a Ray worker's exit signals the processes it started) is
SIGKILLed first. Linux only; it imports nothing heavy, so it stays small beside the server.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from moe_cohort.engine import parent_death

PARENT_DIED = signal.SIGHUP  # the guard runs in a session without a terminal: nothing else sends it a hangup


def kill_group(*_) -> None:
    os.killpg(os.getpgrp(), signal.SIGKILL)


def kill_the_rest() -> None:
    """SIGKILL every process of this group but this one (what the server left behind)."""
    from moe_cohort.embedded.vllm_server import group_members  # standard library only, as this module

    for pid in group_members(os.getpgrp()):
        if pid != os.getpid():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:  # gone meanwhile
                pass


def main(argv: list[str]) -> int:
    if len(argv) < 2 or not argv[0].isdigit() or (argv[1] == "--cpus" and len(argv) < 4):
        print("usage: python -m moe_cohort.embedded.vllm_guard PARENT_PID [--cpus LIST] COMMAND...", file=sys.stderr)
        return 2
    parent, command = int(argv[0]), argv[1:]
    if command[0] == "--cpus":
        from moe_cohort.embedded.placement import cpu_list  # standard library only, as this module

        os.sched_setaffinity(0, cpu_list(command[1]))  # one thread here: the whole guard, and what it starts
        command = command[2:]
    signal.signal(PARENT_DIED, kill_group)
    parent_death.die_with_parent(PARENT_DIED)
    if os.getppid() != parent:  # it died before we asked
        kill_group()
    server = subprocess.Popen(command, env={**os.environ, parent_death.ENV: "1"},
                              preexec_fn=lambda: parent_death.die_with_parent(signal.SIGKILL))  # one thread here: safe
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _: server.send_signal(signum))
    status = server.wait()
    kill_the_rest()
    return status if status >= 0 else 128 - status


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
