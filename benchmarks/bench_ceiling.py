"""How much admission leaves on the table: greedy reference, lookahead ceiling and trained text policy.

    python -m benchmarks.bench_ceiling [--traces A,B] [--slots 8,16,32,64] [--seeds 10]
        [--lookahead 4x4,8x8] [--width 1] [--seeds-at 64=5] [--text-lookahead 4x16]

Per model (default: both trace folders of the data folder) and S, on the held-out requests of the
project's split (benchmarks.heldout), every request arriving at step 0, one engine of S slots kept
full (loads per generated token over the steps with every slot busy: eval.engine's --kept-full):

- reference: the greedy rule with the traces' own profiles (eval.policies.by_profile);
- lookahead-KxH: the lookahead admission that knows the traces (eval.lookahead.Lookahead): the first
  K greedy candidates, each scored by a rollout of H further admissions with true lengths and tokens;
- text-profile-static: the trained text policy of bench_continuous (the static encoder's embeddings,
  a profile head fitted on the training side);
- with --text-lookahead KxH, the same search on predictions: the text policy's predicted profiles,
  rollouts counting expected loads (eval.lookahead's `expected`), planned on the true output lengths
  ("text-lookahead-KxH-len", an upper bound for length prediction) and on one constant length, the
  training side's mean ("text-lookahead-KxH-mean": a rule that sees no trace of the held-out side).

Savings are against random admission with the same lengths (eval.engine.evaluate_continuous: each
seed's baseline is 4 random orders), mean ± std over seeds; share = saving / the reference's.
Decode traces run their own tokens and lengths, prompt-only traces the decode proxy with lognormal
lengths (mean 64). `--seeds-at S=n` runs n seeds at that S (the lookahead's cost grows with S).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from benchmarks.bench_continuous import MODELS, held_lengths
from benchmarks.heldout import HeldOut, data_path, embeddings
from moe_cohort.cli.replay import text_policies
from moe_cohort.eval.cost import parse_cost_model
from moe_cohort.eval.engine import DEFAULT_MEAN_LENGTH, REFERENCE, evaluate_continuous
from moe_cohort.eval.lookahead import Lookahead
from moe_cohort.eval.policies import Policy, by_profile
from moe_cohort.eval.replay import decode_tokens
from moe_cohort.traces.importers import load_traces

TRAINED = "text-profile-static"


def trained_policy(data: HeldOut, cache: str | None) -> Policy:
    """bench_continuous's text-profile-static: static-encoder embeddings, a profile head fitted on the training
    side, held-out requests joining in a random order of each seed."""
    x = embeddings(list(data.traces.texts), "static", cache)  # [N, D]
    head = data.head(x, None)
    return replace(text_policies("-static", x[data.held_idx], head, data.held_texts)[TRAINED], shuffle=True)


def measure(path: str, slots: list[int], seeds: int, configs: list[tuple[int, int]], width: int, cache: str,
            seeds_at: dict[int, int], text_configs: list[tuple[int, int]] = ()) -> list[dict]:
    data = HeldOut.of(load_traces(path))
    tokens = decode_tokens(data.held)
    lengths = held_lengths(data.held, tokens.mode)
    ref = data.reference.reshape(len(data.reference), -1)  # [n, L*E]
    policies = {REFERENCE: replace(by_profile(ref), shuffle=True)}
    policies.update({f"lookahead-{k}x{h}": Lookahead(ref, k, h, width) for k, h in configs})
    policies[TRAINED] = trained_policy(data, cache)
    mean = DEFAULT_MEAN_LENGTH if tokens.mode == "proxy" else float(data.traces.num_decode_tokens[data.train_idx].mean())
    constant = np.full(len(data.held), max(int(round(mean)), 1), np.int64)  # [n]
    for k, h in text_configs:
        policies[f"text-lookahead-{k}x{h}-len"] = Lookahead(policies[TRAINED].vectors, k, h, width, expected=True)
        policies[f"text-lookahead-{k}x{h}-mean"] = Lookahead(policies[TRAINED].vectors, k, h, width, expected=True,
                                                             plan_lengths=constant)
    print(f"held-out: {len(data.held)} of {len(data.traces)} requests, {tokens.mode} decode tokens; "
          f"lookahead width {width}")
    cost = parse_cost_model("deepseek-v2-lite")
    out = []
    for s in slots:
        n_seeds = seeds_at.get(s, seeds)
        start = time.perf_counter()
        r = evaluate_continuous(tokens, s, policies, lengths, cost, data.held.num_layers, seeds=n_seeds, kept_full=True)
        took = time.perf_counter() - start
        timing = {}
        for name in policies:
            if "lookahead-" in name:
                t0 = time.perf_counter()
                policies[name].run(tokens, lengths(0), s, 0)
                timing[name] = time.perf_counter() - t0
        print(_table(r, n_seeds, timing) + f"\n({took:.0f} s for S = {s})\n")
        out.append({"slots": s, "seeds": n_seeds, "plans": r["plans"], "lookahead_s_per_replay": timing})
    return out


def _table(r: dict, seeds: int, timing: dict) -> str:
    plans = r["plans"]
    lines = [f"S = {r['slots']}, engine kept full, {seeds} seeds; saving in decode expert loads per generated token vs random",
             f"  {'policy':<28} {'loads/token':>11} {'saving':>16} {'share of ref':>12} {'s/replay':>9}"]
    for name in ["random", REFERENCE, *sorted(k for k in plans if k.startswith("lookahead-")), TRAINED,
                 *sorted(k for k in plans if k.startswith("text-lookahead-"))]:
        p = plans[name]
        t = f"{timing[name]:9.1f}" if name in timing else f"{'':9}"
        lines.append(f"  {name:<28} {p['loads_per_token']:11.3f} {p['saving']:+8.2%} ± {p['saving_std']:5.2%} "
                     f"{p['capture']:12.0%} {t}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--traces", help=f"trace folders, comma-separated (default: {', '.join(MODELS)} of the data folder)")
    p.add_argument("--slots", default="8,16,32,64")
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--lookahead", default="4x4", help="KxH configurations, comma-separated (default %(default)s)")
    p.add_argument("--width", type=int, default=1, help="choices searched at each rollout admission (1: greedy)")
    p.add_argument("--text-lookahead", default="", help="KxH configurations of the search on predicted profiles")
    p.add_argument("--seeds-at", default="", help="S=n,...: n seeds at that S instead of --seeds")
    p.add_argument("--cache", default="/tmp/cohort-bench-cache", help="embedding cache (outside the repository)")
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args()
    configs = [tuple(int(v) for v in c.split("x")) for c in args.lookahead.split(",") if c]
    text_configs = [tuple(int(v) for v in c.split("x")) for c in args.text_lookahead.split(",") if c]
    seeds_at = {int(k): int(v) for k, v in (c.split("=") for c in args.seeds_at.split(",") if c)}
    out = {}
    for path in (args.traces.split(",") if args.traces else [str(data_path(m)) for m in MODELS]):
        print(f"\n===== {path} =====")
        out[path] = measure(path, [int(v) for v in args.slots.split(",")], args.seeds, configs, args.width, args.cache,
                            seeds_at, text_configs)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=float) + "\n")


if __name__ == "__main__":
    main()
