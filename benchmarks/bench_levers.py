"""The two levers together: admission x batch-aware expert selection, in the replay, on held-out requests.

    python -m benchmarks.bench_levers [--traces A,B] [--slots 16,32] [--seeds 10] [--random-draws 2]

Per model (default: both trace folders of the data folder) and S, the held-out requests of the
project's split run through one engine of S slots (eval.replay, every request at step 0) under four
admissions: random, FCFS (trace order), trained (bench_ceiling's text-profile-static: a profile head
fitted on the training side) and the greedy reference (the traces' own profiles). On every step with
all S slots busy, per MoE layer, each selector cuts the residents' expert choices as the traces hold
them (benchmarks.selection_cut: XShare with warm-up k0 = 1, OEA, MoE-Spec truncation, Lynx-Lat); the shared
traces hold no router weights, so summed weight is a vote count. Per admission, selector and
parameter (budget m, k0 for OEA, experts dropped for Lynx):

    loads/tok   decode experts loaded per generated token after the cut (full steps)
    saving      1 - loads/tok / that of random admission without a cut (paired per seed)
    kept        share of the traces' (token, expert) routings the cut keeps (its fidelity)

Headline: per selector, loads/tok at 95% of routings kept (linear interpolation along each seed's
sweep over every parameter), trained + selector against random + the same selector, and the combined
saving of trained + selector against random admission without a cut; mean ± std over seeds.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

from benchmarks.bench_ceiling import trained_policy
from benchmarks.bench_continuous import MODELS, held_lengths
from benchmarks.heldout import HeldOut, data_path
from benchmarks.selection_cut import step_choices, sweep, union
from moe_cohort.eval.policies import by_profile, fixed_order, random_order
from moe_cohort.eval.replay import decode_tokens
from moe_cohort.traces.importers import load_traces

ADMISSIONS = ("random", "fcfs", "trained", "reference")
SELECTORS = ("xshare", "oea", "moe-spec", "lynx")
FIDELITY = 0.95


def params(selector: str, num_experts: int, top_k: int) -> list[int]:
    """Every parameter of a selector's sweep, from the deepest cut to none."""
    if selector == "oea":
        return list(range(1, top_k + 1))
    if selector == "lynx":
        return list(range(num_experts - 1, -1, -1))
    return list(range(1, num_experts + 1))


def shown(selector: str, num_experts: int, top_k: int) -> list[int]:
    """The parameters printed in the table (the headline interpolates over all of `params`)."""
    if selector == "oea":
        return list(range(1, top_k))
    if selector == "lynx":
        return [num_experts // 16, num_experts // 8, num_experts // 4]
    return [num_experts * i // 8 for i in range(2, 8)]


def curves(ids: np.ndarray, num_experts: int, top_k: int, slots: int, layers: int) -> dict:
    """selector -> (loads per generated token [P], share of routings kept [P]) over params(selector); "none": uncut."""
    tokens = ids.shape[0] // layers * slots
    routings = int((ids >= 0).sum())
    out = {"none": (np.array([union(ids, num_experts).sum() / tokens]), np.ones(1))}
    for sel in SELECTORS:
        loads, kept = sweep(ids, num_experts, sel, params(sel, num_experts, top_k), k0=1)
        out[sel] = (loads / tokens, kept / routings)
    return out


def at_fidelity(lpt: np.ndarray, kept: np.ndarray, fidelity: float = FIDELITY) -> float:
    """Loads per token where the sweep keeps `fidelity` of the routings (linear between its points)."""
    order = np.argsort(kept, kind="stable")
    if not kept.min() <= fidelity <= kept.max():
        return float("nan")
    return float(np.interp(fidelity, kept[order], lpt[order]))


def measure(path: str, slots: list[int], seeds: int, draws: int, cache: str) -> dict:
    data = HeldOut.of(load_traces(path))
    held = data.held
    tokens = decode_tokens(held)
    lengths = held_lengths(held, tokens.mode)
    e, k, layers = held.num_experts, held.top_k, held.num_layers
    policies = {"fcfs": fixed_order(np.arange(len(held))), "trained": trained_policy(data, cache),
                "reference": replace(by_profile(data.reference), shuffle=True)}
    print(f"held-out: {len(held)} of {len(data.traces)} requests, {tokens.mode} decode tokens, {e} experts, top-{k}; "
          f"{seeds} seeds, random admission: {draws} orders per seed")
    out = {}
    for s in slots:
        start = time.perf_counter()
        per = {a: [] for a in ADMISSIONS}  # admission -> per seed: selector -> (lpt [P], kept [P])
        with threadpool_limits(limits=1, user_api="blas"):
            for seed in range(seeds):
                lens = lengths(seed)
                runs = {"random": [random_order().run(tokens, lens, s, seed * draws + j) for j in range(draws)]}
                runs.update({a: [p.run(tokens, lens, s, seed)] for a, p in policies.items()})
                for a, rs in runs.items():
                    cs = [curves(step_choices(held.experts, tokens, r, lens, s), e, k, s, layers) for r in rs]
                    per[a].append({sel: tuple(np.mean([c[sel][i] for c in cs], axis=0) for i in (0, 1)) for sel in cs[0]})
        out[s] = per
        print(_table(per, s, e, k))
        print(_headline(per, s, path))
        print(f"({time.perf_counter() - start:.0f} s for S = {s})\n")
    return out


def _table(per: dict, s: int, e: int, k: int) -> str:
    base = np.array([seed["none"][0][0] for seed in per["random"]])  # [seeds] uncut random loads/token
    head = "  " + f"{'selector':<14}" + "".join(f"{a:>27}" for a in ADMISSIONS)
    sub = "  " + " " * 14 + "".join(f"{'loads/tok':>11}{'saving':>8}{'kept':>8}" for _ in ADMISSIONS)
    lines = [f"S = {s}, engine kept full: loads per generated token, saving vs random admission without a cut, "
             f"share of routings kept", head, sub]
    rows = [("none", None, 0)] + [(sel, p, params(sel, e, k).index(p)) for sel in SELECTORS for p in shown(sel, e, k)]
    for sel, p, i in rows:
        name = "none" if p is None else f"{sel} {'k0' if sel == 'oea' else 'drop' if sel == 'lynx' else 'm'}={p}"
        cells = ""
        for a in ADMISSIONS:
            lpt = np.array([seed[sel][0][i] for seed in per[a]])
            kept = np.mean([seed[sel][1][i] for seed in per[a]])
            cells += f"{lpt.mean():11.2f}{1 - (lpt / base).mean():+8.1%}{kept:8.1%}"
        lines.append(f"  {name:<14}{cells}")
    return "\n".join(lines)


def _headline(per: dict, s: int, path: str) -> str:
    base = np.array([seed["none"][0][0] for seed in per["random"]])  # [seeds]
    lines = [f"at {FIDELITY:.0%} of routings kept (S = {s}): loads/token per admission; trained vs random with the same "
             f"selector; trained + selector vs random without a cut (mean ± std over seeds)"]
    for sel in SELECTORS:
        at = {a: np.array([at_fidelity(*seed[sel]) for seed in per[a]]) for a in ADMISSIONS}  # [seeds]
        vs_random = 1 - at["trained"] / at["random"]
        combined = 1 - at["trained"] / base
        ref_combined = 1 - at["reference"] / base
        lines.append(f"  {sel:<9}" + "".join(f" {a} {at[a].mean():6.2f}" for a in ADMISSIONS)
                     + f" | trained vs random {vs_random.mean():+.1%} ± {vs_random.std():.1%}"
                     + f" | combined {combined.mean():+.1%} ± {combined.std():.1%} (reference {ref_combined.mean():+.1%})")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--traces", help=f"trace folders, comma-separated (default: {', '.join(MODELS)} of the data folder)")
    p.add_argument("--slots", default="16,32")
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--random-draws", type=int, default=2, help="random admission orders per seed, averaged")
    p.add_argument("--cache", default="/tmp/cohort-bench-cache", help="embedding cache (outside the repository)")
    p.add_argument("--json", help="also write the per-seed curves to this file")
    args = p.parse_args()
    out = {}
    for path in (args.traces.split(",") if args.traces else [str(data_path(m)) for m in MODELS]):
        print(f"\n===== {path} =====")
        res = measure(path, [int(v) for v in args.slots.split(",")], args.seeds, args.random_draws, args.cache)
        out[path] = {str(s): {a: [{sel: [c.tolist() for c in v] for sel, v in seed.items()} for seed in r]
                              for a, r in per.items()} for s, per in res.items()}
    if args.json:
        Path(args.json).write_text(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
