"""Batching plans and the baseline planners.

A plan is an ordered list of batches; a batch is an int64 array of request indices. Every
request appears in exactly one batch and no batch holds more than B requests.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

Plan = list[np.ndarray]


class PlanError(ValueError):
    """A plan breaks the plan invariants; the message names the broken one."""


def validate_plan(plan: Plan, num_requests: int, batch_size: int) -> None:
    """Raise PlanError unless every request 0..N-1 is in exactly one batch of at most `batch_size`."""
    sizes = [len(b) for b in plan]
    if any(s > batch_size for s in sizes):
        raise PlanError(f"batch {int(np.argmax(sizes))} holds {max(sizes)} requests, more than the batch size {batch_size}")
    if any(s == 0 for s in sizes):
        raise PlanError(f"batch {sizes.index(0)} is empty")
    members = np.concatenate(plan) if plan else np.zeros(0, np.int64)
    counts = np.bincount(members, minlength=num_requests) if len(members) else np.zeros(num_requests, np.int64)
    if len(counts) > num_requests or members.min(initial=0) < 0:
        raise PlanError(f"plan refers to request indices outside [0, {num_requests})")
    if (counts != 1).any():
        bad = int(np.flatnonzero(counts != 1)[0])
        raise PlanError(f"request index {bad} appears {int(counts[bad])} times; every request must be in exactly one batch")


def chunk(order: Sequence[int], batch_size: int) -> Plan:
    """Cut an order of requests into consecutive batches of `batch_size` (the last may be short)."""
    order = np.asarray(order, dtype=np.int64)
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def arrival_plan(num_requests: int, batch_size: int) -> Plan:
    """Batches in arrival (file) order."""
    return chunk(np.arange(num_requests), batch_size)


def random_plan(num_requests: int, batch_size: int, seed: int) -> Plan:
    """Batches of a random permutation."""
    return chunk(np.random.default_rng(seed).permutation(num_requests), batch_size)


def category_plan(categories: Sequence[str], batch_size: int) -> Plan:
    """Requests sorted by category (stable: arrival order inside a category), then cut."""
    return chunk(np.argsort(np.asarray(categories), kind="stable"), batch_size)
