"""Benchmark: load the DeepSeek-V2-Lite traces and run random + oracle-greedy batching.

    python -m benchmarks.bench_eval [--traces DIR (default $COHORT_DATA/deepseek-v2-lite-puffin)]

Prints load time, mask-building time, and per batch size the random mean, the oracle's loads,
saving, and its wall time. Target: oracle for 1,499 prompts at B = 16 under 5 s on 2 cores.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from benchmarks.heldout import TRACES, data_path
from moe_cohort.eval.oracle import greedy_oracle
from moe_cohort.eval.plans import random_plan
from moe_cohort.traces.importers import load_traces
from moe_cohort.traces.loads import expert_masks, plan_loads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", help=f"trace folder (default: $COHORT_DATA/{TRACES})")
    parser.add_argument("--batch-sizes", default="8,16,32,64")
    parser.add_argument("--decode-steps", type=int, default=64)
    args = parser.parse_args()

    t0 = time.perf_counter()
    ts = load_traces(args.traces or data_path(TRACES))
    t1 = time.perf_counter()
    masks = expert_masks(ts, decode_steps=args.decode_steps)
    t2 = time.perf_counter()
    print(f"traces: {len(ts)} requests, {int(ts.num_tokens.sum())} tokens; load {t1 - t0:.2f} s, masks {t2 - t1:.2f} s")
    print(f"{'B':>4} {'random decode loads':>20} {'random s':>9} {'oracle decode loads':>20} {'saving':>7} {'oracle s':>9}")
    for b in (int(x) for x in args.batch_sizes.split(",")):
        t = time.perf_counter()
        rand = np.mean([plan_loads(masks, random_plan(len(ts), b, seed)).decode for seed in range(5)])
        t_rand = time.perf_counter() - t
        t = time.perf_counter()
        oracle = plan_loads(masks, greedy_oracle(masks.flat(), b)).decode
        t_oracle = time.perf_counter() - t
        print(f"{b:>4} {rand:>20,.0f} {t_rand:>9.2f} {oracle:>20,} {1 - oracle / rand:>7.1%} {t_oracle:>9.2f}")


if __name__ == "__main__":
    main()
