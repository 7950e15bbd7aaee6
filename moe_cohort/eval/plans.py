"""The baseline planners (random, category); the plan type and its helpers live in encoder.plans."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from moe_cohort.encoder.plans import Plan, chunk


def random_plan(num_requests: int, batch_size: int, seed: int) -> Plan:
    """Batches of a random permutation."""
    return chunk(np.random.default_rng(seed).permutation(num_requests), batch_size)


def category_plan(categories: Sequence[str], batch_size: int) -> Plan:
    """Requests sorted by category (stable: arrival order inside a category), then cut."""
    return chunk(np.argsort(np.asarray(categories), kind="stable"), batch_size)
