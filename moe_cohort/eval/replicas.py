"""R continuous-batching replicas (data parallel) behind one router, summarised: eval.replay per routing.

The execution model and decode tokens of eval.replay: replica r keeps up to S requests resident, and
a freed slot is filled at once by the router (`admission.router.ReplicaRouter`: round-robin,
least-loaded or affinity; eval.policies.Policy says which).
Loads per generated token are summed over every replica's steps, and so is the modelled MoE time
(eval.cost, per replica step at that replica's tokens): the GPU time of all replicas together. The
replay refuses a run of a shared-pool routing in which a replica idled while a request waited (the
load bound); a routing that binds on arrival may break it, and `violations` counts those steps.
With `kept_full`, loads and time per token count only the spans in which a replica had every slot
busy (eval.engine.summary_row), and each row keeps the all-steps figures beside them.

    summary = evaluate_replicas(tokens, 4, 16, {"affinity": by_profile(profiles)}, lengths, cost, L)
"""

from __future__ import annotations

import logging
from typing import Callable, Mapping

import numpy as np
from threadpoolctl import threadpool_limits

from moe_cohort.eval.cost import CostModel
from moe_cohort.eval.engine import Lengths, non_moe_us_per_step, summary_row
from moe_cohort.eval.policies import Policy, by_embedding, by_profile, random_order
from moe_cohort.eval.replay import DecodeTokens, Replay

log = logging.getLogger(__name__)


def evaluate_replicas(tokens: DecodeTokens, replicas: int, slots: int, routings: Mapping[str, Policy], lengths: Lengths,
                      cost: CostModel, num_layers: int, *, seeds: int = 5, random_draws: int = 4,
                      max_wait: float | None = None, arrivals: Callable[[int], np.ndarray] | None = None,
                      kept_full: bool = False) -> dict:
    """Every routing and the random baseline (least-loaded, random arrival order) over `seeds` seeds.

    Rows as eval.engine.evaluate_continuous's (loads_per_token, saving vs random, saving_std,
    saving_per_seed, moe_us_per_token, step_us_per_token, ...) plus `violations` (steps, summed over the
    runs), `makespan` (steps to finish, mean) and `capture` against the row named "affinity-reference".
    With `kept_full` those count the spans of full replicas only (none: loads per token 0, saving nan),
    `full_share` is the share of the tokens generated in them, and `all_steps` holds the row's
    loads_per_token, saving and saving_per_seed over every step. The non-MoE time per step is the
    random order's over every step, with or without `kept_full`."""
    sizes = [slots] * replicas
    random = random_order()
    runs: dict[str, list[list[Replay]]] = {"random": []}
    with threadpool_limits(limits=1, user_api="blas"):
        for seed in range(seeds):
            lens, times = lengths(seed), None if arrivals is None else arrivals(seed)
            runs["random"].append([random.run(tokens, lens, sizes, seed * random_draws + j, max_wait, times)
                                   for j in range(random_draws)])
            for name, routing in routings.items():
                runs.setdefault(name, []).append([routing.run(tokens, lens, sizes, seed, max_wait, times)])
    every = {name: summary_row(rs, runs["random"], cost, num_layers) for name, rs in runs.items()}
    rows = every
    if kept_full:
        with np.errstate(divide="ignore", invalid="ignore"):  # no full span: nan, as the docstring says
            rows = {name: summary_row(rs, runs["random"], cost, num_layers, True) for name, rs in runs.items()}
        for name, rs in runs.items():
            rows[name]["all_steps"] = {k: every[name][k] for k in ("loads_per_token", "saving", "saving_per_seed")}
            shares = [_full_tokens(r) / max(r.tokens, 1) for group in rs for r in group]
            rows[name]["full_share"] = float(np.mean(shares))
    non_moe = non_moe_us_per_step(every["random"], cost)  # the random order's, over every step
    ref = rows.get("affinity-reference", {}).get("saving", 0.0)
    for name, row in rows.items():
        flat = [r for group in runs[name] for r in group]
        row["violations"] = int(sum(r.violations for r in flat))
        row["makespan"] = float(np.mean([r.makespan for r in flat]))
        row["capture"] = row["saving"] / ref if ref > 0 else 0.0
        row["step_us_per_token"] = row["moe_us_per_token"] + non_moe * row["steps_per_token"]
        row["seeds"] = seeds
    log.info("replica replay R = %d x S = %d: %d routings x %d seeds", replicas, slots, len(rows), seeds)
    return {"engine": "continuous", "replicas": replicas, "slots": slots, "kept_full": kept_full,
            "num_requests": len(tokens), "decode_mode": tokens.mode, "cost_model": cost.name,
            "non_moe_us_per_step": non_moe, "plans": rows}


def _full_tokens(r: Replay) -> int:
    """Tokens generated in the spans in which their replica had every slot busy."""
    return int((r.steps[r.full] * r.resident[r.full]).sum())


def routings_for(names: str, *, predicted: np.ndarray | None = None, embeddings: np.ndarray | None = None,
                 reference: np.ndarray | None = None) -> dict[str, Policy]:
    """The rows of `names` (comma-separated: "round-robin", "least-loaded", "affinity", or "all" for the
    three): affinity by the predicted profiles [N, L*E] (else nearest embedding [N, D]), affinity-reference
    by the traces' own [N, L*E]."""
    wanted = ("round-robin", "least-loaded", "affinity") if names == "all" else tuple(names.split(","))
    out = {name: Policy(name) for name in wanted if name != "affinity"}
    if "affinity" in wanted:
        if predicted is not None:
            out["affinity"] = by_profile(predicted)
        elif embeddings is not None:
            out["affinity-nearest"] = by_embedding(embeddings)
        if reference is not None:
            out["affinity-reference"] = by_profile(reference)
    return out


def evaluate_with_single(tokens: DecodeTokens, replicas: int, slots: int, routings: Mapping[str, Policy],
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
    full = result.get("kept_full", False)
    lines = [f"R = {result['replicas']} replicas x S = {result['slots']} slots, {result['num_requests']} requests "
             f"({result['decode_mode']} decode), cost model {result['cost_model']}; saving vs random order, "
             f"capture vs affinity-reference; makespan and idle-while-queued in steps"
             + ("; per token over full replicas' steps (full tok: their share of the tokens), all-steps beside"
                if full else ""),
             HEADER + (f" {'full tok':>8} {'all-steps lpt':>13} {'saving':>7}" if full else "")]
    for name, r in result["plans"].items():
        if full and not np.isfinite(r["saving"]):  # this row or random had no full replica's span to count
            line = (f"{name:<22} {'n/a':>9} {'n/a':>7} {'':>6} {'':>8} {'':>10} {'':>11} "
                    f"{r['makespan']:>8.0f} {r['violations']:>17d}")
        else:
            line = (f"{name:<22} {r['loads_per_token']:>9.2f} {r['saving']:>7.1%} {r['saving_std']:>6.1%} "
                    f"{r['capture']:>8.1%} {r['moe_us_per_token']:>10.1f} {r['step_us_per_token']:>11.1f} "
                    f"{r['makespan']:>8.0f} {r['violations']:>17d}")
        if full:
            every = r["all_steps"]
            line += f" {r['full_share']:>8.1%} {every['loads_per_token']:>13.2f} {every['saving']:>7.1%}"
        lines.append(line)
    return "\n".join(lines)

