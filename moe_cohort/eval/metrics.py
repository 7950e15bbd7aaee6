"""Compare batching plans on recorded traces: loads, saving against random, capture of the oracle.

saving(plan)  = 1 - decode_loads(plan) / mean decode_loads(random plans)
capture(plan) = saving(plan) / saving(greedy oracle)
Decode loads are the headline (decode is the memory-bound phase); prefill loads are reported beside them.
"""

from __future__ import annotations

import logging
from typing import Callable, Mapping

import numpy as np

from moe_cohort.eval.oracle import greedy_oracle
from moe_cohort.encoder.plans import Plan, arrival_plan, validate_plan
from moe_cohort.eval.plans import category_plan, random_plan
from moe_cohort.traces.format import TraceSet
from moe_cohort.traces.loads import ExpertMasks, expert_masks, plan_loads

log = logging.getLogger(__name__)

# A planner builds a plan for (traces, batch_size); extra plans such as the encoder's plug in here.
Planner = Callable[[TraceSet, int], Plan]


def baseline_plans(ts: TraceSet, batch_size: int) -> dict[str, Plan]:
    """Arrival order, and category order when the traces carry categories."""
    plans = {"arrival": arrival_plan(len(ts), batch_size)}
    if ts.categories is not None:
        plans["category"] = category_plan(ts.categories, batch_size)
    return plans


def evaluate(ts: TraceSet, batch_size: int, *, masks: ExpertMasks | None = None, seeds: int = 5,
             plans: Mapping[str, Plan] | None = None, planners: Mapping[str, Planner] | None = None) -> dict:
    """Evaluate random (mean over `seeds`), the baselines, `plans`, `planners` and the oracle.

    Returns {"batch_size", "decode_steps", "decode_mode", "num_requests", "plans": {name: {...}}}.
    """
    masks = masks if masks is not None else expert_masks(ts)
    randoms = [plan_loads(masks, random_plan(len(ts), batch_size, seed)) for seed in range(seeds)]
    named = {**baseline_plans(ts, batch_size), **(plans or {})}
    for name, planner in (planners or {}).items():
        named[name] = planner(ts, batch_size)
    named["oracle"] = greedy_oracle(masks.flat(), batch_size)
    ref = float(np.mean([r.decode for r in randoms]))
    rows = {"random": _row(float(np.mean([r.decode for r in randoms])), float(np.mean([r.prefill for r in randoms])), ref)}
    rows["random"]["decode_loads_std"] = float(np.std([r.decode for r in randoms]))
    rows["random"]["seeds"] = seeds
    for name, plan in named.items():
        validate_plan(plan, len(ts), batch_size)
        loads = plan_loads(masks, plan)
        rows[name] = _row(loads.decode, loads.prefill, ref)
    oracle_saving = rows["oracle"]["saving"]
    for row in rows.values():
        row["capture"] = row["saving"] / oracle_saving if oracle_saving > 0 else 0.0
    log.info("evaluated %d plans at batch size %d", len(rows), batch_size)
    return {"batch_size": batch_size, "decode_steps": masks.decode_steps, "decode_mode": masks.decode_mode,
            "num_requests": len(ts), "plans": rows}


def _row(decode: float, prefill: float, random_decode: float) -> dict:
    return {"decode_loads": int(round(decode)), "prefill_loads": int(round(prefill)),
            "saving": 1.0 - decode / random_decode if random_decode else 0.0}
