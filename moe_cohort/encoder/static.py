"""A static-embedding encoder distilled from the sentence encoder: no transformer pass per prompt.

A static model embeds a text as the weighted mean of per-token vectors (no attention, no
transformer layers), so its cost is one tokenizer pass and one gather. Model2Vec distillation
(Tulkens and van Dongen, 2024; sentence-transformers' `StaticEmbedding.from_distillation`)
embeds every vocabulary token with the teacher (all-MiniLM-L6-v2 by default), reduces them with
PCA to `dims` and weights them by Zipf's law. The result is an ordinary sentence-transformers
folder: `Embedder(folder)` loads it, and `cohort train --encoder folder` fine-tunes it to expert
overlap like any other encoder.

`static_model_dir()` distils once (every vocabulary token through the teacher) into a cache folder and reuses it;
`--encoder static` anywhere names that folder. The distillation runs in a child process (`python -m
moe_cohort.encoder.static`): the teacher's torch, and the Triton that torch loads, never enter the process that
asked, so a server distilling on its first start stays light and stops without their noise on its console. It says so (a warning, so a server's console shows
it), and processes that start together distil once: the first holds a file lock beside the cache
folder, the others wait for it and reuse its folder. The cache lives in $COHORT_CACHE_DIR (default
~/.cache/moe-cohort), never in the repository.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np

log = logging.getLogger(__name__)

STATIC_NAME = "static"
DEFAULT_DIMS = 256
DISTILL_TIME = "a few minutes"  # every token of the packaged MiniLM's 30k vocabulary, embedded (log: the time it took)


def cache_root() -> Path:
    return Path(os.environ.get("COHORT_CACHE_DIR", Path.home() / ".cache" / "moe-cohort")).expanduser()


def static_model_dir(source: str, *, dims: int = DEFAULT_DIMS, root: Path | None = None,
                     build: Callable[..., Path] | None = None) -> Path:
    """The folder of the static encoder distilled from the teacher `source` (a resolved folder or hub
    name; `encoder.embedding.resolve_model`), built once by `build(source, out, dims=dims)` (`distill_apart`).

    Processes that start together build it once: the builder holds an exclusive lock on a file beside
    the cache folder (fcntl.flock, released when the process ends, however it ends); the others wait
    for the lock and then find the folder complete (`_save` renames it into place whole)."""
    out = static_path(source, dims=dims, root=root)
    if _complete(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("another process is distilling the static encoder into %s; waiting for it", out)
            fcntl.flock(lock, fcntl.LOCK_EX)
        if _complete(out):  # built by the process we waited for
            return out
        log.warning("first use of the static encoder: distilling it from %s (PCA %d dims) into %s; this takes "
                    "%s and happens once", source, dims, out, DISTILL_TIME)
        started = time.monotonic()
        (build or distill_apart)(source, out, dims=dims)
        log.info("static encoder ready in %.0f s: %s", time.monotonic() - started, out)
    return out


def read_static(folder: str) -> tuple[object, np.ndarray] | None:
    """(fast tokenizer, token table [V, D] float32) of a local sentence-transformers folder that holds one
    StaticEmbedding module and nothing after it, as StaticEmbedding.load reads them (tokenizer.json, the
    `embedding.weight` tensor), without torch; None for any other folder (the caller loads it whole)."""
    path = Path(folder)
    try:
        modules = json.loads((path / "modules.json").read_text())
    except (OSError, ValueError):
        return None
    if len(modules) != 1 or not str(modules[0].get("type", "")).endswith("StaticEmbedding") \
            or modules[0].get("path", "") or not (path / "model.safetensors").is_file():
        return None
    from safetensors.numpy import load_file
    from tokenizers import Tokenizer

    weights = load_file(str(path / "model.safetensors"))
    if "embedding.weight" not in weights:  # model2vec's own layout: the model folds it
        return None
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    tokenizer.no_padding()
    return tokenizer, weights["embedding.weight"].astype(np.float32)


def static_path(source: str, *, dims: int = DEFAULT_DIMS, root: Path | None = None) -> Path:
    """Where `static_model_dir` keeps the encoder distilled from `source`."""
    return (root or cache_root()) / f"static-{Path(source).name}-{dims}"


def _complete(out: Path) -> bool:
    return (out / "modules.json").is_file()


def distill(source: str, out: Path, *, dims: int = DEFAULT_DIMS) -> Path:
    """Distil `source` (folder or hub name) into a StaticEmbedding sentence-transformers folder `out`.

    Written to a scratch folder beside `out` and renamed into place, so `out` is complete or absent."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import StaticEmbedding

    try:
        static = StaticEmbedding.from_distillation(source, device="cpu", pca_dims=dims)
    except ImportError as exc:
        raise RuntimeError("the static encoder is distilled with model2vec: pip install 'model2vec>=0.10' "
                           "'skeletoken>=0.6,<0.7' (or reinstall moe-cohort)") from exc
    return _save(SentenceTransformer(modules=[static], device="cpu"), out)


def distill_apart(source: str, out: Path, *, dims: int = DEFAULT_DIMS) -> Path:
    """`distill` in a child process; its output is shown only when it fails (RuntimeError with its last lines)."""
    done = subprocess.run([sys.executable, "-m", __name__, source, str(out), "--dims", str(dims)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"distilling the static encoder from {source} failed (exit {done.returncode}):\n"
                           + "\n".join((done.stdout + done.stderr).splitlines()[-20:]))
    return out


def save_static(tokenizer, weights, out: Path) -> Path:
    """Save a StaticEmbedding of a fast `tokenizer` (tokenizers.Tokenizer) and token vectors
    `weights` [V, D] as a sentence-transformers folder `out` (e.g. train.static_student's)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import StaticEmbedding

    return _save(SentenceTransformer(modules=[StaticEmbedding(tokenizer, embedding_weights=weights)], device="cpu"), out)


def _save(model, out: Path) -> Path:
    """Write `model` to a scratch folder beside `out` and rename it into place: `out` is complete or absent."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".static-", dir=out.parent) as tmp:
        model.save(tmp)
        shutil.rmtree(out, ignore_errors=True)  # an incomplete earlier attempt
        os.replace(tmp, out)
        os.makedirs(tmp)  # TemporaryDirectory removes what it made
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="distil a static encoder from a sentence encoder (static_model_dir)")
    parser.add_argument("source", help="the teacher: a sentence-transformers folder or hub name")
    parser.add_argument("out", type=Path, help="the folder to write (complete or absent)")
    parser.add_argument("--dims", type=int, default=DEFAULT_DIMS, help="PCA dimensions")
    args = parser.parse_args()
    distill(args.source, args.out, dims=args.dims)
