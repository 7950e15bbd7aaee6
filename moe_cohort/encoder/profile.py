"""Predicted expert profiles: a small linear head from a prompt's embedding to its expert frequencies.

The head maps an encoder embedding x [D] to u [L, E], the predicted fraction of the request's
decode tokens that pick expert e at MoE layer l (rows sum to about top_k), which is what
admission.resident.ResidentExperts needs to admit by expected new experts from text alone.
It is a ridge regression blended with the profiles of the nearest training requests (fitted by
train.profile_head on the training side of traces.split), on the embedding and, when fitted with
them, the prompt's hashed word n-grams (encoder.ngrams; then `predict` needs the texts too),
saved as `expert_profile_head.npz`
in the encoder's folder, so `--encoder FOLDER` finds both. (The compact form the proxy forwards a
profile in is admission.wire's.)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from moe_cohort.encoder.ngrams import hashed_ngrams

HEAD_FILE = "expert_profile_head.npz"


@dataclass(frozen=True)
class ProfileHead:
    """u = clip((1 - mix) * (f @ weight + bias) + mix * neighbours' profiles, 0, 1), as [L, E].

    f = head_features(x, texts, ngram_dim): the embedding, or with `ngram_dim` > 0 the unit embedding
    beside the texts' hashed n-grams.

    The neighbour part (when `memory_x` is set) is the softmax(temperature * cosine)-weighted
    mean of the profiles of the `neighbours` training requests nearest to x. Ridge alone
    regresses every profile toward the mean; real neighbours keep how concentrated a profile
    is, which is what the expected-new-experts rule ranks candidates by."""

    weight: np.ndarray  # [F, L*E] float32, F = D + ngram_dim
    bias: np.ndarray  # [L*E] float32
    num_layers: int
    num_experts: int
    top_k: int
    alpha: float = 0.0  # the ridge penalty it was fitted with (for the record)
    memory_x: np.ndarray | None = None  # [M, F] float32 unit features of the training requests
    memory_y: np.ndarray | None = None  # [M, L*E] their expert profiles, float16 values (saved so) held as float32
    neighbours: int = 10
    temperature: float = 20.0
    mix: float = 0.0  # weight of the neighbour part (0: ridge only)
    ngram_dim: int = 0  # hashed n-gram features read from the texts beside the embedding (0: none)

    def __post_init__(self) -> None:
        if self.memory_y is not None:  # numpy converts float16 slowly: once here, not per request
            object.__setattr__(self, "memory_y", np.asarray(self.memory_y, dtype=np.float32))
        if self.memory_x is not None:  # [F, M]: a feature's row is contiguous, so a sparse request reads only its own
            object.__setattr__(self, "_memory_t", np.ascontiguousarray(self.memory_x.T, dtype=np.float32))

    @property
    def dim(self) -> int:
        """The embedding dimension it reads (its n-gram features come from the texts)."""
        return self.weight.shape[0] - self.ngram_dim

    def predict(self, x: np.ndarray, texts: Sequence[str] | str | None = None) -> np.ndarray:  # [N, D] -> [N, L, E]
        """Predicted expert frequencies (float32) of embeddings x [N, D] (or one [D] -> [L, E]) of `texts`
        (one per row, or one string for one [D]; needed when the head reads n-grams, else ignored)."""
        x = np.asarray(x, dtype=np.float32)
        if x.shape[-1] != self.dim:
            raise ValueError(f"embeddings have dimension {x.shape[-1]}, the head expects {self.dim}")
        flat = head_features(x.reshape(-1, self.dim), [texts] if isinstance(texts, str) else texts, self.ngram_dim)
        return self.from_features(flat).reshape(x.shape[:-1] + (self.num_layers, self.num_experts))

    def from_features(self, f: np.ndarray) -> np.ndarray:  # [N, F] -> [N, L*E]
        """Predicted flat profiles of what the head reads (`head_features`), e.g. kept by the online learner."""
        y = _used_rows(f, self.weight) + self.bias  # [N, L*E]
        if self.mix > 0 and self.memory_x is not None:
            y = (1.0 - self.mix) * y + self.mix * self._neighbour_mean(f)
        return np.clip(y, 0.0, 1.0)

    def _neighbour_mean(self, x: np.ndarray) -> np.ndarray:  # [N, D] -> [N, L*E]
        norms = np.linalg.norm(x, axis=1, keepdims=True)
        sim = _used_rows(x / np.where(norms > 0, norms, 1.0), self._memory_t)  # [N, M] cosine
        k = min(self.neighbours, sim.shape[1])
        idx = np.argpartition(-sim, k - 1, axis=1)[:, :k]  # [N, k] nearest training requests
        w = np.exp(self.temperature * (np.take_along_axis(sim, idx, axis=1) - sim.max(axis=1, keepdims=True)))
        w /= w.sum(axis=1, keepdims=True)  # [N, k]
        return np.matmul(w[:, None, :], self.memory_y[idx])[:, 0]  # [N, 1, k] @ [N, k, L*E]

    def save(self, folder: str | Path) -> Path:
        """Write the head to FOLDER/expert_profile_head.npz (no pickles) and return the path."""
        path = Path(folder) / HEAD_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {"num_layers": self.num_layers, "num_experts": self.num_experts, "top_k": self.top_k, "alpha": self.alpha,
                "neighbours": self.neighbours, "temperature": self.temperature, "mix": self.mix,
                "ngram_dim": self.ngram_dim}
        arrays = {"weight": self.weight.astype(np.float32), "bias": self.bias.astype(np.float32), "meta": np.array(json.dumps(meta))}
        if self.memory_x is not None:
            arrays.update(memory_x=self.memory_x.astype(np.float32), memory_y=self.memory_y.astype(np.float16))
        with open(path, "wb") as f:
            np.savez(f, **arrays)
        return path


def load_profile_head(folder: str | Path) -> ProfileHead | None:
    """The head saved in an encoder folder, or None when the folder has none."""
    path = Path(folder) / HEAD_FILE
    if not path.is_file():
        return None
    with np.load(path, allow_pickle=False) as z:
        meta = json.loads(str(z["meta"]))
        memory = {k: z[k] for k in ("memory_x", "memory_y") if k in z.files}
        return ProfileHead(weight=z["weight"], bias=z["bias"], num_layers=int(meta["num_layers"]),
                           num_experts=int(meta["num_experts"]), top_k=int(meta["top_k"]), alpha=float(meta.get("alpha", 0.0)),
                           neighbours=int(meta.get("neighbours", 10)), temperature=float(meta.get("temperature", 20.0)),
                           mix=float(meta.get("mix", 0.0)), ngram_dim=int(meta.get("ngram_dim", 0)), **memory)


def _used_rows(f: np.ndarray, m: np.ndarray) -> np.ndarray:  # [N, F] @ [F, K] -> [N, K]
    """f @ m over the features some row of f uses: a prompt's hashed n-grams set only a small share of the
    n-gram columns, so one request's prediction reads those rows of the weights and the memory, not all."""
    used = np.flatnonzero(f.any(axis=0))  # [C]
    if 2 * len(used) > f.shape[1]:  # dense enough: BLAS on the whole
        return f @ m
    return f[:, used] @ m[used]


def head_features(x: np.ndarray, texts: Sequence[str] | None, ngram_dim: int) -> np.ndarray:  # [N, D] -> [N, F]
    """What a head reads: x itself, or with ngram_dim > 0 [unit(x), hashed_ngrams(texts)] / sqrt(2) (unit rows)."""
    if ngram_dim == 0:
        return x
    if texts is None or len(texts) != len(x):
        raise ValueError(f"this profile head reads the prompt texts beside the embeddings (hashed n-grams): pass one "
                         f"text per embedding ({len(x)}), got {'none' if texts is None else len(texts)}")
    unit = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
    return (np.hstack([unit, hashed_ngrams(texts, ngram_dim)]) / np.sqrt(2.0)).astype(np.float32)

