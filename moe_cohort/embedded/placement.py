"""Where the embedded engine's processes and ours run: vLLM on all cores but one, our side on that one.

The rule: no process of ours shares a core with any of vLLM's. vLLM CPU keeps its worker's OpenMP threads
spinning on the cores it binds them to, and its engine core polls while it has requests, so a process that
lands beside either (the proxy's event loop, a batch runner, the learner's refits) waits for every wake-up,
and vLLM waits for it in turn. vLLM CPU's own binding (VLLM_CPU_OMP_THREADS_BIND=auto) takes its cores from
the affinity it starts with and keeps one of them for its engine core, so starting it on the engine side
keeps its API server, engine core and workers there, and ours never meet them.

Our side is one physical core (the last allowed CPU and its SMT siblings): the proxy is one event loop, its
encoder runs on `encoder_threads`, and the learner's refits run at the lowest priority; one core serves
hundreds of requests a second, far more than the tiny MoE's engine. On a single-core machine there is
nothing to split.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Placement:
    engine: frozenset[int]  # vLLM's API server, engine core and workers
    ours: frozenset[int]  # the proxy or batch runner, its learner, and whatever else this process starts


def split_cpus(allowed: set[int] | None = None, siblings=None) -> Placement | None:
    """The engine side and our side of `allowed` (default: this process's CPUs); None when they cannot be
    told apart (one physical core). `siblings(cpu)` gives the CPUs of `cpu`'s physical core (default: sysfs)."""
    allowed = set(os.sched_getaffinity(0) if allowed is None else allowed)
    ours = (siblings or smt_siblings)(max(allowed)) & allowed | {max(allowed)}
    engine = allowed - ours
    if not engine:
        return None
    return Placement(engine=frozenset(engine), ours=frozenset(ours))


def smt_siblings(cpu: int) -> set[int]:
    """The logical CPUs that share `cpu`'s physical core (itself alone where sysfs does not say)."""
    try:
        text = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text()
    except OSError:
        return {cpu}
    return cpu_list(text)


def cpu_list(text: str) -> set[int]:
    """The CPUs of a Linux CPU list ("0-3,6")."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def move_process(cpus: set[int] | frozenset[int], pid: int = 0) -> None:
    """Put every thread of process `pid` (0: this one) on `cpus`; threads it starts later inherit them."""
    pid = pid or os.getpid()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            continue
    log.info("pid %d runs on CPUs %s", pid, sorted(cpus))
