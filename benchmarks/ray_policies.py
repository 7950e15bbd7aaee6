"""Ray Serve's routers as replay policies (eval.policies.Policy over benchmarks.ray_routers.RayRouter) and the
rows of bench_replicas: ours beside "power-of-two", "prefix" and each routing that binds on arrival with
"+inside" (each replica admitting from its own queue by the predicted profiles, as our scheduler in vLLM).

A `RayPolicy` runs as any Policy; with `texts`, request i (eval.replay adds keys 0..N-1) arrives with texts[i]
as its prefix, and the run's seed seeds power-of-two's draws.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from benchmarks.ray_routers import RAY_ROUTINGS, RayRouter
from moe_cohort.eval.policies import Policy
from moe_cohort.eval.replicas import routings_for as our_routings


@dataclasses.dataclass(frozen=True)
class RayPolicy(Policy):
    """A Policy whose routing may be one of RAY_ROUTINGS, with prompt `texts` and `inside`."""

    texts: Sequence[str] | None = dataclasses.field(default=None, repr=False)  # [N] prompt texts ("prefix" reads them)
    inside: bool = False  # a routing that binds on arrival, each replica admitting from its queue by fit (vectors)

    def router(self, slots: Sequence[int], max_wait: float | None = None, seed: int = 0) -> RayRouter:
        options = dict(max_wait=max_wait, resident_factory=self.resident_factory(), rng=np.random.default_rng(seed),
                       inside=self.inside)
        return RayRouter(slots, self.routing, **options) if self.texts is None else _TextRouter(
            self.texts, slots, self.routing, **options)


def by_prefix(texts: Sequence[str]) -> RayPolicy:
    """Ray Serve LLM's prefix-cache affinity by the requests' prompt texts [N] (ray_routers' "prefix")."""
    return RayPolicy("prefix", texts=tuple(str(t) for t in texts))


def routings_for(names: str, *, predicted: np.ndarray | None = None, embeddings: np.ndarray | None = None,
                 reference: np.ndarray | None = None, texts: Sequence[str] | None = None) -> dict[str, Policy]:
    """The rows of `names` in their order, affinity's last: eval.replicas.routings_for's, and "power-of-two",
    "prefix" (by the prompt `texts` [N]) or "ROUTING+inside" for a routing that binds on arrival (by the
    predicted profiles [N, L*E])."""
    wanted = ("round-robin", "least-loaded", "affinity") if names == "all" else tuple(names.split(","))
    if any(name.startswith("prefix") for name in wanted) and texts is None:
        raise ValueError("the prefix routing needs the requests' texts")
    if any(name.endswith("+inside") for name in wanted) and predicted is None:
        raise ValueError("admission inside each replica needs predicted profiles")
    ours = [name for name in wanted if name not in RAY_ROUTINGS and not name.endswith("+inside")]
    rows = our_routings(",".join(ours), predicted=predicted, embeddings=embeddings, reference=reference) if ours else {}
    out = {name: rows[name] if name in rows else _bound_on_arrival(name, predicted, texts)
           for name in wanted if name != "affinity"}
    return out | {name: row for name, row in rows.items() if name not in out}


def _bound_on_arrival(name: str, predicted: np.ndarray | None, texts: Sequence[str] | None) -> RayPolicy:
    """The RayPolicy of "ROUTING" or "ROUTING+inside"."""
    routing, inside = name.removesuffix("+inside"), name.endswith("+inside")
    base = by_prefix(texts) if routing == "prefix" else RayPolicy(routing)
    if not inside:
        return base
    flat = np.ascontiguousarray(np.asarray(predicted).reshape(len(predicted), -1), dtype=np.float32)  # [N, L*E]
    return dataclasses.replace(base, vectors=flat, inside=True)


class _TextRouter(RayRouter):
    """A router whose requests (keys 0..N-1, as the replay adds them) arrive with their prompt texts as prefixes."""

    def __init__(self, texts: Sequence[str], *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._texts = texts

    def add(self, key, vector, now, prefix=None) -> None:
        super().add(key, vector, now, self._texts[key] if prefix is None else prefix)
