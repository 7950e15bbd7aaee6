"""The online learner's learning curve in the continuous-batching replay, on held-out requests only (issue 26).

    python -m benchmarks.bench_learning [--traces A,B] [--observed 0,25,50,100,200,400] [--seeds 10]

For each model (default: both trace folders of the data folder), the project's one split
(benchmarks.heldout). The training requests arrive one by one in a seeded random order, as a served
model's finished requests would: each becomes an observation (traces.observed.from_routed_experts of
its own routing rows, the form vLLM's `routed_experts` field has) and goes, with its head features
(the proxy's encoder: static, cached in --cache), into a train.online.OnlineLearner with the proxy's
defaults. After N observations the learner's head (refitted on what it has: the proxy refits on its
own schedule, at most `refit_every` or a quarter of its observations behind) admits the held-out
requests through S slots (S = 16 and 32, their own decode tokens and lengths, --seeds seeds), beside
the offline head fitted on the whole training side and the reference. N = 0 is first come, first
served: the proxy has no head before its first fit. Prompt-only traces (DeepSeek-V2-Lite) stand the
prompt after BOS in for the generated tokens, as train.targets does.

Targets (issue 26): after 200 observations >= 80% of the offline head's saving at S = 16; after 400, >= 95%.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import numpy as np

from benchmarks.bench_continuous import MODELS, held_lengths
from benchmarks.heldout import HeldOut, data_path, embeddings
from moe_cohort.encoder.profile import head_features
from moe_cohort.eval.cost import parse_cost_model
from moe_cohort.eval.engine import REFERENCE, evaluate_continuous
from moe_cohort.eval.policies import by_profile, fixed_order
from moe_cohort.eval.replay import decode_tokens
from moe_cohort.traces.format import TraceSet
from moe_cohort.traces.importers import load_traces
from moe_cohort.traces.observed import Observed, from_routed_experts
from moe_cohort.train.online import LearnConfig, OnlineLearner

TARGETS = {200: 0.80, 400: 0.95}  # share of the offline head's saving at S = 16
Embed = Callable[[list[str]], np.ndarray]  # texts -> [N, D]


def observation(ts: TraceSet, i: int) -> Observed:
    """Request i of `ts` as the proxy would observe it (prompt-only traces: the prompt after BOS as its decode)."""
    rows, prompt = ts.request_experts(i), int(ts.num_prompt_tokens[i])
    if ts.num_decode_tokens.any():
        return from_routed_experts(rows, prompt, ts.num_experts)
    return from_routed_experts(rows[1:prompt], 0, ts.num_experts)


def measure_model(ts: TraceSet, sizes: list[int], slots: list[int], seeds: int, embed: Embed, report=print, *,
                  kept_full: bool = False) -> dict:
    """The curve of one trace set: per N, each S's saving of the learned head, the offline head and the reference."""
    data = HeldOut.of(ts)
    texts = [str(t) for t in ts.texts]
    x = embed(texts)  # [N, D]
    config = LearnConfig()
    f = head_features(x, texts, config.ngram_dim)  # [N, F]
    tokens = decode_tokens(data.held)
    lengths = held_lengths(data.held, tokens.mode)
    held_f = f[data.held_idx]
    cost = parse_cost_model("deepseek-v2-lite")
    offline = data.fit_head(x)
    base = {"offline": replace(by_profile(offline.from_features(held_f)), shuffle=True),
            REFERENCE: replace(by_profile(data.reference), shuffle=True)}
    order = np.random.default_rng(0).permutation(data.train_idx)
    order = order[[observation(ts, i).profile().sum() > 0 for i in order]]  # requests with counted tokens
    learner, fed, rows = OnlineLearner(config), 0, []
    report(f"held-out {len(data.held_idx)}, training stream {len(order)} requests; offline head alpha {offline.alpha:g}")
    for n in sorted(set(min(s, len(order)) for s in sizes)):
        start = time.perf_counter()
        learner.observe(f[order[fed:n]], [observation(ts, i) for i in order[fed:n]])
        fed = n
        if n >= config.first_fit:
            learner.refit()
        fit_s = time.perf_counter() - start
        learned = (fixed_order(np.arange(len(data.held_idx))) if learner.head is None
                   else replace(by_profile(learner.head.from_features(held_f)), shuffle=True))
        row = {"observed": n, "refit_s": fit_s}
        for s in slots:
            plans = evaluate_continuous(tokens, s, {**base, "learned": learned}, lengths, cost, ts.num_layers,
                                        seeds=seeds, kept_full=kept_full)["plans"]
            row[s] = {k: {"saving": plans[k]["saving"], "std": plans[k]["saving_std"]} for k in ("learned", "offline", REFERENCE)}
            offline_saving = plans["offline"]["saving"]
            row[s]["of_offline"] = plans["learned"]["saving"] / offline_saving if offline_saving else float("nan")
        report(f"  N = {n:>4}: " + "; ".join(
            f"S = {s}: learned {row[s]['learned']['saving']:.2%} ± {row[s]['learned']['std']:.2%}, offline "
            f"{row[s]['offline']['saving']:.2%}, reference {row[s][REFERENCE]['saving']:.2%} "
            f"-> {row[s]['of_offline']:.0%} of offline" for s in slots) + f"  (observe + refit {fit_s:.2f} s)")
        rows.append(row)
    for n, goal in TARGETS.items():
        got = [r for r in rows if r["observed"] == min(n, len(order))]
        if got and 16 in slots:
            share, seen = got[0][16]["of_offline"], got[0]["observed"]
            also = "" if seen == n else f" (the training side has {seen}: all of them, the offline head's own data)"
            report(f"target: after {n} observations >= {goal:.0%} of the offline head's saving at S = 16: "
                   f"{share:.0%}{also} -> {'reached' if share >= goal else 'NOT reached'}")
    return {"curve": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--traces", help="trace folders, comma-separated (default: both of the data folder)")
    p.add_argument("--observed", default="0,25,50,100,200,400")
    p.add_argument("--slots", default="16,32")
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--cache", default="/tmp/cohort-bench-cache", help="embedding cache folder (outside the repository)")
    p.add_argument("--kept-full", action="store_true", help="count the steps with every slot busy only (a loaded "
                   "server), as the README's table does")
    p.add_argument("--json", help="also write the numbers here")
    args = p.parse_args()
    out = {}
    for path in (args.traces.split(",") if args.traces else [str(data_path(m)) for m in MODELS]):
        print(f"\n===== {path} =====")
        out[path] = measure_model(load_traces(path), [int(v) for v in args.observed.split(",")],
                                  [int(v) for v in args.slots.split(",")], args.seeds,
                                  lambda texts: embeddings(texts, "static", args.cache), kept_full=args.kept_full)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
