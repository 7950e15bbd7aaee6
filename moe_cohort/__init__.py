"""moe-cohort: expert-coherent batching for Mixture-of-Experts serving.

The public surface, what a user imports or names on a command line (everything else is internal):

    Settings, load_settings   the one config object of a process, and where it is read from (flags, COHORT_*, a file)
    create_app                the OpenAI-compatible proxy as an ASGI app (what `cohort serve` runs)
    run_file, FileJob         one OpenAI Batch file through vLLM, resumable (what `cohort batch run` runs)
    ExpertAwareScheduler      vLLM's scheduler that admits by predicted experts (--scheduler-cls names its module path,
                              moe_cohort.engine.scheduler.ExpertAwareScheduler)
    ExpertAffinityRouter      Ray Serve's request router by predicted experts (needs the `ray` extra)

Each name is imported on first use, so `import moe_cohort` (which vLLM's plugin loader does in every one of its
processes) loads none of them.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_PUBLIC = {
    "Settings": "moe_cohort.send.settings",
    "load_settings": "moe_cohort.send.setting_sources",
    "create_app": "moe_cohort.proxy.app",
    "run_file": "moe_cohort.batch.file_run",
    "FileJob": "moe_cohort.batch.file_run",
    "ExpertAwareScheduler": "moe_cohort.engine.scheduler",
    "ExpertAffinityRouter": "moe_cohort.ray_serve.router",
}
__all__ = [*_PUBLIC, "__version__"]


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'moe_cohort' has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC[name]), name)


def __dir__() -> list[str]:
    return sorted(__all__)
