"""Admission: when an engine slot frees, which waiting request should take it.

vLLM keeps S requests resident and every resident request emits one token per step; a step
loads, per MoE layer, every expert that any resident token picks. What we control is which
requests are resident together. The resident sets here score candidates for the waiting pool
(admission.waiting), pure numpy:

- `ResidentExperts`: the resident requests' per-layer expert frequencies u_r[l, e] (the fraction
  of r's tokens that pick e at layer l; from traces, or predicted from text by
  encoder.profile.ProfileHead). If every resident token picks independently, expert e of layer
  l is idle in a step with probability m[l, e] = prod_r (1 - u_r[l, e]), so a newcomer c adds
  u_c . m new experts per step in expectation. `pick` admits the candidate with the fewest.
  The state is the sum over residents of -log(1 - u_r) (additive: admit adds, release
  subtracts), so one pick over a pool of n is one [n, L*E] x [L*E] product.
- `ResidentEmbedding`: the nearest embedding to the resident set (largest cosine with the sum of
  the residents' unit embeddings), for when only the text encoder is at hand.
"""

from __future__ import annotations

import numpy as np

_CLIP = 1e-3  # u is clipped to [0, 1 - _CLIP]: an always-used expert must not make -log(1 - u) infinite


class ResidentExperts:
    """Resident per-layer expert frequencies, with admit/release, and the expected-new-experts rule."""

    def __init__(self, num_layers: int, num_experts: int):
        self.shape = (num_layers, num_experts)
        self.log_idle = np.zeros(num_layers * num_experts, dtype=np.float64)  # [L*E] sum_r -log(1 - u_r)
        self.count = 0

    def admit(self, profile: np.ndarray) -> None:
        """Add a resident with expert frequencies `profile` [L, E] (or flat [L*E])."""
        self.log_idle += _neg_log_miss(profile)
        self.count += 1

    def release(self, profile: np.ndarray) -> None:
        """Remove a resident admitted with the same `profile`."""
        self.log_idle -= _neg_log_miss(profile)
        self.count -= 1
        if self.count == 0:
            self.log_idle[:] = 0.0  # no drift survives an empty set

    def idle(self) -> np.ndarray:  # [L*E]
        """Probability that each (layer, expert) is used by no resident token in a step (below 1e-30: 0,
        so float32 products never meet denormals, which are ~100x slower on x86)."""
        idle = np.exp(-self.log_idle)
        idle[idle < 1e-30] = 0.0
        return idle

    def scores(self, profiles: np.ndarray) -> np.ndarray:  # [n], lower is better
        """Expected experts per step that each candidate of `profiles` [n, L, E] adds to the resident set."""
        return _flat(profiles) @ self.idle().astype(np.float32)

    def pick(self, profiles: np.ndarray, allowed: np.ndarray | None = None) -> int:
        """Index (into `profiles` [n, L, E]) of the best candidate; `allowed` [n] bool masks the others."""
        return _argbest(self.scores(profiles), allowed, lower=True)


class ResidentEmbedding:
    """Nearest embedding to the resident set: the candidate with the largest cosine with the residents' sum."""

    def __init__(self, dim: int):
        self.total = np.zeros(dim, dtype=np.float64)  # [D] sum of resident unit embeddings
        self.count = 0

    def admit(self, x: np.ndarray) -> None:
        self.total += _unit(x)
        self.count += 1

    def release(self, x: np.ndarray) -> None:
        self.total -= _unit(x)
        self.count -= 1
        if self.count == 0:
            self.total[:] = 0.0

    def scores(self, xs: np.ndarray) -> np.ndarray:  # [n], higher is better
        """Cosine of every candidate xs [n, D] (unit rows) with the resident sum (0 when nobody is resident)."""
        norm = np.linalg.norm(self.total)
        return xs @ (self.total / norm).astype(np.float32) if norm > 0 else np.zeros(len(xs), np.float32)

    def pick(self, xs: np.ndarray, allowed: np.ndarray | None = None) -> int:
        return _argbest(self.scores(xs), allowed, lower=False)


def _argbest(scores: np.ndarray, allowed: np.ndarray | None, *, lower: bool) -> int:
    """First index of the lowest (or highest) score among the allowed ones."""
    s = np.asarray(scores, dtype=np.float64) * (1.0 if lower else -1.0)
    if allowed is not None:
        if not allowed.any():
            raise ValueError("no allowed candidate to pick from")
        s = np.where(allowed, s, np.inf)
    return int(np.argmin(s))


def _flat(profiles: np.ndarray) -> np.ndarray:  # [n, L, E] or [n, L*E] -> [n, L*E]
    return profiles.reshape(len(profiles), -1)


def _neg_log_miss(profile: np.ndarray) -> np.ndarray:  # [L, E] -> [L*E] float64
    return -np.log1p(-np.clip(np.asarray(profile, dtype=np.float64).ravel(), 0.0, 1.0 - _CLIP))


def _unit(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    n = np.linalg.norm(x)
    return x / n if n > 0 else x
