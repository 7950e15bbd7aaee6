"""How much admission leaves on the table: greedy reference, lookahead ceiling and trained text policy.

    python -m benchmarks.bench_ceiling [--traces A,B] [--slots 8,16,32,64] [--seeds 10]
        [--lookahead 8x16,8x16a] [--width 1] [--seeds-at 64=5] [--text-lookahead 4x32a] [--profile-lookahead 8x16]

Per model (default: both trace folders of the data folder) and S, on the held-out requests of the
project's split (benchmarks.heldout), every request arriving at step 0, one engine of S slots. Loads
per generated token are counted twice: with the engine kept full (the steps with every slot busy,
eval.engine's --kept-full) and over all steps (the drain at the end included). A rule that knows the
lengths can move loads into the drain, which the first count does not see; the second sees it, and
the share of tokens generated in full steps says how much of the replay the first count covers.

- reference: the greedy rule with the traces' own profiles (eval.policies.by_profile);
- lookahead-KxH: the lookahead admission that knows the traces (benchmarks.lookahead.Lookahead): the first
  K greedy candidates, each scored by a rollout of H further admissions with true lengths and tokens,
  over the rollout's full steps (KxH) or over all its steps (KxHa);
- text-profile-static: the trained text policy of bench_continuous (the static encoder's embeddings,
  a profile head fitted on the training side);
- with --text-lookahead KxH, the same search on predictions: the text policy's predicted profiles,
  rollouts counting expected loads (benchmarks.lookahead's `expected`), planned on the true output lengths
  ("text-lookahead-KxH-len", an upper bound for length prediction) and on one constant length, the
  training side's mean ("text-lookahead-KxH-mean": a rule that sees no trace of the held-out side).
- with --profile-lookahead KxH, the same search on the requests' TRUE profiles and true lengths
  ("profile-lookahead-KxH"): what a rule that plans on profiles could reach with a perfect predictor of
  both. The gap between it and lookahead-KxH is what only the tokens' own routing step by step tells.

Savings are against random admission with the same lengths (each seed's baseline is 4 random orders,
as in eval.engine.evaluate_continuous), mean ± std over seeds; share = full-step saving / the
reference's; s/replay: seconds of one replay.
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
from threadpoolctl import threadpool_limits

from benchmarks.bench_continuous import MODELS, held_lengths
from benchmarks.heldout import HeldOut, data_path, embeddings
from benchmarks.lookahead import Lookahead
from moe_cohort.cli.replay import text_policies
from moe_cohort.eval.engine import DEFAULT_MEAN_LENGTH, REFERENCE
from moe_cohort.eval.policies import Policy, by_profile, random_order
from moe_cohort.eval.replay import decode_tokens
from moe_cohort.traces.importers import load_traces

TRAINED = "text-profile-static"
RANDOM_DRAWS = 4  # random orders per seed, averaged: the yardstick (eval.engine.evaluate_continuous's default)


def trained_policy(data: HeldOut, cache: str | None) -> Policy:
    """bench_continuous's text-profile-static: static-encoder embeddings, a profile head fitted on the training
    side, held-out requests joining in a random order of each seed."""
    x = embeddings(list(data.traces.texts), "static", cache)  # [N, D]
    head = data.head(x, None)
    return replace(text_policies("-static", x[data.held_idx], head, data.held_texts)[TRAINED], shuffle=True)


def measure(path: str, slots: list[int], seeds: int, configs: list[str], width: int, cache: str,
            seeds_at: dict[int, int], text_configs: list[str] = (), profile_configs: list[str] = ()) -> list[dict]:
    data = HeldOut.of(load_traces(path))
    tokens = decode_tokens(data.held)
    lengths = held_lengths(data.held, tokens.mode)
    ref = data.reference.reshape(len(data.reference), -1)  # [n, L*E]
    policies = {REFERENCE: replace(by_profile(ref), shuffle=True)}
    for c in configs:
        k, h, full_only = _config(c)
        policies[f"lookahead-{c}"] = Lookahead(ref, k, h, width, full_only)
    for c in profile_configs:
        k, h, full_only = _config(c)
        policies[f"profile-lookahead-{c}"] = Lookahead(ref, k, h, width, full_only, expected=True)
    policies[TRAINED] = trained_policy(data, cache)
    mean = DEFAULT_MEAN_LENGTH if tokens.mode == "proxy" else float(data.traces.num_decode_tokens[data.train_idx].mean())
    constant = np.full(len(data.held), max(int(round(mean)), 1), np.int64)  # [n]
    predicted = policies[TRAINED].vectors
    for c in text_configs:
        k, h, full_only = _config(c)
        policies[f"text-lookahead-{c}-len"] = Lookahead(predicted, k, h, width, full_only, expected=True)
        policies[f"text-lookahead-{c}-mean"] = Lookahead(predicted, k, h, width, full_only, expected=True,
                                                         plan_lengths=constant)
    print(f"held-out: {len(data.held)} of {len(data.traces)} requests, {tokens.mode} decode tokens; "
          f"lookahead width {width}; planned constant length {constant[0]}")
    out = []
    for s in slots:
        n_seeds = seeds_at.get(s, seeds)
        start = time.perf_counter()
        rows = _replays(tokens, lengths, s, n_seeds, policies)
        print(_table(rows, s, n_seeds) + f"\n({time.perf_counter() - start:.0f} s for S = {s})\n")
        out.append({"slots": s, "seeds": n_seeds, "rows": rows})
    return out


def _replays(tokens, lengths, slots: int, seeds: int, policies: dict) -> dict:
    """Per policy and seed: loads per token over full steps and over all steps, their savings against the seed's
    random orders (RANDOM_DRAWS of them, the yardstick of eval.engine), the share of tokens in full steps, seconds."""
    rows: dict[str, dict[str, list]] = {}
    with threadpool_limits(limits=1, user_api="blas"):
        for seed in range(seeds):
            lens = lengths(seed)
            rnd = [random_order().run(tokens, lens, slots, seed * RANDOM_DRAWS + j) for j in range(RANDOM_DRAWS)]
            base_full = np.mean([r.loads_per_token_full for r in rnd])
            base_all = np.mean([r.loads_per_token for r in rnd])
            for name in ["random", *policies]:
                t0 = time.perf_counter()
                runs = rnd if name == "random" else [policies[name].run(tokens, lens, slots, seed)]
                secs = time.perf_counter() - t0
                row = rows.setdefault(name, {"lpt": [], "saving": [], "saving_all": [], "full_share": [], "secs": []})
                row["lpt"].append(np.mean([r.loads_per_token_full for r in runs]))
                row["saving"].append(1 - row["lpt"][-1] / base_full)
                row["saving_all"].append(1 - np.mean([r.loads_per_token for r in runs]) / base_all)
                row["full_share"].append(np.mean([(r.steps[r.full] * r.resident[r.full]).sum() / r.tokens for r in runs]))
                row["secs"].append(secs)
    return {name: {k: [float(v) for v in vs] for k, vs in row.items()} for name, row in rows.items()}


def _table(rows: dict, slots: int, seeds: int) -> str:
    ref = np.mean(rows[REFERENCE]["saving"])
    lines = [f"S = {slots}, {seeds} seeds; saving in decode expert loads per generated token vs random admission: "
             f"engine kept full (steps with every slot busy), and over all steps (the drain included)",
             f"  {'policy':<30} {'loads/token':>11} {'saving (full)':>16} {'share of ref':>12} {'saving (all)':>16}"
             f" {'full tokens':>11} {'s/replay':>9}"]
    for name, r in rows.items():
        sv, sa = np.array(r["saving"]), np.array(r["saving_all"])
        t = f"{np.mean(r['secs']):9.1f}" if "lookahead-" in name else f"{'':9}"
        lines.append(f"  {name:<30} {np.mean(r['lpt']):11.3f} {sv.mean():+8.2%} ± {sv.std():5.2%} "
                     f"{sv.mean() / ref if ref > 0 else 0.0:12.0%} {sa.mean():+8.2%} ± {sa.std():5.2%} "
                     f"{np.mean(r['full_share']):11.0%} {t}")
    return "\n".join(lines)


def _config(text: str) -> tuple[int, int, bool]:
    """KxH (rollouts scored over full steps) or KxHa (over all steps) -> (K, H, full_only)."""
    k, h = text.rstrip("a").split("x")
    return int(k), int(h), not text.endswith("a")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--traces", help=f"trace folders, comma-separated (default: {', '.join(MODELS)} of the data folder)")
    p.add_argument("--slots", default="8,16,32,64")
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--lookahead", default="8x16", help="KxH or KxHa (rollouts scored over all steps) configurations, comma-separated (default %(default)s)")
    p.add_argument("--width", type=int, default=1, help="choices searched at each rollout admission (1: greedy)")
    p.add_argument("--text-lookahead", default="", help="KxH or KxHa configurations of the search on predicted profiles")
    p.add_argument("--profile-lookahead", default="", help="KxH or KxHa configurations of the search on the true profiles and lengths")
    p.add_argument("--seeds-at", default="", help="S=n,...: n seeds at that S instead of --seeds")
    p.add_argument("--cache", default="/tmp/cohort-bench-cache", help="embedding cache (outside the repository)")
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args()
    configs = [c for c in args.lookahead.split(",") if c]
    text_configs = [c for c in args.text_lookahead.split(",") if c]
    profile_configs = [c for c in args.profile_lookahead.split(",") if c]
    seeds_at = {int(k): int(v) for k, v in (c.split("=") for c in args.seeds_at.split(",") if c)}
    out = {}
    for path in (args.traces.split(",") if args.traces else [str(data_path(m)) for m in MODELS]):
        print(f"\n===== {path} =====")
        out[path] = measure(path, [int(v) for v in args.slots.split(",")], args.seeds, configs, args.width, args.cache,
                            seeds_at, text_configs, profile_configs)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=float) + "\n")


if __name__ == "__main__":
    main()
