"""The embedded backend of `cohort serve` with no --backend: a local vLLM CPU server on a tiny MoE.

The tiny model is built once (`cohort make-tiny-moe`) into a cache folder and reused; the server
runs with the moe-cohort plugin, so routing policies and expert-load metrics work end to end.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from moe_cohort.proxy.vllm_server import VllmServer, start

log = logging.getLogger(__name__)


def default_model_dir() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "moe-cohort" / "tiny-qwen3-moe"


def ensure_tiny_model(model_dir: str | Path | None = None) -> Path:
    """The tiny MoE's folder, built there first if it holds no model yet."""
    model_dir = Path(model_dir) if model_dir else default_model_dir()
    if not (model_dir / "config.json").exists():
        from moe_cohort.devtools.tiny_moe import make_tiny_moe

        log.info("building the tiny MoE in %s", model_dir)
        make_tiny_moe(model_dir)
    return model_dir


def start_embedded_backend(model_dir: str | Path | None = None, *, max_num_seqs: int = 16,
                           port: int | None = None) -> VllmServer:
    """Start vLLM on the tiny MoE (built if needed) and wait until it answers /health."""
    return start(ensure_tiny_model(model_dir), port=port, max_num_seqs=max_num_seqs)
