"""What the online learner's head costs: one refit by reservoir size, and one prediction (issue 26).

    python -m benchmarks.bench_refit [--sizes 250,500,1000] [--repeats 3] [--predictions 300] [--cpu]
    python -m benchmarks.bench_refit --service 16000 [--window 2000]

The learner (train.online) refits train.profile_head's ridge + neighbours on its whole reservoir: n
observations of F = 256 + 4096 features (a stand-in embedding and the hashed n-grams of prompts of
mixed.jsonl, $COHORT_DATA: real texts, since the refit reads their sparsity) against random profiles
of L x E = 24 x 32 (gpt-oss-20b) or 26 x 64 (DeepSeek-V2-Lite). Prints the median wall time over
--repeats of a refit that searches its penalty (3 leave-one-out candidates: while the reservoir grows,
and every 4th refit once it is full) and of one that reuses the last penalty (the others).

Then what the proxy pays per request for a head fitted on n rows: the n-grams of one prompt of
mixed.jsonl ($COHORT_DATA; real texts, since their sparsity is what the prediction reads) and the
head's prediction from its features (ProfileHead.from_features, ridge and neighbours), beside the
same products over every feature (f @ weight, f @ memory.T): median microseconds over --predictions
prompts, one at a time, BLAS on one thread as the proxy's admission runs.

--service N: the proxy's learning worker over N requests, as `cohort serve --learn` runs it (default
capacity 1,000 and sample rate 0.05; the reservoir decides on arrival, its rows and the live-fit ones are
observed, a refit when due, and a save to a temporary folder after it at most once a minute of --rate requests
per second), the tiny MoE's shape (4 x 64, top-4):
thread CPU per request in each --window of requests, split into observing, refitting and saving. What
the proxy's counter cohort_learning_cpu_seconds_total{thread="worker"} counts, without the proxy.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

import numpy as np

from threadpoolctl import threadpool_limits

from benchmarks.heldout import prompt_texts
from moe_cohort.encoder.ngrams import DEFAULT_NGRAM_DIM, hashed_ngrams
from moe_cohort.encoder.profile import head_features
from moe_cohort.traces.observed import Observed
from moe_cohort.train.online import LearnConfig, OnlineLearner
from moe_cohort.train.profile_head import fit_head_features

SHAPES = {"gpt-oss-20b": (24, 32, 4), "DeepSeek-V2-Lite": (26, 64, 6)}  # layers, experts, top-k
EMBEDDING_DIM = 256  # the static encoder's


def time_refit(n: int, layers: int, experts: int, top_k: int, repeats: int, texts: list[str],
               alphas: tuple[float, ...] = (0.3, 1.0, 3.0), seed: int = 0, clock=time.perf_counter) -> float:
    """Median seconds of fit_head_features on n rows of the learner's shapes (the texts cycled) and `alphas`,
    on `clock` (wall time, or time.process_time: the CPU of all the process's threads)."""
    rng = np.random.default_rng(seed)
    rows = [texts[i % len(texts)] for i in range(n)]
    f = head_features(rng.normal(size=(n, EMBEDDING_DIM)).astype(np.float32), rows, DEFAULT_NGRAM_DIM)  # [n, F]
    prof = rng.dirichlet(np.ones(experts), size=(n, layers)).astype(np.float32)  # [n, L, E]
    times = []
    for _ in range(repeats):
        start = clock()
        fit_head_features(f, prof, top_k, alphas, ngram_dim=DEFAULT_NGRAM_DIM)
        times.append(clock() - start)
    return float(np.median(times))


def time_predict(n: int, layers: int, experts: int, top_k: int, texts: list[str], seed: int = 0) -> dict[str, float]:
    """Median microseconds per prompt: its n-grams, the head's prediction, and the dense products it replaces."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(len(texts), EMBEDDING_DIM)).astype(np.float32)  # [P, D] stand-in embeddings
    f = head_features(x, texts, DEFAULT_NGRAM_DIM)  # [P, F] real n-grams
    prof = rng.dirichlet(np.ones(experts), size=(n, layers)).astype(np.float32) * top_k  # [n, L, E]
    head = fit_head_features(f[rng.integers(0, len(texts), n)], prof, top_k, (1.0,), ngram_dim=DEFAULT_NGRAM_DIM)
    memory_t = np.ascontiguousarray(head.memory_x.T)  # [F, n]

    def median_us(fn) -> float:
        times = []
        for i in range(len(texts)):
            start = time.perf_counter()
            fn(i)
            times.append(time.perf_counter() - start)
        return float(np.median(times) * 1e6)

    with threadpool_limits(1, "blas"):
        return {"ngrams": median_us(lambda i: hashed_ngrams(texts[i: i + 1], DEFAULT_NGRAM_DIM)),
                "predict": median_us(lambda i: head.from_features(f[i: i + 1])),
                "dense products": median_us(lambda i: (f[i: i + 1] @ head.weight, f[i: i + 1] @ memory_t))}


def time_service(requests: int, layers: int, experts: int, top_k: int, texts: list[str], window: int,
                 sample_rate: float = 0.05, seed: int = 0, rate: float = 20.0) -> list[dict[str, float]]:
    """Per `window` requests, the worker's thread CPU per request (us) observing, refitting and saving, the requests
    arriving at `rate` per second (the saves follow the clock: LearnConfig.save_every_s)."""
    rng, coin = np.random.default_rng(seed), random.Random(seed)
    f = head_features(rng.normal(size=(len(texts), EMBEDDING_DIM)).astype(np.float32), texts, DEFAULT_NGRAM_DIM)
    decode = 32  # tokens generated per request
    counts = rng.multinomial(decode, np.ones(experts) / experts, size=(len(texts), layers)) * top_k  # [P, L, E]
    learner, folder = OnlineLearner(LearnConfig()), tempfile.mkdtemp(prefix="bench-refit-")
    spent, out = np.zeros(3), []  # observe, refit, save: thread seconds in this window
    with threadpool_limits(1, "blas"):
        for i in range(requests):
            j = i % len(texts)
            kept = learner.reservoir.offer()
            if kept or coin.random() < sample_rate:
                # predicted on arrival by the proxy (admission's cost, not learning's)
                predicted = learner.head.from_features(f[j: j + 1])[0] if learner.head else None
                obs = Observed(np.zeros((layers, experts), np.int64), counts[j], 8, decode)
                t0 = time.thread_time()
                learner.observe(f[j: j + 1], [obs], [predicted], [kept])
                t1 = t2 = t3 = time.thread_time()
                if learner.due():
                    learner.refit()
                    t2 = time.thread_time()
                    learner.save_when_due(folder, i / rate)  # as the proxy does, on the clock of `rate` requests/s
                    t3 = time.thread_time()
                spent += (t1 - t0, t2 - t1, t3 - t2)
            if (i + 1) % window == 0:
                us = spent / window * 1e6
                out.append({"requests": i + 1, "refits": learner.refits, "observe": us[0], "refit": us[1],
                            "save": us[2], "all": us.sum()})
                spent[:] = 0
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="250,500,1000", help="reservoir sizes (observations)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cpu", action="store_true", help="time refits in CPU seconds of all threads instead of wall "
                   "seconds (steadier on a shared host)")
    p.add_argument("--predictions", type=int, default=300, help="prompts timed one by one (0: no prediction timing)")
    p.add_argument("--service", type=int, default=0, help="simulate the learning worker over this many requests")
    p.add_argument("--window", type=int, default=2000, help="--service: requests per printed row")
    p.add_argument("--rate", type=float, default=20.0, help="--service: requests per second (the clock saves follow)")
    args = p.parse_args()
    if args.service:
        print(f"the learning worker, tiny MoE shape (4 x 64, top-4): thread CPU us per request over each {args.window}")
        rows = time_service(args.service, 4, 64, 4, prompt_texts(), args.window, rate=args.rate)
        for row in rows:
            print(f"requests {row['requests'] - args.window:>6}-{row['requests']:<6} observe {row['observe']:5.0f} "
                  f"refit {row['refit']:5.0f} save {row['save']:5.0f} all {row['all']:5.0f}"
                  f"   ({row['refits']} refits so far)", flush=True)
        late = rows[len(rows) // 2:]
        print(f"requests {late[0]['requests'] - args.window}-{args.service}: {np.mean([r['all'] for r in late]):.0f} us "
              f"per request (refits land in few windows: the mean over many is the cost)")
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    texts = prompt_texts()
    clock = time.process_time if args.cpu else time.perf_counter
    print(f"{'model':<18} {'n':>6} {'search s':>9} {'reuse s':>8}" + ("   (CPU seconds)" if args.cpu else ""))
    for model, shape in SHAPES.items():
        for n in sizes:
            search, reuse = (time_refit(n, *shape, args.repeats, texts, a, clock=clock) for a in ((0.3, 1.0, 3.0), (1.0,)))
            print(f"{model:<18} {n:>6} {search:>9.2f} {reuse:>8.2f}", flush=True)
    if not args.predictions:
        return
    texts = texts[: args.predictions]
    print(f"\none request, median us over {len(texts)} prompts: n-grams; prediction; the dense products it replaces")
    for model, shape in SHAPES.items():
        for n in sizes:
            t = time_predict(n, *shape, texts)
            print(f"{model:<18} {n:>6} {t['ngrams']:>8.0f} {t['predict']:>8.0f} {t['dense products']:>8.0f}", flush=True)


if __name__ == "__main__":
    main()
