"""Which overlap target predicts the decode-load saving of batching requests together?

    python -m benchmarks.target_study [--traces DIR (default $COHORT_DATA/deepseek-v2-lite-puffin)] [--decode-steps 64]
                                      [--phase aligned|random]

For every pair of requests it measures the decode-load saving of batching them,
1 - loads({a, b}) / (loads(a) + loads(b)) (traces.loads, prompt-token decode proxy), and
compares it with each target of train.targets (overlap, weighted_jaccard, jaccard):

- Spearman over all pairs, and over near-neighbour pairs (each request's 10 best partners by
  measured saving, and the union of each target's own top-10 lists);
- per anchor: the mean Spearman across its partners, and the saving of the partner each target
  ranks first as a share of the best partner's saving (what a greedy batcher would get);
- groups of 4 and 8 (random, and an anchor with its best partners): Spearman of the mean
  pairwise target against the group's saving 1 - loads(G) / sum loads(i);
- the identity saving = overlap / 2 (tokens independent): Pearson and mean absolute error;
- planning with a perfect predictor: on the benchmark's held-out 20% (traces.split),
  greedy batches on each exact target matrix (open a batch, add the request with the highest
  summed target to the batch), capture of the oracle at B = 8, 16, 32 (eval.metrics.evaluate).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from scipy.stats import pearsonr, spearmanr

from benchmarks.heldout import TRACES, HeldOut, data_path
from moe_cohort.eval.metrics import evaluate
from moe_cohort.traces.importers import load_traces
from moe_cohort.traces.loads import expert_masks
from moe_cohort.train.targets import TARGETS, profiles, target_matrix

NEAR = 10


def pair_saving_matrix(dec: np.ndarray, chunk: int = 8) -> np.ndarray:  # [N, N] float32
    """Measured saving of every pair from decode bitmasks dec [N, P] uint64."""
    own = np.bitwise_count(dec).sum(1, dtype=np.int64)  # [N]
    out = np.zeros((len(dec), len(dec)), dtype=np.float32)
    for i in range(0, len(dec), chunk):
        union = np.bitwise_count(dec[i:i + chunk, None] | dec[None]).sum(-1, dtype=np.int64)  # [c, N]
        total = own[i:i + chunk, None] + own[None]
        out[i:i + chunk] = 1 - union / np.maximum(total, 1)
    return out


def group_saving(dec: np.ndarray, groups: np.ndarray) -> np.ndarray:  # [G]
    """Measured saving 1 - loads(G) / sum loads(i) of groups [G, g] of rows of dec [N, P]."""
    union = np.bitwise_or.reduce(dec[groups], axis=1)  # [G, P]
    own = np.bitwise_count(dec).sum(1, dtype=np.int64)  # [N]
    return 1 - np.bitwise_count(union).sum(1, dtype=np.int64) / own[groups].sum(1)


def mean_pairwise(t: np.ndarray, groups: np.ndarray) -> np.ndarray:  # [G]
    g = groups.shape[1]
    sub = t[groups[:, :, None], groups[:, None, :]]  # [G, g, g]
    return (sub.sum((1, 2)) - np.trace(sub, axis1=1, axis2=2)) / (g * (g - 1))


def top_partners(m: np.ndarray, k: int) -> np.ndarray:  # [N, k]
    m = m.copy()
    np.fill_diagonal(m, -np.inf)
    return np.argsort(-m, axis=1, kind="stable")[:, :k]


def greedy_on(sim: np.ndarray, batch_size: int) -> list[np.ndarray]:
    """Batches grown greedily on a similarity matrix [n, n]: the planner a perfect target would allow."""
    placed = np.zeros(len(sim), dtype=bool)
    plan = []
    for start in range(len(sim)):
        if placed[start]:
            continue
        batch, score = [start], sim[start].astype(np.float64).copy()  # [n] summed similarity to the batch
        placed[start] = True
        while len(batch) < batch_size and not placed.all():
            j = int(np.argmax(np.where(placed, -np.inf, score)))
            batch.append(j)
            placed[j] = True
            score += sim[j]
        plan.append(np.array(batch, dtype=np.int64))
    return plan


def rho(x, y) -> float:
    return float(spearmanr(x, y).statistic)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", help=f"trace folder (default: $COHORT_DATA/{TRACES})")
    parser.add_argument("--decode-steps", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--phase", choices=("aligned", "random"), default="aligned",
                        help="decode-proxy phase of the measured saving (traces.loads)")
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)

    t0 = time.perf_counter()
    ts = load_traces(args.traces or data_path(TRACES))
    keep = np.flatnonzero(ts.num_prompt_tokens >= 2)  # requests with at least one decode-proxy token
    ts = ts.subset(keep) if len(keep) < len(ts) else ts
    dec = expert_masks(ts, decode_steps=args.decode_steps, phase=args.phase).decode.reshape(len(ts), -1)  # [N, D*L*W]
    saving = pair_saving_matrix(dec)
    prof = profiles(ts)
    targets = {kind: target_matrix(prof, ts.top_k, kind) for kind in TARGETS}
    n = len(ts)
    print(f"{n} requests with decode tokens ({len(keep)} of the file's kept), "
          f"{args.decode_steps} decode steps, phase {args.phase}; setup {time.perf_counter() - t0:.1f} s")

    iu = np.triu_indices(n, 1)
    near_true = top_partners(saving, NEAR)
    near_pairs = {(min(a, b), max(a, b)) for a in range(n) for b in near_true[a]}
    union_pairs = set(near_pairs)
    for t in targets.values():
        union_pairs |= {(min(a, b), max(a, b)) for a, b in zip(np.repeat(np.arange(n), NEAR), top_partners(t, NEAR).ravel())}
    near_idx, union_idx = (tuple(np.array(sorted(p)).T) for p in (near_pairs, union_pairs))
    best = saving[np.arange(n), near_true[:, 0]]  # [N] best partner's saving

    print(f"\nSpearman with measured pair saving ({len(iu[0]):,} pairs; near: {len(near_idx[0]):,} "
          f"pairs = each request's top-{NEAR} partners by saving; union: {len(union_idx[0]):,} = those "
          f"+ every target's top-{NEAR})")
    print(f"{'target':<18} {'all pairs':>10} {'near':>8} {'union':>8} {'per-anchor':>11} {'top-1 got':>10}")
    for kind, t in targets.items():
        first = top_partners(t, 1)[:, 0]
        got = float(np.mean(saving[np.arange(n), first]) / np.mean(best))
        per_anchor = np.nanmean([rho(np.delete(t[a], a), np.delete(saving[a], a)) for a in range(0, n, 5)])
        print(f"{kind:<18} {rho(t[iu], saving[iu]):>10.3f} {rho(t[near_idx], saving[near_idx]):>8.3f} "
              f"{rho(t[union_idx], saving[union_idx]):>8.3f} {per_anchor:>11.3f} {got:>10.1%}")

    print("\nSpearman of the mean pairwise target with the measured group saving")
    print(f"{'target':<18} " + " ".join(f"{name:>12}" for name in ("random g=4", "random g=8", "near g=4", "near g=8")))
    groups = {}
    for g in (4, 8):
        groups[f"random g={g}"] = np.array([rng.choice(n, g, replace=False) for _ in range(5000)])
    for g in (4, 8):
        groups[f"near g={g}"] = np.concatenate([np.arange(n)[:, None], near_true[:, :g - 1]], axis=1)
    measured = {name: group_saving(dec, grp) for name, grp in groups.items()}
    for kind, t in targets.items():
        print(f"{kind:<18} " + " ".join(f"{rho(mean_pairwise(t, grp), measured[name]):>12.3f}" for name, grp in groups.items()))

    pred = targets["overlap"][iu] / 2
    print(f"\nidentity check, saving ~ overlap / 2 over all pairs: Pearson {pearsonr(pred, saving[iu]).statistic:.3f}, "
          f"mean |error| {np.mean(np.abs(pred - saving[iu])):.4f} (mean saving {saving[iu].mean():.4f})")
    print(f"jaccard saturation: mean {targets['jaccard'][iu].mean():.3f}, "
          f"share of pairs >= 0.8: {np.mean(targets['jaccard'][iu] >= 0.8):.1%}")

    data = HeldOut.of(ts)
    held, sub = data.held_idx, data.held
    print(f"\nplanning with a perfect predictor: greedy on the exact target, {len(held)} held-out requests, capture")
    print(f"{'target':<18} " + " ".join(f"{'B=' + str(b):>7}" for b in (8, 16, 32)))
    sub_masks = expert_masks(sub, decode_steps=args.decode_steps, phase=args.phase)
    results = {b: evaluate(sub, b, masks=sub_masks, planners={kind: (lambda _ts, bs, m=t[np.ix_(held, held)]: greedy_on(m, bs))
                                             for kind, t in targets.items()})["plans"] for b in (8, 16, 32)}
    for kind in targets:
        print(f"{kind:<18} " + " ".join(f"{results[b][kind]['capture']:>7.1%}" for b in (8, 16, 32)))


if __name__ == "__main__":
    main()
