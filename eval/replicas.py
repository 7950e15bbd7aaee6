"""Replay of R continuous-batching replicas (data parallel) behind one router (admission.router).

The execution model and decode tokens of eval.replay, per replica: replica r keeps up to S
requests resident, each emits one token per step, and a step of replica r loads, per MoE layer,
the distinct experts of r's own residents. All replicas step together; a freed slot is filled at
once by the router (`admission.router.ReplicaRouter`: round-robin, least-loaded or affinity).
Loads per generated token are summed over every replica's steps, and so is the modelled MoE time
(eval.cost, per replica step at that replica's tokens): the GPU time of all replicas together.

The load bound is checked here, independently of the router: after every fill, a span in which
some replica has a free slot while an arrived request still waits counts its steps as
violations. A routing with one shared pool (least-loaded, affinity) must have none: the replay
raises RuntimeError if it does. With R = 1 the replay is eval.replay.replay, span for span.

    summary = evaluate_replicas(tokens, 4, 16, {"affinity": Routing("affinity", profiles)}, lengths, cost, L)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np
from threadpoolctl import threadpool_limits

from moe_cohort.admission.resident import ResidentEmbedding, ResidentExperts
from moe_cohort.admission.router import ReplicaRouter
from moe_cohort.eval.cost import CostModel
from moe_cohort.eval.engine import Lengths, non_moe_us_per_step, summary_row
from moe_cohort.eval.replay import DecodeTokens, Replay, span_loads

log = logging.getLogger(__name__)
BOUNDED = ("least-loaded", "affinity")  # routings that share one pool: no replica idles while another queues


@dataclass(frozen=True)
class ReplicaReplay(Replay):
    """moe_cohort.eval.replay.Replay's spans (one per replica and span of steps) plus where and how evenly requests ran."""

    replica: np.ndarray  # [N] the replica that served each request
    violations: int  # steps in which some replica had a free slot while a request waited
    makespan: int  # steps until the last request finished


@dataclass(frozen=True)
class Routing:
    """How requests reach the replicas: a routing of admission.router and what it fits requests by."""

    routing: str  # "round-robin", "least-loaded" or "affinity"
    vectors: np.ndarray | None = None  # [N, F] flat expert profiles [L*E], or embeddings [D] (affinity)
    embedding: bool = False  # vectors are embeddings (nearest-embedding fit), not expert profiles
    shuffle: bool = False  # requests arrive in a random order of the seed (the random baseline), else trace order

    def run(self, tokens: DecodeTokens, lengths: np.ndarray, slots: list[int], seed: int = 0,
            max_wait: float | None = None, times: np.ndarray | None = None) -> ReplicaReplay:
        """One replay; `times` [N] sorted arrival steps, taken by the requests in arrival order (None: all at 0)."""
        order = np.random.default_rng(seed).permutation(len(tokens)) if self.shuffle else np.arange(len(tokens))
        arrivals = None
        if times is not None:
            arrivals = np.empty(len(order), np.int64)
            arrivals[order] = times  # the k-th request of the order arrives at times[k]
        vectors, factory = self.vectors, lambda size: ResidentExperts(1, size)
        if self.embedding:  # unit rows, as ResidentEmbedding scores them
            norms = np.linalg.norm(vectors, axis=1, keepdims=True)
            vectors, factory = vectors / np.where(norms > 0, norms, 1.0), ResidentEmbedding
        router = ReplicaRouter(slots, self.routing, max_wait=max_wait, resident_factory=factory)
        return replay_replicas(tokens, lengths, router, vectors=vectors, order=order, arrivals=arrivals)


def replay_replicas(tokens: DecodeTokens, lengths: np.ndarray, router: ReplicaRouter, *,
                    vectors: np.ndarray | None = None, order: np.ndarray | None = None,
                    arrivals: np.ndarray | None = None) -> ReplicaReplay:
    """Run every request through the router's replicas; `lengths` [N] >= 1, `vectors` [N, F] or None,
    `order` [N] the order in which requests arriving at the same step join, `arrivals` [N] steps."""
    n = len(lengths)
    arrivals = np.zeros(n, np.int64) if arrivals is None else np.asarray(arrivals, np.int64)
    order = np.arange(n) if order is None else np.asarray(order, np.int64)
    pending = order[np.argsort(arrivals[order], kind="stable")]  # [N] by arrival, ties in `order`
    slot_rep = np.repeat(np.arange(router.replicas), router.capacity)  # [S_total] replica of each slot
    slot_req, slot_t = np.full(len(slot_rep), -1, np.int64), np.zeros(len(slot_rep), np.int64)
    start, served, admitted = np.full(n, -1, np.int64), np.full(n, -1, np.int64), []
    spans: list[tuple[int, int, int]] = []
    now = head = finished = violations = 0
    while finished < n:
        while head < n and arrivals[pending[head]] <= now:
            r = int(pending[head])
            router.add(r, None if vectors is None else vectors[r], now)
            head += 1
        for key, rep in router.admit(now):
            slot = int(np.flatnonzero((slot_rep == rep) & (slot_req < 0))[0])
            slot_req[slot], slot_t[slot], start[key], served[key] = key, 0, now, rep
            admitted.append(key)
        busy = slot_req >= 0  # [S_total]
        if not busy.any():
            now = int(arrivals[pending[head]])
            continue
        rows = np.flatnonzero(busy)
        span = int((lengths[slot_req[rows]] - slot_t[rows]).min())
        if head < n and not busy.all():
            span = min(span, max(int(arrivals[pending[head]]) - now, 1))
        if not busy.all() and head > len(admitted):  # a free slot while an arrived request waits
            violations += span
        for rep in range(router.replicas):
            mine = rows[slot_rep[rows] == rep]
            if len(mine):
                spans.append((span, len(mine), span_loads(tokens, slot_req[mine], slot_t[mine], span)))
        now += span
        slot_t[rows] += span
        for slot in rows[slot_t[rows] >= lengths[slot_req[rows]]]:
            router.release(int(slot_req[slot]))
            slot_req[slot] = -1
            finished += 1
    if violations and router.routing in BOUNDED:
        raise RuntimeError(f"{router.routing}: a replica had a free slot while requests waited for {violations} steps")
    k = np.array(spans, dtype=np.int64).reshape(-1, 3)
    return ReplicaReplay(steps=k[:, 0], resident=k[:, 1], loads=k[:, 2], start=start, order=np.array(admitted, np.int64),
                         replica=served, violations=violations, makespan=now)


def evaluate_replicas(tokens: DecodeTokens, replicas: int, slots: int, routings: Mapping[str, Routing], lengths: Lengths,
                      cost: CostModel, num_layers: int, *, seeds: int = 5, random_draws: int = 4,
                      max_wait: float | None = None, arrivals: Callable[[int], np.ndarray] | None = None) -> dict:
    """Every routing and the random baseline (least-loaded, random arrival order) over `seeds` seeds.

    Rows as eval.engine.evaluate_continuous's (loads_per_token, saving vs random, saving_std,
    moe_us_per_token, step_us_per_token, ...) plus `violations` (steps, summed over the runs),
    `makespan` (steps to finish, mean) and `capture` against the row named "affinity-reference"."""
    sizes = [slots] * replicas
    random = Routing("least-loaded", shuffle=True)
    runs: dict[str, list[list[ReplicaReplay]]] = {"random": []}
    with threadpool_limits(limits=1, user_api="blas"):
        for seed in range(seeds):
            lens, times = lengths(seed), None if arrivals is None else arrivals(seed)
            runs["random"].append([random.run(tokens, lens, sizes, seed * random_draws + j, max_wait, times)
                                   for j in range(random_draws)])
            for name, routing in routings.items():
                runs.setdefault(name, []).append([routing.run(tokens, lens, sizes, seed, max_wait, times)])
    rows = {name: summary_row(rs, runs["random"], cost, num_layers) for name, rs in runs.items()}
    non_moe = non_moe_us_per_step(rows["random"], cost)
    ref = rows.get("affinity-reference", {}).get("saving", 0.0)
    for name, row in rows.items():
        flat = [r for group in runs[name] for r in group]
        row["violations"] = int(sum(r.violations for r in flat))
        row["makespan"] = float(np.mean([r.makespan for r in flat]))
        row["capture"] = row["saving"] / ref if ref > 0 else 0.0
        row["step_us_per_token"] = row["moe_us_per_token"] + non_moe * row["steps_per_token"]
        row["seeds"] = seeds
    log.info("replica replay R = %d x S = %d: %d routings x %d seeds", replicas, slots, len(rows), seeds)
    return {"engine": "continuous", "replicas": replicas, "slots": slots, "num_requests": len(tokens),
            "decode_mode": tokens.mode, "cost_model": cost.name, "non_moe_us_per_step": non_moe, "plans": rows}


def poisson_arrivals(n: int, rate: float, seed: int) -> np.ndarray:  # [N] sorted int64 steps, the first at 0
    """Arrival steps of a Poisson process of `rate` requests per step (e.g. load * R * S / mean length)."""
    gaps = np.random.default_rng([seed, 104729]).exponential(1.0 / rate, n)  # [N]
    return np.floor(np.cumsum(gaps) - gaps[0]).astype(np.int64)

def routings_for(names: str, *, predicted: np.ndarray | None = None, embeddings: np.ndarray | None = None,
                 reference: np.ndarray | None = None) -> dict[str, Routing]:
    """The rows of `names` ("round-robin", "least-loaded", "affinity" or "all"): affinity by the predicted
    profiles [N, L*E] (else nearest embedding [N, D]), and affinity-reference by the traces' own [N, L*E]."""
    wanted = ("round-robin", "least-loaded", "affinity") if names == "all" else (names,)
    out = {name: Routing(name) for name in wanted if name != "affinity"}
    if "affinity" in wanted:
        if predicted is not None:
            out["affinity"] = Routing("affinity", predicted)
        elif embeddings is not None:
            out["affinity-nearest"] = Routing("affinity", embeddings, embedding=True)
        if reference is not None:
            out["affinity-reference"] = Routing("affinity", reference)
    return out


def evaluate_with_single(tokens: DecodeTokens, replicas: int, slots: int, routings: Mapping[str, Routing],
                         lengths: Lengths, cost: CostModel, num_layers: int, **options) -> dict:
    """evaluate_replicas, plus for reference one engine of R*S slots admitting by the same affinity rows:
    rows "single-<name> (1xRS)", each saving against that engine's own random order."""
    result = evaluate_replicas(tokens, replicas, slots, routings, lengths, cost, num_layers, **options)
    alike = {k: v for k, v in routings.items() if v.routing == "affinity"}
    if replicas > 1 and alike:
        single = evaluate_replicas(tokens, 1, replicas * slots, alike, lengths, cost, num_layers, **options)
        for name, row in single["plans"].items():
            if name != "random":
                result["plans"][f"single-{name.removeprefix('affinity-')} (1x{replicas * slots})"] = row
    return result


HEADER = (f"{'routing':<22} {'loads/tok':>9} {'saving':>7} {'std':>6} {'capture':>8} {'MoE us/tok':>10} "
          f"{'step us/tok':>11} {'makespan':>8} {'idle-while-queued':>17}")


def format_replica_table(result: dict) -> str:
    """One row per routing of evaluate_replicas."""
    lines = [f"R = {result['replicas']} replicas x S = {result['slots']} slots, {result['num_requests']} requests "
             f"({result['decode_mode']} decode), cost model {result['cost_model']}; saving vs random order, "
             f"capture vs affinity-reference; makespan and idle-while-queued in steps", HEADER]
    for name, r in result["plans"].items():
        lines.append(f"{name:<22} {r['loads_per_token']:>9.2f} {r['saving']:>7.1%} {r['saving_std']:>6.1%} "
                     f"{r['capture']:>8.1%} {r['moe_us_per_token']:>10.1f} {r['step_us_per_token']:>11.1f} "
                     f"{r['makespan']:>8.0f} {r['violations']:>17d}")
    return "\n".join(lines)

