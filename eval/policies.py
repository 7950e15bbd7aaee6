"""Admission policies as the engine replay drives them (eval.replay.Policy), over admission.resident.

Every policy is built fresh per replay by a factory `seed -> Policy`:

- order policies: a fixed admission order (random, arrival, a static plan's batches one after
  another); the next waiting request in that order takes the slot;
- `ProfilePolicy`: fewest expected new experts given the residents' expert profiles
  (admission.resident.ResidentExperts). With the traces' own profiles it is the reference (issue
  13, 2c); with profiles predicted from text (encoder.profile.ProfileHead) it is a text policy;
- `EmbeddingPolicy`: nearest embedding to the resident set (text only).
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from moe_cohort.admission.resident import ResidentEmbedding, ResidentExperts
from moe_cohort.eval.replay import Policy

PolicyFactory = Callable[[int], Policy]


class OrderPolicy:
    """Admit the waiting request that comes first in a fixed order."""

    def __init__(self, order: Sequence[int]):
        order = np.asarray(order, dtype=np.int64)
        self.rank = np.empty(len(order), np.int64)  # [N] position of each request in the order
        self.rank[order] = np.arange(len(order))

    def choose(self, waiting: np.ndarray) -> int:
        return int(np.argmin(np.where(waiting, self.rank, np.iinfo(np.int64).max)))

    def admit(self, request: int) -> None:
        pass

    def release(self, request: int) -> None:
        pass


class ProfilePolicy:
    """Fewest expected new experts per step, from per-request expert profiles [N, L, E]."""

    def __init__(self, profiles: np.ndarray):
        n, layers, experts = profiles.shape
        self.flat = np.ascontiguousarray(profiles.reshape(n, -1), dtype=np.float32)  # [N, L*E]
        self.state = ResidentExperts(layers, experts)

    def choose(self, waiting: np.ndarray) -> int:
        return self.state.pick(self.flat, waiting)

    def admit(self, request: int) -> None:
        self.state.admit(self.flat[request])

    def release(self, request: int) -> None:
        self.state.release(self.flat[request])


class EmbeddingPolicy:
    """Nearest embedding [N, D] to the resident set."""

    def __init__(self, x: np.ndarray):
        norms = np.linalg.norm(x, axis=1, keepdims=True)
        self.x = (x / np.where(norms > 0, norms, 1.0)).astype(np.float32)  # [N, D] unit rows
        self.state = ResidentEmbedding(x.shape[1])

    def choose(self, waiting: np.ndarray) -> int:
        return self.state.pick(self.x, waiting)

    def admit(self, request: int) -> None:
        self.state.admit(self.x[request])

    def release(self, request: int) -> None:
        self.state.release(self.x[request])


def random_order(n: int) -> PolicyFactory:
    return lambda seed: OrderPolicy(np.random.default_rng(seed).permutation(n))


def fixed_order(order: Sequence[int]) -> PolicyFactory:
    return lambda seed: OrderPolicy(order)


def by_profile(profiles: np.ndarray) -> PolicyFactory:
    return lambda seed: ProfilePolicy(profiles)


def by_embedding(x: np.ndarray) -> PolicyFactory:
    return lambda seed: EmbeddingPolicy(x)
