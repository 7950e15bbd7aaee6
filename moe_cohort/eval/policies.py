"""Admission policies as the engine replay runs them: settings of the one admission rule, ReplicaRouter.

A `Policy` names a routing of `admission.router.ReplicaRouter` and what it fits requests by, and
`run` replays it (eval.replay) through a router built fresh for that run, so the replay admits exactly
as the proxy serves (send/replicas.py drives the same router) and as a batch file is ordered:

- order policies (`random_order`, `fixed_order`): first come, first served ("least-loaded"), the
  requests that arrive together joining in a fixed order: random, trace order, or a static plan's
  batches one after another;
- `by_profile`: fewest expected new experts given the residents' expert profiles [L*E]
  (admission.resident.ResidentExperts). With the traces' own profiles it is the reference (what
  `capture` divides by); with profiles predicted from text (encoder.profile.ProfileHead) it is a text policy;
- `by_embedding`: nearest embedding to the resident set (text only; ResidentEmbedding);
- `Policy("round-robin")`: bound to a replica's own FCFS queue on arrival.

Every rule of the router holds in the replay as served: the fairness bound first, FCFS for a request
without a vector, the oldest when nobody is resident (an empty set ranks nobody), ties to the earliest
arrival.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from moe_cohort.admission.resident import ResidentEmbedding, ResidentExperts
from moe_cohort.admission.router import ReplicaRouter, ResidentFactory
from moe_cohort.eval.replay import DecodeTokens, Replay, replay


@dataclass(frozen=True)
class Policy:
    """A routing of admission.router and what it fits requests by, as one replay runs it."""

    routing: str  # "round-robin", "least-loaded" (first come, first served) or "affinity"
    vectors: np.ndarray | None = field(default=None, repr=False)  # [N, F] flat profiles [L*E] or embeddings [D]
    embedding: bool = False  # vectors are embeddings (nearest-embedding fit), not expert profiles
    shuffle: bool = False  # requests that arrive together join in a random order of the run's seed
    order: np.ndarray | None = field(default=None, repr=False)  # [N] else in this order (None: trace order)

    def router(self, slots: Sequence[int], max_wait: float | None = None, seed: int = 0) -> ReplicaRouter:
        """A fresh router of replicas with `slots` slots each, with this policy's resident sets; `seed` is the
        run's (none of ROUTINGS draws; a subclass's router may)."""
        return ReplicaRouter(slots, self.routing, max_wait=max_wait, resident_factory=self.resident_factory())

    def resident_factory(self) -> ResidentFactory:
        """Empty resident sets of this policy's kind: embeddings or expert profiles."""
        return ResidentEmbedding if self.embedding else (lambda size: ResidentExperts(1, size))

    def run(self, tokens: DecodeTokens, lengths: np.ndarray, slots: int | Sequence[int], seed: int = 0,
            max_wait: float | None = None, times: np.ndarray | None = None, clients: int | None = None) -> Replay:
        """One replay of replicas of `slots` slots (an int: one engine); `times` [N] sorted arrival steps,
        taken by the requests in their joining order (None: all at step 0), or `clients` closed-loop
        clients sending them in that order (eval.replay); `max_wait` in steps."""
        n = len(tokens)
        order = np.random.default_rng(seed).permutation(n) if self.shuffle else self.order
        order = np.arange(n) if order is None else np.asarray(order, np.int64)
        arrivals = None
        if times is not None:
            arrivals = np.empty(n, np.int64)
            arrivals[order] = times  # the k-th request of the order arrives at times[k]
        router = self.router([slots] if isinstance(slots, int) else slots, max_wait, seed)
        return replay(tokens, lengths, router, vectors=self.vectors, order=order, arrivals=arrivals, clients=clients)


def random_order() -> Policy:
    """First come, first served in a random order of each run's seed (the yardstick of every saving)."""
    return Policy("least-loaded", shuffle=True)


def fixed_order(order: Sequence[int]) -> Policy:
    """First come, first served in `order` (trace order, or a static plan's batches one after another)."""
    return Policy("least-loaded", order=np.asarray(order, np.int64))


def by_profile(profiles: np.ndarray) -> Policy:
    """Fewest expected new experts by per-request expert profiles [N, L, E] (or flat [N, L*E])."""
    flat = np.ascontiguousarray(np.asarray(profiles).reshape(len(profiles), -1), dtype=np.float32)  # [N, L*E]
    return Policy("affinity", flat)


def by_embedding(x: np.ndarray) -> Policy:
    """Nearest embedding [N, D] to the resident set (rows made unit, as ResidentEmbedding scores them)."""
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return Policy("affinity", (x / np.where(norms > 0, norms, 1.0)).astype(np.float32), embedding=True)
