"""Benchmark `cohort train`: held-out capture of base vs fine-tuned encoder plans, and training cost.

    python -m benchmarks.bench_train [--traces DIR (default $COHORT_DATA/deepseek-v2-lite-puffin)] [--output DIR]
                                     [--model DIR]   # evaluate a finished run instead of training

Splits the traces by request (holdout 20%, seed 0: traces.split), trains on the
training side only with the default TrainConfig (unless --model names a finished run, whose
training.json gives the split), and reports on the held-out requests:

- per B in {8, 16, 32} and per decode-proxy phase (aligned, the reference definition, and random,
  which removes the position-alignment bonus of equal-length prompts): decode-load saving and capture (eval.metrics.evaluate on ts.subset(heldout))
  of encoder plans (encoder.planner.plan_batches over encoder.embedding.Embedder embeddings) with
  the base and with the fine-tuned encoder, beside random, arrival and the oracle;
- Spearman(cosine, overlap target) over held-out pairs, before and after;
- training wall time, process CPU time (user + sys: about twice the wall time of an idle 2-core
  machine) and peak memory (resident set, ru_maxrss; torch allocations are invisible to tracemalloc).

Targets: >= 80% capture at B = 16 held out (Doubleword fine-tuned bge-small: 73.6%); training
under 30 minutes on this 2-core machine with the default settings.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.heldout import TRACES, data_path
from moe_cohort.encoder.embedding import DEFAULT_MODEL, Embedder
from moe_cohort.encoder.planner import plan_batches
from moe_cohort.eval.metrics import evaluate
from moe_cohort.traces.importers import load_traces
from moe_cohort.traces.loads import expert_masks
from moe_cohort.train.correlation import cosine_spearman
from moe_cohort.train.finetune import REPORT_FILE, TrainConfig, train_encoder
from moe_cohort.train.targets import profiles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", help=f"trace folder (default: $COHORT_DATA/{TRACES})")
    parser.add_argument("--base", default=DEFAULT_MODEL)
    parser.add_argument("--output", help="folder for the trained model (default: a new temporary folder)")
    parser.add_argument("--model", help="a finished `cohort train` output to evaluate instead of training")
    parser.add_argument("--batch-sizes", default="8,16,32")
    parser.add_argument("--seeds", type=int, default=5, help="random plans to average")
    parser.add_argument("--plan-seeds", type=int, default=3, help="planner seeds to average")
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    ts = load_traces(args.traces or data_path(TRACES))
    model_dir = Path(args.model) if args.model else train(ts, args)
    report = json.loads((model_dir / REPORT_FILE).read_text())
    index = {rid: i for i, rid in enumerate(ts.request_ids.tolist())}
    held = np.array(sorted(index[r] for r in report["heldout_ids"]), dtype=np.int64)
    assert not set(report["heldout_ids"]) & set(report["train_ids"]), "held-out requests leaked into training"
    print(f"held out: {len(held)} of {len(ts)} requests (trained on {len(report['train_ids'])}); "
          f"pairs {report['pair_counts']}")
    evaluate_heldout(ts.subset(held), args.base, model_dir, report, args)


def train(ts, args) -> Path:
    out = Path(args.output) if args.output else Path(tempfile.mkdtemp(prefix="cohort-train-")) / "model"
    config = TrainConfig()
    print(f"training with {config}")
    rss0, cpu0, t0 = _rss_mib(), _cpu_seconds(), time.perf_counter()
    result = train_encoder(ts, args.base, out, config)
    wall, cpu = time.perf_counter() - t0, _cpu_seconds() - cpu0
    print(f"pipeline (profiles, pairs, base embeddings, training, held-out embeddings): {wall:.0f} s wall, "
          f"{cpu:.0f} s CPU; trainer alone {result.train_seconds:.0f} s wall; load average now "
          f"{os.getloadavg()[0]:.1f}; peak RSS {_rss_mib():.0f} MiB (before: {rss0:.0f} MiB); device {result.device}")
    return out


def evaluate_heldout(held, base: str, model_dir: Path, report: dict, args) -> None:
    prof = profiles(held)
    valid = np.flatnonzero(prof.sum(axis=(1, 2)) > 0)  # requests with decode-proxy tokens
    target = report["config"]["target"]
    emb = {}
    for name, source in (("base", base), ("fine-tuned", str(model_dir))):
        t = time.perf_counter()
        emb[name] = Embedder(source).encode(held.texts.tolist())
        rho = cosine_spearman(emb[name][valid], prof[valid], held.top_k, target)
        print(f"{name:<11} embeddings {time.perf_counter() - t:5.1f} s; held-out Spearman(cosine, {target}): "
              f"all pairs {rho['all_pairs']:.3f}, near pairs {rho['near_pairs']:.3f}")
    seeds = range(args.plan_seeds)
    planners = {f"{name}#{s}": (lambda ts_, b, x=x, s=s: plan_batches(x, b, seed=s)) for name, x in emb.items() for s in seeds}
    print(f"\ncapture = saving / oracle saving; mean over planner seeds {list(seeds)} [min, max]")
    print(f"{'B':>3} {'oracle saving':>14} {'base saving':>12} {'base capture':>22} {'tuned saving':>13} {'tuned capture':>22}")
    for phase in ("aligned", "random"):  # decode-proxy phase, see traces.loads
        masks = expert_masks(held, phase=phase)
        print(f"decode proxy, phase {phase}")
        for b in (int(s) for s in args.batch_sizes.split(",")):
            rows = evaluate(held, b, masks=masks, seeds=args.seeds, planners=planners)["plans"]
            cells = []
            for name in emb:
                sav = [rows[f"{name}#{s}"]["saving"] for s in seeds]
                cap = [rows[f"{name}#{s}"]["capture"] for s in seeds]
                cells.append(f"{np.mean(sav):>12.1%} {np.mean(cap):>8.1%} [{min(cap):.1%}, {max(cap):.1%}]")
            print(f"{b:>3} {rows['oracle']['saving']:>14.1%} {cells[0]} {cells[1]}")


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


if __name__ == "__main__":
    main()
