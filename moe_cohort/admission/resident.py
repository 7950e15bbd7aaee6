"""Admission: when an engine slot frees, which waiting request should take it.

vLLM keeps S requests resident and every resident request emits one token per step; a step
loads, per MoE layer, every expert that any resident token picks. What we control is which
requests are resident together. A resident set (`Resident`) holds the resident requests'
vectors (`add` when one takes a slot, `remove` when it frees) and gives every waiting candidate
one cost, lower is better, which the waiting pool (admission.waiting) minimises. Pure numpy:

- `ResidentExperts`: the resident requests' per-layer expert frequencies u_r[l, e] (the fraction
  of r's tokens that pick e at layer l; from traces, or predicted from text by
  encoder.profile.ProfileHead). If every resident token picks independently, expert e of layer
  l is idle in a step with probability m[l, e] = prod_r (1 - u_r[l, e]), so a newcomer c adds
  u_c . m new experts per step in expectation: that is its cost. The state is the sum over
  residents of -log(1 - u_r) (additive: `add` adds, `remove` subtracts), so the costs of a pool
  of n are one [n, L*E] x [L*E] product.
- `ResidentEmbedding`: for when only the text encoder is at hand; a candidate's cost is minus its
  cosine with the sum of the residents' unit embeddings, so the nearest embedding costs least.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

_CLIP = 1e-3  # u is clipped to [0, 1 - _CLIP]: an always-used expert must not make -log(1 - u) infinite


class Resident(Protocol):
    """The requests resident on one engine, as the waiting pool ranks candidates against them."""

    count: int  # residents held

    @property
    def size(self) -> int:
        """Length of the flat vectors it holds and scores ([L*E] profiles, [D] embeddings)."""

    def add(self, vector: np.ndarray) -> None:
        """A request with `vector` became resident."""

    def remove(self, vector: np.ndarray) -> None:
        """A resident added with the same `vector` left."""

    def cost(self, vectors: np.ndarray) -> np.ndarray:  # [n], lower is better
        """What each candidate of `vectors` [n, size] would cost the resident set if it joined now."""


class ResidentExperts:
    """Resident per-layer expert frequencies; a candidate costs the experts per step it is expected to add."""

    def __init__(self, num_layers: int, num_experts: int):
        self.shape = (num_layers, num_experts)
        self.log_idle = np.zeros(num_layers * num_experts, dtype=np.float64)  # [L*E] sum_r -log(1 - u_r)
        self.count = 0

    @property
    def size(self) -> int:
        return self.shape[0] * self.shape[1]

    def add(self, profile: np.ndarray) -> None:
        """Add a resident with expert frequencies `profile` [L, E] (or flat [L*E])."""
        self.log_idle += _neg_log_miss(profile)
        self.count += 1

    def remove(self, profile: np.ndarray) -> None:
        """Remove a resident added with the same `profile`."""
        self.log_idle -= _neg_log_miss(profile)
        self.count -= 1
        if self.count == 0:
            self.log_idle[:] = 0.0  # no drift survives an empty set

    def idle(self) -> np.ndarray:  # [L*E]
        """Probability that each (layer, expert) is used by no resident token in a step (below 1e-30: 0,
        so float32 products never meet denormals, which x86 computes far more slowly)."""
        idle = np.exp(-self.log_idle)
        idle[idle < 1e-30] = 0.0
        return idle

    def cost(self, profiles: np.ndarray) -> np.ndarray:  # [n], lower is better
        """Expected experts per step that each candidate of `profiles` [n, L, E] (or [n, L*E]) adds to the
        resident set."""
        return _flat(profiles) @ self.idle().astype(np.float32)


class ResidentEmbedding:
    """Resident unit embeddings; a candidate costs minus its cosine with their sum (the nearest costs least)."""

    def __init__(self, dim: int):
        self.total = np.zeros(dim, dtype=np.float64)  # [D] sum of resident unit embeddings
        self.count = 0

    @property
    def size(self) -> int:
        return len(self.total)

    def add(self, x: np.ndarray) -> None:
        self.total += _unit(x)
        self.count += 1

    def remove(self, x: np.ndarray) -> None:
        self.total -= _unit(x)
        self.count -= 1
        if self.count == 0:
            self.total[:] = 0.0

    def cost(self, xs: np.ndarray) -> np.ndarray:  # [n], lower is better
        """Minus the cosine of every candidate xs [n, D] (unit rows) with the resident sum (0 when nobody is
        resident)."""
        norm = np.linalg.norm(self.total)
        if norm == 0:
            return np.zeros(len(xs), np.float32)
        return -(xs @ (self.total / norm).astype(np.float32))


def _flat(profiles: np.ndarray) -> np.ndarray:  # [n, L, E] or [n, L*E] -> [n, L*E]
    return profiles.reshape(len(profiles), -1)


def _neg_log_miss(profile: np.ndarray) -> np.ndarray:  # [L, E] -> [L*E] float64
    return -np.log1p(-np.clip(np.asarray(profile, dtype=np.float64).ravel(), 0.0, 1.0 - _CLIP))


def _unit(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    n = np.linalg.norm(x)
    return x / n if n > 0 else x
