"""Routing over R replicas of S slots each, on held-out requests only (issue 18, "Measure it with the engine replay").

    python -m benchmarks.bench_replicas --finetuned /tmp/cohort-cache/ft-encoder [--replicas 2,4] [--slots 16,32]
                                        [--load 0,0.8]

The held-out side of the project's one split (benchmarks.heldout) is replayed through R replicas of S
slots (eval.replicas), lognormal output lengths (mean 64, sigma 1), 5 seeds, all requests
arriving at step 0 (saturation), for these routings (admission.router):

    random              least-loaded in a random arrival order (the yardstick of every saving)
    round-robin         trace order, request i to replica i mod R, FCFS per replica
    least-loaded        trace order, one shared FCFS queue, a free slot takes the oldest
    affinity            one shared pool; a replica's free slot takes the request with the fewest
                        expected new experts for THAT replica, by the profiles the fine-tuned
                        encoder's profile head predicts from text (`cohort train` saved it beside
                        the encoder; else fitted here on the training side)
    affinity-reference  affinity by the traces' own profiles (the yardstick of capture)

and, for reference, one engine of R*S slots with the same admission (single-affinity) and the
traces' (single-reference), each against its own random order. Loads per token are summed over
the replicas' steps; idle-while-queued counts the steps in which a replica had a free slot while
a request waited (0 by construction for least-loaded and affinity, which the replay asserts).

--load L > 0 replays the same requests arriving as a Poisson process of L * R * S / 64 requests
per step instead (L = 1: as many arrivals as the replicas finish, on average), where a queue is
rare and pool admission has little to choose from (the random row then also moves which request
arrives when, so read these tables against least-loaded, which the summary line does).
"""

from __future__ import annotations

import argparse
import time

from benchmarks.heldout import TRACES, HeldOut, data_path, embeddings
from moe_cohort.eval.cost import parse_cost_model
from moe_cohort.eval.engine import lengths_from_spec
from moe_cohort.eval.replay import decode_tokens
from moe_cohort.eval.replicas import evaluate_with_single, format_replica_table, poisson_arrivals, routings_for
from moe_cohort.traces.importers import load_traces


def main() -> None:
    args = _parse()
    data = HeldOut.of(load_traces(args.traces or data_path(TRACES)))
    x = embeddings(data.traces.texts, args.finetuned, args.cache)  # [N, D]
    head = data.head(x, args.finetuned)  # the one `cohort train` saved, else fitted on the training side
    print(f"encoder: {args.finetuned or 'packaged MiniLM'}; profile head alpha {head.alpha:g}, mix {head.mix:g}")
    held = data.held
    predicted = head.predict(x[data.held_idx], data.held_texts).reshape(len(held), -1)  # [n, L*E]
    own = data.reference.reshape(len(held), -1)  # [n, L*E]
    tokens = decode_tokens(held)
    cost = parse_cost_model(args.cost_model)
    lengths = lengths_from_spec(args.lengths, held.request_ids)
    print(f"held-out: {len(held)} of {len(data.traces)} requests; lengths {args.lengths} (mean 64); cost model {cost.name}; "
          f"{args.seeds} seeds\n")
    routings = routings_for("all", predicted=predicted, reference=own)
    for load in _floats(args.load):
        print(f"== {'all requests arrive at step 0 (saturation)' if load == 0 else f'Poisson arrivals, load {load:g}'}\n")
        summary = []
        for r in _ints(args.replicas):
            for s in _ints(args.slots):
                begin = time.perf_counter()
                arrivals = None if load == 0 else (lambda seed, rate=load * r * s / 64: poisson_arrivals(len(held), rate, seed))
                result = evaluate_with_single(tokens, r, s, routings, lengths, cost, held.num_layers, seeds=args.seeds,
                                              arrivals=arrivals)
                print(format_replica_table(result) + f"\n({time.perf_counter() - begin:.1f} s)\n")
                summary.append(result)
        _targets(summary, load)
        print()


def _targets(results: list[dict], load: float) -> None:
    """Saturation: issue 18's replay target per (R, S), affinity saves more than one engine of R*S, and no
    idle-while-queued. Poisson arrivals: loads/token against least-loaded at the same arrival times."""
    for r in results:
        rows, total = r["plans"], r["replicas"] * r["slots"]
        head = f"R = {r['replicas']} x S = {r['slots']:>2}:"
        if load > 0:
            vs = lambda name: 1 - rows[name]["loads_per_token"] / rows["least-loaded"]["loads_per_token"]  # noqa: E731
            print(f"{head} loads/token saved vs least-loaded at the same arrivals: " +
                  ", ".join(f"{n} {vs(n):.2%}" for n in ("affinity", "affinity-reference")))
            continue
        aff, single = rows["affinity"], rows[f"single-affinity (1x{total})"]
        print(f"{head} affinity {aff['saving']:.2%} (std {aff['saving_std']:.2%}) vs one engine of {total} slots "
              f"{single['saving']:.2%} -> more: {aff['saving'] > single['saving']}; idle-while-queued steps: affinity {aff['violations']}, "
              f"least-loaded {rows['least-loaded']['violations']}, round-robin {rows['round-robin']['violations']}")


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v.strip()]


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--traces", help=f"trace folder (default: $COHORT_DATA/{TRACES})")
    p.add_argument("--finetuned", help="fine-tuned encoder folder from `cohort train` (default: the base encoder)")
    p.add_argument("--replicas", default="2,4")
    p.add_argument("--slots", default="16,32")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--lengths", default="lognormal")
    p.add_argument("--cost-model", default="deepseek-v2-lite")
    p.add_argument("--load", default="0", help="0: all at step 0; L > 0: Poisson arrivals at L x capacity (a list)")
    p.add_argument("--cache", default="/tmp/cohort-bench-cache", help="embedding cache (outside the repository)")
    return p.parse_args()


if __name__ == "__main__":
    main()
