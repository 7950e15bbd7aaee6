"""Work that must not slow serving down (the online learner's refits, a batch's re-predictions): a thread at the
lowest CPU priority, BLAS on one thread while it computes."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading

from threadpoolctl import ThreadpoolController


def lowest_priority() -> None:
    """The calling thread runs at the lowest CPU priority (Linux's nice is per thread; a thread pool's
    initializer): on a machine it shares with vLLM, a refit must not take the CPU that vLLM's API server
    needs to start the next request."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux: the default priority
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def one_blas_thread() -> contextlib.AbstractContextManager:
    """BLAS on one thread within the block: its other threads would busy-wait on the cores vLLM needs
    (OpenBLAS); admission's scoring runs on one too. The loaded libraries are inspected again only when a
    module was imported since (an inspection costs more than learning from a request)."""
    return _blas(len(sys.modules)).limit(limits=1, user_api="blas")


@functools.lru_cache(maxsize=1)
def _blas(modules: int) -> ThreadpoolController:
    return ThreadpoolController()  # inspects the loaded libraries (`modules`: how many Python modules were loaded)
