"""A static-embedding encoder distilled from the sentence encoder: microseconds per prompt.

A static model embeds a text as the weighted mean of per-token vectors (no attention, no
transformer layers), so its cost is one tokenizer pass and one gather. Model2Vec distillation
(Tulkens and van Dongen, 2024; sentence-transformers' `StaticEmbedding.from_distillation`)
embeds every vocabulary token with the teacher (all-MiniLM-L6-v2 by default), reduces them with
PCA to `dims` and weights them by Zipf's law. The result is an ordinary sentence-transformers
folder: `Embedder(folder)` loads it, and `cohort train --encoder folder` fine-tunes it to expert
overlap like any other encoder.

`static_model_dir()` distils once (about a minute on 2 cores) into a cache folder and reuses it;
`--encoder static` anywhere names that folder. The cache lives in $COHORT_CACHE_DIR (default
~/.cache/moe-cohort), never in the repository.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

STATIC_NAME = "static"
DEFAULT_DIMS = 256


def cache_root() -> Path:
    return Path(os.environ.get("COHORT_CACHE_DIR", Path.home() / ".cache" / "moe-cohort")).expanduser()


def static_model_dir(source: str, *, dims: int = DEFAULT_DIMS, root: Path | None = None) -> Path:
    """The folder of the static encoder distilled from the teacher `source` (a resolved folder or hub
    name; `encoder.embedding.resolve_model`), built once."""
    out = (root or cache_root()) / f"static-{Path(source).name}-{dims}"
    if (out / "modules.json").is_file():
        return out
    log.info("distilling a static encoder from %s (PCA %d dims) into %s; this happens once", source, dims, out)
    return distill(source, out, dims=dims)


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
