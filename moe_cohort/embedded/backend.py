"""The embedded backend of `cohort serve` with no --backend: a local vLLM CPU server on a tiny MoE.

The default model is the tiny Qwen3-MoE trained on text (devtools/train_moe.py, recipe "full"): its
experts follow what a request is about, so which requests decode together changes how many experts a
step loads. It is trained once into a cache folder and reused (the random tiny MoE of
devtools/tiny_moe.py routes by token identity: no admission order saves anything on it). The server
runs with the moe-cohort plugin (routing policies, expert-load metrics, the counts learning takes)
and admits from its own queue by predicted experts (`--scheduler-cls ExpertAwareScheduler`).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

from moe_cohort.embedded.vllm_server import VllmServer, start
from moe_cohort.engine.engine_info import SCHEDULER_CLS

log = logging.getLogger(__name__)

TRAIN_MINUTES = "a few minutes"  # devtools/train_moe.py, recipe "full" (docs/results.md, "The trained tiny MoE")


def cache_root() -> Path:
    """$COHORT_CACHE_DIR, else $XDG_CACHE_HOME/moe-cohort, else ~/.cache/moe-cohort."""
    if os.environ.get("COHORT_CACHE_DIR"):
        return Path(os.environ["COHORT_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "moe-cohort"


def default_model_dir() -> Path:
    """Where the embedded backend's trained tiny MoE lives unless --model-dir says otherwise."""
    return cache_root() / "trained-tiny-moe-model"


def has_model(model_dir: str | Path) -> bool:
    """Whether `model_dir` holds a complete model (config.json is written last)."""
    return (Path(model_dir) / "config.json").is_file()


def ensure_trained_model(model_dir: str | Path | None = None, *,
                         train: Callable[[Path, Path], object] | None = None) -> Path:
    """The folder of the tiny MoE trained on text, trained there first if it holds no model yet (a model
    already there, trained or not, is kept as it is). Training is cached by recipe under cache_root(): a
    second folder copies the first's model. `train(model_dir, cache_dir)`: `train_apart` unless given."""
    model_dir = Path(model_dir) if model_dir else default_model_dir()
    if not has_model(model_dir):
        log.info("training the tiny MoE on text into %s", model_dir)
        (train or train_apart)(model_dir, cache_root() / "trained-tiny-moe")
    return model_dir


def train_apart(model_dir: Path, cache_dir: Path, recipe: str = "full") -> None:
    """Train (or copy from the cache) in a child process (`python -m moe_cohort.devtools.train_moe`): torch, and
    the Triton it loads, never enter the process that serves, which stays light and stops without their noise on
    its console. The child's output is shown only when it fails."""
    done = subprocess.run([sys.executable, "-m", "moe_cohort.devtools.train_moe", str(model_dir), "--recipe", recipe,
                           "--cache-dir", str(cache_dir)], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"training the tiny MoE into {model_dir} failed (exit {done.returncode}):\n"
                           + "\n".join((done.stdout + done.stderr).splitlines()[-20:]))


def ensure_tiny_model(model_dir: str | Path | None = None) -> Path:
    """The RANDOM tiny MoE's folder (benchmarks of the proxy's own cost), built there first if it holds no
    model yet."""
    model_dir = Path(model_dir) if model_dir else cache_root() / "tiny-qwen3-moe"
    if not has_model(model_dir):
        from moe_cohort.devtools.tiny_moe import make_tiny_moe

        log.info("building the random tiny MoE in %s", model_dir)
        make_tiny_moe(model_dir)
    return model_dir


def start_embedded_backend(model_dir: str | Path, *, max_num_seqs: int = 16, port: int | None = None,
                           expert_aware: bool = True, cpus: frozenset[int] | None = None) -> VllmServer:
    """Start vLLM on the model in `model_dir` with the plugin and, with `expert_aware`, the expert-aware
    scheduler, on `cpus` (None: wherever the OS puts it); wait until it answers /health."""
    extra = ["--scheduler-cls", SCHEDULER_CLS] if expert_aware else []
    return start(model_dir, port=port, max_num_seqs=max_num_seqs, extra_args=extra, cpus=cpus)
