"""Hashed word n-grams of prompts: the text features the profile head reads beside the embedding.

A sentence embedding keeps what a prompt is about; the words themselves (a format instruction, an
answer-letter template, a code keyword) say much of how the model will answer, and so which experts
its generated tokens pick. The profile head (encoder.profile) reads both (docs/results.md compares
it with the embedding alone).

Words are lower-cased runs of letters and digits, and single punctuation marks; a feature is the
crc32 of an n-gram modulo `dim` (no vocabulary to store, stable across processes and versions);
counts are log1p-damped and every row is made unit (an empty text is all zero).

The hash is part of what a saved head means: its weights and neighbour memory are indexed by these
features, so another hash (scikit-learn's HashingVectorizer uses murmurhash3) would make every saved
head and learner reservoir read the wrong columns. The admission path hashes one prompt per call,
where this loop has no per-call setup (tests/encoder/test_ngrams.py pins the hashing).
"""

from __future__ import annotations

import re
import zlib
from typing import Sequence

import numpy as np

DEFAULT_NGRAM_DIM = 4096
_TOKEN = re.compile(r"\w+|[^\w\s]")


def hashed_ngrams(texts: Sequence[str], dim: int = DEFAULT_NGRAM_DIM) -> np.ndarray:  # [N, dim] float32
    """Unit rows of log1p counts of the hashed word 1- and 2-grams of each text."""
    out = np.zeros((len(texts), dim), np.float32)
    for i, text in enumerate(texts):
        words = _TOKEN.findall(str(text).lower())
        hashes = [zlib.crc32(w.encode()) for w in words]  # 1-grams
        # 2-grams: crc32 continues from the first word's, so crc32("a b") costs only " b"
        hashes += [zlib.crc32((" " + b).encode(), h) for h, b in zip(hashes, words[1:])]
        if hashes:
            out[i] = np.bincount(np.asarray(hashes, np.int64) % dim, minlength=dim)
    out = np.log1p(out)
    return out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)
