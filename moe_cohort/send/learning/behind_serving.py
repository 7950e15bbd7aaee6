"""Work that must not slow serving down: a refit of the profile head runs in a process of its own that only gets a
core nothing else wants (Linux's SCHED_IDLE; nice 19 elsewhere); the rest of learning (observing, a batch's
re-predictions) on a worker thread, BLAS on one thread.

Why a process, not a low-priority thread: a thread holds the GIL while it computes, and a thread that the OS keeps
off the CPU (on a machine that vLLM keeps busy) holds it for as long as it waits there, so the serving event loop
waits with it (a priority inversion: the loop stalls for as long as the refit waits for a core). A process of its
own shares no GIL with the event loop, and its priority only ever delays the refit.

Why SCHED_IDLE, not only nice 19: a nice-19 process still takes turns on a busy core, and every refit then delays
the serving process or vLLM's when they wake; a SCHED_IDLE one yields the core at once to any other task that
wakes (docs/results.md measures what that is worth to an engine on a shared 2-core machine).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import pickle
import subprocess
import sys
import threading
from typing import BinaryIO

from threadpoolctl import ThreadpoolController, threadpool_limits

from moe_cohort.encoder.profile import ProfileHead

LOWEST = 19  # the lowest nice, where SCHED_IDLE is not to be had


class LearnerProcessError(RuntimeError):
    """The learner's process ended (killed, or out of memory); the next fit starts a new one."""


def fit_apart(*args, **kwargs) -> ProfileHead:
    """train.profile_head.fit_head_features(*args, **kwargs) in the learner's process, the calling thread waiting
    on its pipe (without the GIL). A process that ended is replaced at the next call (this one raises
    LearnerProcessError); an error of the fit itself is raised here."""
    apart = _apart()
    try:
        return apart.call(args, kwargs)
    except LearnerProcessError:
        _forget(apart)
        raise


def start_apart() -> None:
    """Start the learner's process now (its imports take a second of a core, at its priority), so that the first
    fit does not wait for them."""
    _apart()


def stop_apart() -> None:
    """Kill the learner's process, if one runs: a fit waiting on it raises LearnerProcessError, the next starts a
    new one (a refit that does not end must not hold a closing proxy or run forever)."""
    apart = _current
    if apart is not None:
        apart.process.kill()


class _Apart:
    """`python -m moe_cohort.send.learning.behind_serving`: fits sent on its stdin, answered on its stdout (pickles,
    over pipes only this process holds), one at a time. It ends when its stdin closes (this process ended)."""

    def __init__(self) -> None:
        self.process = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.lock = threading.Lock()
        atexit.register(self.close)

    def call(self, args: tuple, kwargs: dict):
        with self.lock:
            try:
                pickle.dump((args, kwargs), self.process.stdin, protocol=pickle.HIGHEST_PROTOCOL)
                self.process.stdin.flush()
                ok, value = pickle.load(self.process.stdout)
            except (OSError, EOFError, pickle.UnpicklingError) as exc:
                self.close()
                raise LearnerProcessError(f"the learner's process ended (exit status {self.process.poll()})") from exc
        if not ok:
            raise value
        return value

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.process.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(5)


_current: _Apart | None = None
_starting = threading.Lock()


def _apart() -> _Apart:
    """One learner process per serving process, shared by every learner in it."""
    global _current
    with _starting:
        if _current is None:
            _current = _Apart()
        return _current


def _forget(apart: _Apart) -> None:
    """`apart` ended: the next fit starts a new process."""
    global _current
    with _starting:
        if _current is apart:
            _current = None


def _lowest_priority() -> None:
    """This process (its calling thread, and the threads it starts later) runs only where nothing else wants the
    core: SCHED_IDLE on Linux, else nice 19 where there is nice, else as it was."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, 0, LOWEST)
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def _answers() -> BinaryIO:
    """The learner process's answers go out on the pipe its stdout was; stdout itself now writes to stderr, so
    that whatever a library prints cannot fall into the pickles the serving process reads."""
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    return answers


def _serve(stdin: BinaryIO, stdout: BinaryIO) -> None:
    """The learner process: the lowest CPU priority, BLAS on one thread (its helpers would busy-wait on the cores
    vLLM needs), then each fit sent, until its stdin closes."""
    _lowest_priority()
    from moe_cohort.train.profile_head import fit_head_features  # loads numpy and scipy's BLAS

    threadpool_limits(limits=1, user_api="blas")  # for the process's life (not a `with` block)
    while True:
        try:
            args, kwargs = pickle.load(stdin)
        except EOFError:
            return
        try:
            answer = (True, fit_head_features(*args, **kwargs))
        except Exception as exc:  # the caller raises it
            answer = (False, exc)
        pickle.dump(answer, stdout, protocol=pickle.HIGHEST_PROTOCOL)
        stdout.flush()


def one_blas_thread() -> contextlib.AbstractContextManager:
    """BLAS on one thread within the block: its other threads would busy-wait on the cores vLLM needs
    (OpenBLAS); admission's scoring runs on one too. The loaded libraries are inspected again only when a
    module was imported since (an inspection costs more than learning from a request)."""
    return _blas(len(sys.modules)).limit(limits=1, user_api="blas")


@functools.lru_cache(maxsize=1)
def _blas(modules: int) -> ThreadpoolController:
    return ThreadpoolController()  # inspects the loaded libraries (`modules`: how many Python modules were loaded)


if __name__ == "__main__":
    _serve(sys.stdin.buffer, _answers())
