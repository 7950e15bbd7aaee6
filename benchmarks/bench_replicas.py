"""Routing over R replicas of S slots each, on held-out requests only, against Ray Serve's routers.

    python -m benchmarks.bench_replicas [--traces A,B] [--finetuned NAME=FOLDER,...] [--replicas 2,4,8]
        [--slots 16] [--seeds 5] [--lengths auto] [--load 0,0.8] [--no-kept-full] [--single]

Per model (the trace folders of --traces; default both of the data folder: DeepSeek-V2-Lite's prompt
tokens and gpt-oss-20b's generated tokens), the held-out side of the project's one split
(benchmarks.heldout) is replayed through R replicas of S slots (eval.replicas), 5 seeds, all requests
arriving at step 0 (saturation). Decode traces run their own generated tokens for as long as they
ran; prompt-only traces the decode proxy with lognormal output lengths (mean 64, sigma 1); --lengths
lognormal gives every model those lengths (decode traces then cycle through their own tokens). The
routings (admission.router; Ray Serve's and "+inside": benchmarks.ray_routers):

    random              least-loaded in a random arrival order (the yardstick of every saving)
    round-robin         trace order, request i to replica i mod R, FCFS per replica
    power-of-two        Ray Serve's default router: on arrival, two replicas drawn with the run's seed,
                        the one with fewer requests (resident + queued); FCFS per replica
    prefix              Ray Serve LLM's prefix-cache affinity: on arrival, the replica last given the
                        longest matching prefix of the prompt text (its first 64 characters in blocks
                        of 16), power-of-two past a load imbalance of S or without a match
    least-loaded        trace order, one shared FCFS queue, a free slot takes the oldest
    affinity            one shared pool; a replica's free slot takes the request with the fewest
                        expected new experts for THAT replica, by the profiles a profile head predicts
                        from text (the one `cohort train` saved beside a --finetuned encoder, else
                        fitted here on the training side over the packaged encoder's embeddings)
    affinity-reference  affinity by the traces' own profiles (the yardstick of capture)

Kept full (the default; --no-kept-full turns it off): loads and modelled time per generated token count
the spans in which a replica had every slot busy, as a server under steady load runs (full tok:
the share of the tokens generated in them), and the table keeps the all-steps loads per token and
saving beside. idle-while-queued counts the steps
in which a replica had a free slot while a request waited (0 by construction for least-loaded and
affinity, which the replay asserts; the routings that bind on arrival can break it). Then per
model and R: the saving of affinity (and of affinity-reference) against each other routing, paired
per seed (1 - loads per token / the other's, same seed), mean and spread; n/a where a replay had no
span with a full replica to count (more slots than waiting requests).

--single adds one engine of R*S slots with the same admission (single-affinity) and the traces'
(single-reference), each against its own random order. --load L > 0 replays the same requests
arriving as a Poisson process of L * R * S / 64 requests per step instead (L = 1: as many arrivals
as the replicas finish, on average), where a queue is rare and pool admission has little to choose
from (the random row then also moves which request arrives when: read those tables by the paired
comparisons).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from benchmarks.bench_continuous import MODELS, held_lengths
from benchmarks.heldout import HeldOut, data_path, embeddings
from benchmarks.ray_policies import routings_for
from moe_cohort.eval.cost import parse_cost_model
from moe_cohort.eval.engine import lengths_from_spec
from moe_cohort.eval.replay import decode_tokens
from moe_cohort.eval.replicas import evaluate_replicas, evaluate_with_single, format_replica_table
from moe_cohort.traces.importers import load_traces

# affinity brings affinity-reference; "+inside": each replica admits from its own queue by fit (our scheduler)
ROUTINGS = ("round-robin,power-of-two,prefix,least-loaded,affinity,"
            "round-robin+inside,power-of-two+inside,prefix+inside")
AGAINST = ("power-of-two", "prefix", "least-loaded", "round-robin", "power-of-two+inside")  # the paired columns
PAIRED = ("affinity", "affinity-reference", "power-of-two+inside", "prefix+inside", "round-robin+inside")  # rows


def poisson_arrivals(n: int, rate: float, seed: int) -> np.ndarray:  # [N] sorted int64 steps, the first at 0
    """Arrival steps of a Poisson process of `rate` requests per step (e.g. load * R * S / mean length)."""
    gaps = np.random.default_rng([seed, 104729]).exponential(1.0 / rate, n)  # [N]
    return np.floor(np.cumsum(gaps) - gaps[0]).astype(np.int64)


def main() -> None:
    args = _parse()
    finetuned = dict(pair.split("=", 1) for pair in args.finetuned.split(",") if pair.strip())  # folder name -> encoder
    for path in (args.traces.split(",") if args.traces else [str(data_path(m)) for m in MODELS]):
        print(f"\n===== {path} =====")
        measure_model(load_traces(path), finetuned.get(Path(path).name), _ints(args.replicas), _ints(args.slots),
                      args.seeds, _floats(args.load), cache=args.cache, cost_model=args.cost_model,
                      kept_full=args.kept_full, single=args.single, length_spec=args.lengths)


def measure_model(ts, encoder: str | None, replicas: list[int], slots: list[int], seeds: int, loads: list[float], *,
                  cache: str | None = None, cost_model: str = "deepseek-v2-lite", kept_full: bool = True,
                  single: bool = False, length_spec: str = "auto", embed=None, report=print) -> list[dict]:
    """Every (load, R, S) replay summary of one trace set's held-out side, each with its paired `against` rows."""
    data = HeldOut.of(ts)
    x = (embed or (lambda texts, enc: embeddings(texts, enc, cache)))(list(ts.texts), encoder)  # [N, D]
    head = data.head(x, encoder)  # the one `cohort train` saved, else fitted on the training side
    report(f"encoder: {encoder or 'packaged MiniLM'}; profile head alpha {head.alpha:g}, mix {head.mix:g}")
    held = data.held
    predicted = head.predict(x[data.held_idx], data.held_texts).reshape(len(held), -1)  # [n, L*E]
    own = data.reference.reshape(len(held), -1)  # [n, L*E]
    tokens = decode_tokens(held)
    cost = parse_cost_model(cost_model)
    if length_spec == "auto":
        lengths = held_lengths(held, tokens.mode)
        told = "their own lengths" if tokens.mode == "real" else "lognormal lengths, mean 64"
    else:
        lengths, told = lengths_from_spec(length_spec, held.request_ids), f"{length_spec} lengths, mean 64"
    report(f"held-out: {len(held)} of {len(ts)} requests, {tokens.mode} decode tokens ({told}); "
           f"cost model {cost.name}; {seeds} seeds; {'kept full' if kept_full else 'all steps'}\n")
    routings = routings_for(ROUTINGS, predicted=predicted, reference=own, texts=data.held_texts)
    evaluate = evaluate_with_single if single else evaluate_replicas
    results = []
    for load in loads:
        arriving = "all requests arrive at step 0 (saturation)" if load == 0 else f"Poisson arrivals, load {load:g}"
        report(f"== {arriving}\n")
        for r in replicas:
            for s in slots:
                begin, rate = time.perf_counter(), load * r * s / 64
                arrivals = None if load == 0 else (lambda seed, rate=rate: poisson_arrivals(len(held), rate, seed))
                result = evaluate(tokens, r, s, routings, lengths, cost, held.num_layers, seeds=seeds,
                                  arrivals=arrivals, kept_full=kept_full)
                result["load"], result["against"] = load, paired(result["plans"])
                if kept_full:
                    result["against_all_steps"] = paired({k: v["all_steps"] for k, v in result["plans"].items()})
                report(format_replica_table(result) + f"\n({time.perf_counter() - begin:.1f} s)\n")
                results.append(result)
        block = results[-len(replicas) * len(slots):]
        report(format_paired(block, "against", "kept full" if kept_full else "all steps") + "\n")
        if kept_full:
            report(format_paired(block, "against_all_steps", "all steps") + "\n")
    return results


def paired(rows: dict) -> dict:
    """name -> other -> (mean, std over seeds) of 1 - loads per token of `name` / of `other`, seed by seed
    (each seed's saving vs random shares that seed's random baseline, so the ratio of (1 - saving) is it)."""
    out = {}
    for name in (n for n in PAIRED if n in rows):
        mine = 1.0 - np.array(rows[name]["saving_per_seed"])  # [seeds] loads per token / random's
        out[name] = {}
        for other in AGAINST:
            with np.errstate(divide="ignore", invalid="ignore"):  # a row without full spans: nan
                vs = 1.0 - mine / (1.0 - np.array(rows[other]["saving_per_seed"]))  # [seeds]
            out[name][other] = (float(vs.mean()), float(vs.std()))
    return out


def format_paired(results: list[dict], key: str = "against", steps: str = "kept full") -> str:
    """Per R x S: the paired saving (`key` of each result) of each row of PAIRED against each routing of AGAINST,
    and the idle steps."""
    lines = [f"fewer decode expert loads per generated token than ... ({steps}; paired per seed, mean +- std "
             "over seeds)",
             f"{'R x S':<8} {'routing':<19} " + " ".join(f"{'vs ' + o:>24}" for o in AGAINST)]
    for r in results:
        for name, vs in r[key].items():
            lines.append(f"{r['replicas']:>2} x {r['slots']:<3} {name:<19} " +
                         " ".join(f"{m:>+16.2%} +- {s:>4.1%}" if np.isfinite(m) else f"{'n/a':>24}"
                                  for m, s in (vs[o] for o in AGAINST)))
        idle = ", ".join(f"{n} {r['plans'][n]['violations']}" for n in ("round-robin", "power-of-two", "prefix",
                                                                           "least-loaded", "affinity"))
        lines.append(f"{'':<8} idle-while-queued steps: {idle}")
    return "\n".join(lines)


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v.strip()]


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--traces", help="trace folders, comma-separated (default: both models of the data folder)")
    p.add_argument("--finetuned", default="", help="NAME=FOLDER,...: a trace folder's fine-tuned encoder from "
                                                   "`cohort train` (default: the packaged encoder)")
    p.add_argument("--replicas", default="2,4,8")
    p.add_argument("--slots", default="16")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--lengths", default="auto", help="auto: decode traces their own, else lognormal (mean 64); "
                                                     "or lognormal[:SIGMA], fixed, FILE for every model (eval.engine)")
    p.add_argument("--cost-model", default="deepseek-v2-lite")
    p.add_argument("--load", default="0", help="0: all at step 0; L > 0: Poisson arrivals at L x capacity (a list)")
    p.add_argument("--no-kept-full", dest="kept_full", action="store_false", help="per token over every step")
    p.add_argument("--single", action="store_true", help="also one engine of R*S slots with the affinity rows")
    p.add_argument("--cache", default="/tmp/cohort-bench-cache", help="embedding cache (outside the repository)")
    return p.parse_args()


if __name__ == "__main__":
    main()
