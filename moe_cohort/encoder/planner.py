"""The batch planner: embeddings [N, D] -> an ordered list of batches of at most B requests.

Pipeline (each step is its own module, each a pure numpy/FAISS function, no I/O):

1. cells      partition.balanced_cells: FAISS 2-means bisection into cells of whole batches, so
              the dense steps below stay O(cell_size^2) memory; one cell when N <= cell_size.
2. init       growth.greedy_growth: open a batch with a seed request, add the unassigned request
              nearest to the batch until it holds B (or "bisect": balanced bisection down to B).
3. swaps      swaps.SwapSearch: pairwise swaps between batches while they raise the summed
              within-batch cosine similarity (size-constrained k-means objective).
4. order      ordering.chain_order: nearest-neighbour chain over batch centroids, cell after cell,
              so consecutive batches are similar; the one partial batch (N mod B) goes last.
              ordering.arrange_members: inside a batch, members most like the previous batch
              come first and those most like the next batch last (the seams of continuous batching).

A plan (encoder.plans.Plan) is a list of int64 arrays of request indices:
every request in exactly one batch, no batch over B, at most one batch under B. Deterministic
under `seed`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import numpy as np
from threadpoolctl import threadpool_limits

from moe_cohort.encoder.growth import density_order, greedy_growth
from moe_cohort.encoder.ordering import arrange_members, centroids, chain_order
from moe_cohort.encoder.partition import balanced_cells
from moe_cohort.encoder.plans import Plan
from moe_cohort.encoder.swaps import SwapSearch

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class PlannerConfig:
    """Which planner ideas run, and their limits (the ablation switches them off one by one)."""

    init: Literal["greedy", "bisect"] = "greedy"
    seeds: Literal["density", "random"] = "density"  # order in which greedy growth opens batches
    swaps: bool = True
    order: bool = True
    cell_size: int = 2048  # most requests per dense cell (memory: cell_size^2 float32)
    max_rounds: int = 200  # swap rounds per cell
    min_gain: float = 1e-4  # smallest similarity gain a swap must bring
    blas_threads: int | None = 1  # BLAS threads while planning (None: leave as is); see plan_batches


def plan_batches(x: np.ndarray, batch_size: int, *, seed: int = 0, config: PlannerConfig = PlannerConfig()) -> Plan:
    """Plan batches of at most `batch_size` over embeddings x [N, D] (rows are L2-normalised here).

    BLAS runs on `config.blas_threads` threads: the planner makes thousands of small matrix
    products, where multi-threaded OpenBLAS spins more than it computes on a busy host
    (docs/results.md).
    """
    x = _checked(x, batch_size)
    if len(x) == 0:
        return []
    with threadpool_limits(limits=config.blas_threads, user_api="blas"):
        return _plan(x, batch_size, seed, config)


def _plan(x: np.ndarray, batch_size: int, seed: int, config: PlannerConfig) -> Plan:
    rng = np.random.default_rng(seed)
    cells = balanced_cells(x, batch_size, max(config.cell_size, batch_size), seed=seed)
    per_cell = [[cell[b] for b in _plan_cell(x[cell], batch_size, rng, config)] for cell in cells]
    plan = _ordered(x, per_cell) if config.order else [b for bs in per_cell for b in bs]
    plan = [b for b in plan if len(b) == batch_size] + [b for b in plan if len(b) < batch_size]  # partial last
    plan = arrange_members(x, plan) if config.order else [np.sort(b) for b in plan]
    log.info("planned %d requests into %d batches of <= %d (%d cells)", len(x), len(plan), batch_size, len(cells))
    return plan


def _plan_cell(x: np.ndarray, batch_size: int, rng: np.random.Generator, config: PlannerConfig) -> list[np.ndarray]:
    """Batches over one cell x [n, D], as index arrays into the cell."""
    sim = x @ x.T  # [n, n] cosine similarity
    if config.init == "greedy":
        seeds = density_order(sim, batch_size) if config.seeds == "density" else rng.permutation(len(x))
        batches = greedy_growth(sim, batch_size, seeds)
    elif config.init == "bisect":
        batches = balanced_cells(x, batch_size, batch_size, seed=int(rng.integers(1 << 31)))
    else:
        raise ValueError(f"unknown init {config.init!r}; expected 'greedy' or 'bisect'")
    if config.swaps and len(batches) > 1:
        batches = _swap_refined(sim, batches, batch_size, config)
    return batches


def _swap_refined(sim: np.ndarray, batches: list[np.ndarray], batch_size: int, config: PlannerConfig) -> list[np.ndarray]:
    search = SwapSearch(sim, batches, batch_size, min_gain=config.min_gain)
    refined = search.run(config.max_rounds)
    log.debug("cell of %d: %d swaps in %d rounds, similarity gain %.2f", len(sim), search.swaps, search.rounds, search.gained)
    return refined


def _ordered(x: np.ndarray, per_cell: list[list[np.ndarray]]) -> Plan:
    """Chain the batches inside every cell, each chain starting next to the previous cell's end."""
    plan: Plan = []
    for batches in per_cell:
        c = centroids(x, batches)  # [nb, D]
        start = None if not plan else int(np.argmax(c @ centroids(x, plan[-1:])[0]))
        plan.extend(batches[i] for i in chain_order(c, start))
    return plan


def _checked(x: np.ndarray, batch_size: int) -> np.ndarray:
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"embeddings must be a 2-D array [N, D], got shape {list(x.shape)}")
    if not np.isfinite(x).all():
        raise ValueError("embeddings contain NaN or infinite values")
    norms = np.linalg.norm(x, axis=1, keepdims=True)  # [N, 1]
    return x / np.where(norms > 0, norms, 1.0)  # cosine similarity from here on; zero rows stay zero
