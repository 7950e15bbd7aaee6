"""Linux's permission for AMX tile state, asked for in every vLLM process our plugin loads in.

On x86-64 Linux a process must ask the kernel for AMX state (`arch_prctl(ARCH_REQ_XCOMP_PERM,
XFEATURE_XTILEDATA)`) before it runs an AMX instruction, or it dies of SIGILL. vLLM CPU's attention kernel
(`cpu_attention_with_kv_cache`) runs AMX instructions on a CPU that has them without asking. A first forward of
several tokens has other kernels ask before it; a server whose first request is a one-token prompt loses its
worker to SIGILL, and every later request fails with EngineDeadError. Asking at plugin registration, before the
first forward, keeps it alive. The permission holds for the whole process, its later threads included.
"""

from __future__ import annotations

import ctypes
import logging
import platform

log = logging.getLogger(__name__)

SYS_ARCH_PRCTL = 158  # x86-64 syscall number
ARCH_GET_XCOMP_PERM, ARCH_REQ_XCOMP_PERM = 0x1022, 0x1023
XFEATURE_XTILEDATA = 18


def cpu_has_amx(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU has AMX tiles (the `amx_tile` flag)."""
    try:
        with open(cpuinfo, encoding="utf-8") as fh:
            return any(line.startswith("flags") and "amx_tile" in line.split() for line in fh)
    except OSError:
        return False


def _arch_prctl(code: int, arg) -> int:
    return ctypes.CDLL(None, use_errno=True).syscall(SYS_ARCH_PRCTL, code, arg)


def holds_amx() -> bool:
    """Whether this process may use AMX tile state."""
    mask = ctypes.c_uint64(0)
    return _arch_prctl(ARCH_GET_XCOMP_PERM, ctypes.byref(mask)) == 0 and bool(mask.value >> XFEATURE_XTILEDATA & 1)


def allow_amx() -> bool:
    """Ask Linux for AMX tile state for this process; whether it holds it now. False without AMX (another CPU,
    another OS): nothing to ask for."""
    if platform.system() != "Linux" or platform.machine() != "x86_64" or not cpu_has_amx():
        return False
    if _arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0:
        log.warning("Linux refused AMX state (errno %d): vLLM CPU's attention may die of SIGILL on a first "
                    "one-token prompt", ctypes.get_errno())
        return False
    return True
