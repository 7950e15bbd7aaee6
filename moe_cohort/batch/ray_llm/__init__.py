"""Expert-aware batches in Ray Data LLM (processor.py tells the whole run); its public names, each loaded on first
use, so that Ray's workers that import the box or the source (box.py, source.py) load nothing more."""

from __future__ import annotations

import importlib

_PUBLIC = {
    "ExpertAware": "moe_cohort.batch.ray_llm.processor",
    "PLUGIN": "moe_cohort.batch.ray_llm.processor",
    "PENDING_PER_SLOT": "moe_cohort.batch.ray_llm.processor",
    "SCHEDULER_CLS": "moe_cohort.batch.ray_llm.processor",
}
__all__ = list(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'moe_cohort.batch.ray_llm' has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC[name]), name)


def __dir__() -> list[str]:
    return sorted(__all__)
