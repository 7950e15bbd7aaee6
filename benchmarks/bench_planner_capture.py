"""Capture of the base-encoder planner on real expert traces, and what each planner idea adds.

For B in {8, 16, 32, 64} on the DeepSeek-V2-Lite Puffin traces (decode proxy, D = 64 steps):
saving(plan) = 1 - decode_loads(plan) / mean decode_loads(5 random plans), capture = saving(plan) /
saving(greedy oracle). Ablation rows switch the planner ideas on one at a time:

    kmeans+sort+chunk      the naive planner (FAISS k-means, k = N/B, sort by label, cut)
    balanced bisection     size-constrained divisive clustering down to batches of B
    growth (random seeds)  greedy growth by nearest unassigned neighbours, seeds in random order
    growth (dense seeds)   the same, seeds densest first
    ... + swaps            2-swap local search on the within-batch similarity
    cells of 512           the default planner forced into cells (the cost of partitioning)

Ordering does not change a plan's loads; its effect is measured on a continuous-batching stand-in:
the plan's order re-cut at an offset of B/2 ("straddle" batches: half of batch i, half of i+1).
A last table recomputes the decode proxy with a random phase per request, which removes the
proxy's alignment of prompt tokens between requests of equal length (see the report).

    python -m benchmarks.bench_planner_capture [--traces DIR (default $COHORT_DATA/deepseek-v2-lite-puffin)]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from benchmarks.baselines import kmeans_sort_chunk
from benchmarks.heldout import TRACES, data_path, embeddings
from moe_cohort.encoder.ordering import consecutive_similarity
from moe_cohort.encoder.planner import PlannerConfig, plan_batches
from moe_cohort.eval.oracle import greedy_oracle
from moe_cohort.encoder.plans import chunk, validate_plan
from moe_cohort.eval.plans import random_plan
from moe_cohort.traces.importers import load_traces
from moe_cohort.traces.loads import ExpertMasks, expert_masks, plan_loads

SEEDS = (0, 1, 2)
ABLATION = {
    "kmeans+sort+chunk (naive)": None,
    "balanced bisection": PlannerConfig(init="bisect", swaps=False),
    "growth, random seeds": PlannerConfig(seeds="random", swaps=False),
    "growth, dense seeds": PlannerConfig(swaps=False),
    "balanced bisection + swaps": PlannerConfig(init="bisect"),
    "growth, random seeds + swaps": PlannerConfig(seeds="random"),
    "growth, dense seeds + swaps (default)": PlannerConfig(),
    "default in cells of 512": PlannerConfig(cell_size=512),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", help=f"trace folder (default: $COHORT_DATA/{TRACES})")
    parser.add_argument("--cache", default="/tmp/cohort-bench-cache", help="embedding cache (outside the repository)")
    parser.add_argument("--encoder", default=None)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--decode-steps", type=int, default=64)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    ts = load_traces(args.traces or data_path(TRACES))
    masks = expert_masks(ts, decode_steps=args.decode_steps)
    x = embeddings(ts.texts, args.encoder, args.cache)
    print(f"{len(ts)} requests, {ts.num_layers} layers, top-{ts.top_k} of {ts.num_experts}; decode {masks.decode_mode} "
          f"D={masks.decode_steps}; embeddings {x.shape}\n")
    for B in args.batch_sizes:
        _ablation(masks, x, B)
    _straddle_table(masks, x, args.batch_sizes)
    _dephased_table(ts, x, args.batch_sizes, args.decode_steps)


class Scorer:
    """Decode loads and capture of plans against random plans and the oracle, for one B."""

    def __init__(self, masks: ExpertMasks, batch_size: int):
        self.masks, self.B = masks, batch_size
        self.random = np.mean([plan_loads(masks, random_plan(len(masks), batch_size, s)).decode for s in range(5)])
        self.oracle = plan_loads(masks, greedy_oracle(masks.flat(), batch_size)).decode

    def capture(self, plan) -> float:
        saving = 1 - plan_loads(self.masks, plan).decode / self.random
        return saving / (1 - self.oracle / self.random)


def _ablation(masks: ExpertMasks, x: np.ndarray, B: int) -> None:
    score = Scorer(masks, B)
    arrival = score.capture(chunk(np.arange(len(x)), B))
    print(f"B = {B}: random {score.random / 1e6:.3f} M decode loads, oracle {score.oracle / 1e6:.3f} M "
          f"(saving {1 - score.oracle / score.random:.1%}); arrival order capture {arrival:.1%}")
    print(f"  {'planner':40s} {'capture':>8s} {'(min..max over seeds)':>22s} {'loads M':>8s} {'time':>6s}")
    for name, config in ABLATION.items():
        caps, loads, secs = [], [], []
        for seed in SEEDS:
            start = time.perf_counter()
            plan = kmeans_sort_chunk(x, B, seed=seed) if config is None else plan_batches(x, B, seed=seed, config=config)
            secs.append(time.perf_counter() - start)
            validate_plan(plan, len(x), B)
            caps.append(score.capture(plan))
            loads.append(plan_loads(masks, plan).decode)
        spread = f"{min(caps):.1%}..{max(caps):.1%}" if max(caps) - min(caps) > 1e-9 else "(deterministic)"
        print(f"  {name:40s} {np.mean(caps):8.1%} {spread:>22s} {np.mean(loads) / 1e6:8.3f} {np.mean(secs):5.2f}s")
    print()


def _straddle_table(masks: ExpertMasks, x: np.ndarray, sizes) -> None:
    """Continuous batching stand-in: capture of the plan's order re-cut at offsets B/4, B/2, 3B/4."""
    print("ordering: capture of 'straddle' batches (the plan's order re-cut at offsets B/4, B/2, 3B/4; mean)")
    print(f"  {'B':>3s} {'batches':>8s} {'ordered':>8s} {'unordered':>10s} {'shuffled (5)':>13s}   "
          f"consecutive centroid cosine: ordered / unordered / shuffled")
    for B in sizes:
        score = Scorer(masks, B)
        ordered = plan_batches(x, B)
        unordered = plan_batches(x, B, config=PlannerConfig(order=False))
        shuffles = [[ordered[i] for i in np.random.default_rng(s).permutation(len(ordered))] for s in range(5)]
        seams = lambda plan: np.mean([score.capture(_straddle(plan, off)) for off in (B // 4, B // 2, 3 * B // 4)])  # noqa: E731
        cos = [consecutive_similarity(x, p) for p in (ordered, unordered)]
        cos.append(np.mean([consecutive_similarity(x, p) for p in shuffles]))
        print(f"  {B:3d} {score.capture(ordered):8.1%} {seams(ordered):8.1%} {seams(unordered):10.1%} "
              f"{np.mean([seams(p) for p in shuffles]):13.1%}   {cos[0]:.3f} / {cos[1]:.3f} / {cos[2]:.3f}")
    print()


def _straddle(plan, offset: int):
    order = np.concatenate(plan)
    B = len(plan[0])
    return [order[:offset]] + chunk(order[offset:], B)


def _dephased_table(ts, x: np.ndarray, sizes, decode_steps: int) -> None:
    """The same captures when every request's decode proxy starts at a random prompt token."""
    masks = _dephased_masks(ts, decode_steps)
    lengths = ts.num_prompt_tokens
    print("decode proxy with a random phase per request (removes the equal-length alignment):")
    print(f"  {'B':>3s} {'oracle saving':>14s} {'default planner':>16s} {'sort by prompt length':>22s}")
    for B in sizes:
        score = Scorer(masks, B)
        ours = score.capture(plan_batches(x, B))
        by_len = score.capture(chunk(np.argsort(lengths, kind="stable"), B))
        print(f"  {B:3d} {1 - score.oracle / score.random:14.1%} {ours:16.1%} {by_len:22.1%}")
    std = expert_masks(ts, decode_steps=decode_steps)
    print("  (standard proxy, sort by prompt length: " + ", ".join(
        f"B={B} {Scorer(std, B).capture(chunk(np.argsort(lengths, kind='stable'), B)):.1%}" for B in sizes) + ")")


def _dephased_masks(ts, decode_steps: int) -> ExpertMasks:
    """Decode proxy whose step t uses prompt token 1 + ((t + phase) mod (n - 1)), phase random per request."""
    from moe_cohort.traces.loads import token_masks

    tok = token_masks(ts.experts, ts.num_experts)  # [T, L, W]
    tok = np.concatenate([tok, np.zeros((1,) + tok.shape[1:], np.uint64)])  # row T: no token
    n = ts.num_prompt_tokens  # [N]
    phase = np.random.default_rng(123).integers(0, 1 << 30, len(n))  # [N]
    t = np.arange(decode_steps)  # [D]
    index = ts.token_offsets[:-1, None] + 1 + (t[None, :] + phase[:, None]) % np.maximum(n - 1, 1)[:, None]
    index = np.where((n >= 2)[:, None], index, len(ts.experts))  # [N, D]
    std = expert_masks(ts, decode_steps=decode_steps)
    return ExpertMasks(prefill=std.prefill, decode=tok[index], num_experts=ts.num_experts, decode_mode="proxy-dephased")


if __name__ == "__main__":
    main()
