"""A process that dies with its parent (Linux PR_SET_PDEATHSIG), for every process of a guarded vLLM server.

Linux does not end a process when its parent dies: the child is re-parented and runs on. embedded/vllm_guard.py
starts the vLLM API server with `ENV=1` in its environment; every vLLM process inherits it and loads our
plugin, whose `register()` calls `follow_parent()`: so the API server dies with the guard, the engine core
with the API server, a worker with the engine core, even when the one above is killed outright (SIGKILL,
the OOM killer, Ray ending a replica's worker). The signal is sent when the *thread* that started the
process ends; vLLM starts its engine core and workers from the main thread of the process above.

Standard library only: the guard imports it beside a running server.
"""

from __future__ import annotations

import ctypes
import os
import signal

ENV = "COHORT_DIE_WITH_PARENT"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

_prctl = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)  # Linux only; resolved before any fork


def die_with_parent(sig: int) -> None:
    """Ask Linux to send this process `sig` when the thread that created it ends."""
    if _prctl is None:
        raise OSError(f"prctl(PR_SET_PDEATHSIG) is Linux only: unset {ENV} (the guard of embedded/vllm_guard.py sets it)")
    if _prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_PDEATHSIG): {os.strerror(errno)}")


def follow_parent(environ=os.environ) -> bool:
    """With `ENV=1` in `environ`: SIGKILL this process when its parent dies (at once if that happened already,
    before the request was made); returns whether it was asked."""
    if environ.get(ENV) != "1":
        return False
    parent = os.getppid()
    die_with_parent(signal.SIGKILL)
    if os.getppid() != parent:  # re-parented between the two calls: the parent is gone
        os.kill(os.getpid(), signal.SIGKILL)
    return True
