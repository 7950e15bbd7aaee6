"""Predicted expert profiles: a small linear head from a prompt's embedding to its expert frequencies.

The head maps an encoder embedding x [D] to u [L, E], the predicted fraction of the request's
decode tokens that pick expert e at MoE layer l (rows sum to about top_k), which is what
encoder.admission.ResidentExperts needs to admit by expected new experts from text alone.
It is a ridge regression (fitted by train.profile_head on the training side of traces.split),
saved as `expert_profile_head.npz` in the encoder's folder, so `--encoder FOLDER` finds both.

Compact form, for a request field that carries flat lists of scalars (vLLM's `vllm_xargs`):
per layer the `top` most frequent experts, each as one int `expert * 256 + q` with
q = round(255 * u) in 0..255, layer after layer (L * top ints; 26 * 8 = 208 for DeepSeek-V2-Lite).
`expand` restores an [L, E] profile with the rest of each layer at 0.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HEAD_FILE = "expert_profile_head.npz"
COMPACT_TOP = 8
_LEVELS = 255


@dataclass(frozen=True)
class ProfileHead:
    """u = clip(x @ weight + bias, 0, 1), reshaped to [L, E]."""

    weight: np.ndarray  # [D, L*E] float32
    bias: np.ndarray  # [L*E] float32
    num_layers: int
    num_experts: int
    top_k: int
    alpha: float = 0.0  # the ridge penalty it was fitted with (for the record)

    @property
    def dim(self) -> int:
        return self.weight.shape[0]

    def predict(self, x: np.ndarray) -> np.ndarray:  # [N, D] -> [N, L, E] float32
        """Predicted expert frequencies of embeddings x [N, D] (or one [D] -> [L, E])."""
        x = np.asarray(x, dtype=np.float32)
        if x.shape[-1] != self.dim:
            raise ValueError(f"embeddings have dimension {x.shape[-1]}, the head expects {self.dim}")
        y = np.clip(x @ self.weight + self.bias, 0.0, 1.0)  # [..., L*E]
        return y.reshape(x.shape[:-1] + (self.num_layers, self.num_experts))

    def save(self, folder: str | Path) -> Path:
        """Write the head to FOLDER/expert_profile_head.npz (no pickles) and return the path."""
        path = Path(folder) / HEAD_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {"num_layers": self.num_layers, "num_experts": self.num_experts, "top_k": self.top_k, "alpha": self.alpha}
        with open(path, "wb") as f:
            np.savez(f, weight=self.weight.astype(np.float32), bias=self.bias.astype(np.float32), meta=np.array(json.dumps(meta)))
        return path


def load_profile_head(folder: str | Path) -> ProfileHead | None:
    """The head saved in an encoder folder, or None when the folder has none."""
    path = Path(folder) / HEAD_FILE
    if not path.is_file():
        return None
    with np.load(path, allow_pickle=False) as z:
        meta = json.loads(str(z["meta"]))
        return ProfileHead(weight=z["weight"], bias=z["bias"], num_layers=int(meta["num_layers"]),
                           num_experts=int(meta["num_experts"]), top_k=int(meta["top_k"]), alpha=float(meta.get("alpha", 0.0)))


def compact(profile: np.ndarray, top: int = COMPACT_TOP) -> list[int]:
    """[L, E] profile -> L * top ints `expert * 256 + q` (see the module docstring)."""
    p = np.clip(np.asarray(profile, dtype=np.float64), 0.0, 1.0)  # [L, E]
    top = min(top, p.shape[1])
    ids = np.argsort(-p, axis=1, kind="stable")[:, :top]  # [L, top]
    q = np.rint(np.take_along_axis(p, ids, axis=1) * _LEVELS).astype(np.int64)  # [L, top]
    return (ids * 256 + q).ravel().tolist()


def expand(codes: list[int] | np.ndarray, num_layers: int, num_experts: int) -> np.ndarray:  # [L, E] float32
    """Inverse of `compact` up to quantisation (experts outside each layer's top get 0)."""
    c = np.asarray(codes, dtype=np.int64).reshape(num_layers, -1)  # [L, top]
    ids, q = c // 256, c % 256
    if ids.size and (ids.min() < 0 or ids.max() >= num_experts):
        raise ValueError(f"compact profile names experts outside [0, {num_experts})")
    out = np.zeros((num_layers, num_experts), np.float32)
    np.put_along_axis(out, ids, (q / _LEVELS).astype(np.float32), axis=1)
    return out
