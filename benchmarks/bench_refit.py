"""What one refit of the online learner's head costs, by reservoir size and model shape (issue 26).

    python -m benchmarks.bench_refit [--sizes 250,500,1000] [--repeats 3]

The learner (train.online) refits train.profile_head's ridge + leave-one-out penalty on its whole
reservoir: n observations of F = 256 + 4096 features (the static encoder's embedding and the hashed
n-grams) against profiles of L x E = 24 x 32 (gpt-oss-20b) or 26 x 64 (DeepSeek-V2-Lite). The cost
depends on the shapes only, so the rows are random. Prints the median wall time over --repeats.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from moe_cohort.encoder.ngrams import DEFAULT_NGRAM_DIM
from moe_cohort.train.profile_head import fit_head_features

SHAPES = {"gpt-oss-20b": (24, 32, 4), "DeepSeek-V2-Lite": (26, 64, 6)}  # layers, experts, top-k
EMBEDDING_DIM = 256  # the static encoder's


def time_refit(n: int, layers: int, experts: int, top_k: int, repeats: int, seed: int = 0) -> float:
    """Median seconds of fit_head_features on n random rows of the learner's shapes."""
    rng = np.random.default_rng(seed)
    f = rng.random((n, EMBEDDING_DIM + DEFAULT_NGRAM_DIM), dtype=np.float32)  # [n, F]
    prof = rng.dirichlet(np.ones(experts), size=(n, layers)).astype(np.float32)  # [n, L, E]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fit_head_features(f, prof, top_k, ngram_dim=DEFAULT_NGRAM_DIM)
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="250,500,1000", help="reservoir sizes (observations)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    print(f"{'model':<18} {'n':>6} {'refit s':>8}")
    for model, shape in SHAPES.items():
        for n in (int(s) for s in args.sizes.split(",")):
            print(f"{model:<18} {n:>6} {time_refit(n, *shape, args.repeats):>8.2f}", flush=True)


if __name__ == "__main__":
    main()
