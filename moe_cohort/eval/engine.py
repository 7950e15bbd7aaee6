"""Admission policies in the engine's execution model: the continuous-batching replay, summarised.

For every seed the output lengths are drawn once and every policy (eval.policies: a setting of the
admission router the proxy serves with), and a random admission order of that seed, run through
eval.replay with them, on one engine of S slots. Per policy:

    loads_per_token    loads (distinct experts per layer, summed over layers and steps) / tokens
    saving             1 - loads_per_token / that of random orders with the same lengths, mean over seeds
    saving_std         spread of that saving over the seeds
    capture            saving / saving of the reference admission (the traces' own profiles)
    moe_us_per_token   modelled MoE time (eval.cost) per generated token
    step_us_per_token  the whole step: MoE plus the non-MoE part, per generated token
    tokens_per_s       1e6 / step_us_per_token (one engine, decode only)
    max_queue_steps    the longest any request waited for a slot (all arrive at step 0)

Output lengths: "fixed" (every request `mean` tokens), "lognormal[:SIGMA]" (mean `mean`,
sigma 1 by default, at least 1 token), or a file of per-request lengths (one integer per line
in trace order, or JSON lines {"id", "length"}). Traces with generated tokens use their own.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Callable, Mapping

import numpy as np
from threadpoolctl import threadpool_limits

from moe_cohort.eval.cost import CostModel
from moe_cohort.eval.policies import Policy, random_order
from moe_cohort.eval.replay import DecodeTokens, Replay

log = logging.getLogger(__name__)

DEFAULT_MEAN_LENGTH = 64
REFERENCE = "reference"
Lengths = Callable[[int], np.ndarray]  # seed -> [N] output lengths


def lengths_from_spec(spec: str, request_ids: np.ndarray, mean: int = DEFAULT_MEAN_LENGTH) -> Lengths:
    """seed -> [N] output lengths for "fixed", "lognormal[:SIGMA]" or a FILE (see the module docstring)."""
    n = len(request_ids)
    if spec == "fixed":
        return lambda seed: np.full(n, mean, np.int64)
    if spec.split(":")[0] == "lognormal":
        sigma = float(spec.split(":", 1)[1]) if ":" in spec else 1.0
        if sigma < 0:
            raise ValueError(f"lognormal sigma must be >= 0, got {sigma}")
        return lambda seed: lognormal_lengths(n, mean, sigma, seed)
    fixed = read_lengths(spec, request_ids)
    return lambda seed: fixed


def lognormal_lengths(n: int, mean: float, sigma: float, seed: int) -> np.ndarray:  # [N] int64 >= 1
    """Lognormal output lengths with expectation `mean` (mu = log(mean) - sigma^2 / 2)."""
    z = np.random.default_rng([seed, 7919]).standard_normal(n)
    return np.maximum(np.rint(np.exp(np.log(mean) - sigma**2 / 2 + sigma * z)), 1).astype(np.int64)


def read_lengths(path: str | Path, request_ids: np.ndarray) -> np.ndarray:  # [N] int64
    """Per-request output lengths from a file: integers in trace order, or JSON lines {"id", "length"}."""
    lines = [ln.strip() for ln in Path(path).read_text(encoding="utf-8").splitlines() if ln.strip()]
    if lines and lines[0].startswith("{"):
        by_id = {str(rec["id"]): int(rec["length"]) for rec in map(json.loads, lines)}
        missing = [str(r) for r in request_ids if str(r) not in by_id]
        if missing:
            raise ValueError(f"{path}: no length for {len(missing)} request(s), e.g. id {missing[0]!r}")
        out = np.array([by_id[str(r)] for r in request_ids], np.int64)
    else:
        out = np.array([int(v) for v in lines], np.int64)
        if len(out) != len(request_ids):
            raise ValueError(f"{path}: {len(out)} lengths for {len(request_ids)} requests")
    if (out < 1).any():
        raise ValueError(f"{path}: output lengths must be >= 1")
    return out


def evaluate_continuous(tokens: DecodeTokens, slots: int, policies: Mapping[str, Policy], lengths: Lengths,
                        cost: CostModel, num_layers: int, *, seeds: int = 5, max_wait: float | None = None,
                        random_draws: int = 4, clients: int | None = None, kept_full: bool = False) -> dict:
    """Replay random order and every policy over `seeds` seeds; rows as in the module docstring.
    With `clients`, closed-loop clients send the requests (eval.replay), else all arrive at step 0.
    `kept_full`: loads and modelled time per token (and the saving) over the steps with every slot busy only, as a server
    under steady load runs; not the drain at the end, where the last requests run with free slots beside.

    Each seed's random baseline is the mean of `random_draws` random orders with that seed's
    lengths: on a few hundred requests one random order alone is a noisy yardstick.

    `policies` should hold REFERENCE for `capture`; without it capture is 0. BLAS runs on one
    thread: a replay makes thousands of small products, which extra threads only slow down."""
    runs: dict[str, list[list[Replay]]] = {"random": []}
    shuffled = random_order()
    with threadpool_limits(limits=1, user_api="blas"):
        for seed in range(seeds):
            lens = lengths(seed)
            runs["random"].append([shuffled.run(tokens, lens, slots, seed * random_draws + j, max_wait, clients=clients)
                                   for j in range(random_draws)])
            for name, policy in policies.items():
                runs.setdefault(name, []).append([policy.run(tokens, lens, slots, seed, max_wait, clients=clients)])
    rows = {name: summary_row(rs, runs["random"], cost, num_layers, kept_full) for name, rs in runs.items()}
    non_moe = non_moe_us_per_step(rows["random"], cost)
    ref = rows.get(REFERENCE, {}).get("saving", 0.0)
    for row in rows.values():
        row["capture"] = row["saving"] / ref if ref > 0 else 0.0
        row["step_us_per_token"] = row["moe_us_per_token"] + non_moe * row["steps_per_token"]
        row["tokens_per_s"] = 1e6 / row["step_us_per_token"]
        row["seeds"] = seeds
    log.info("continuous replay at S = %d: %d policies x %d seeds", slots, len(rows), seeds)
    return {"engine": "continuous", "slots": slots, "clients": clients, "kept_full": kept_full, "num_requests": len(tokens),
            "decode_mode": tokens.mode, "cost_model": cost.name, "non_moe_us_per_step": non_moe, "plans": rows}


def summary_row(runs: list[list[Replay]], randoms: list[list[Replay]], cost: CostModel, num_layers: int,
                kept_full: bool = False) -> dict:
    """Means over each seed's replays, then over seeds; the saving is paired with the seed's random baseline
    (loads per token over the steps with every slot busy when `kept_full`)."""
    per_seed = lambda f, rs: np.array([np.mean([f(r) for r in group]) for group in rs])  # noqa: E731  [seeds]
    metric = (lambda r: r.loads_per_token_full) if kept_full else (lambda r: r.loads_per_token)  # noqa: E731
    lpt = per_seed(metric, runs)
    saving = 1.0 - lpt / per_seed(metric, randoms)
    moe = per_seed(lambda r: _per_token(r, kept_full, lambda m: cost.moe_us(r.steps[m], r.resident[m], r.loads[m],
                                                                             num_layers)), runs)
    steps = per_seed(lambda r: _per_token(r, kept_full, lambda m: r.steps[m].sum()), runs)
    return {"loads_per_token": float(lpt.mean()), "saving": float(saving.mean()), "saving_std": float(saving.std()),
            "saving_per_seed": saving.tolist(), "moe_us_per_token": float(moe.mean()), "steps_per_token": float(steps.mean()),
            "max_queue_steps": int(max(r.start.max() for group in runs for r in group))}


def _per_token(r: Replay, kept_full: bool, total: Callable[[np.ndarray], float]) -> float:
    """total(spans) [K] bool -> a sum over those spans, per token generated in them: every span, or with
    `kept_full` those with every slot busy (the time columns then count the same steps as the loads)."""
    spans = r.full if kept_full else np.ones(len(r.steps), bool)  # [K]
    return float(total(spans)) / max(int((r.steps[spans] * r.resident[spans]).sum()), 1)


def non_moe_us_per_step(random_row: dict, cost: CostModel) -> float:
    """Non-MoE us per step: explicit, or (1/share - 1) x the random order's MoE time per step."""
    if cost.non_moe_us is not None:
        return float(cost.non_moe_us)
    moe_per_step = random_row["moe_us_per_token"] / random_row["steps_per_token"]
    return (1.0 / cost.moe_share - 1.0) * moe_per_step
