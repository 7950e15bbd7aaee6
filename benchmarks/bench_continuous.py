"""Admission policies in the continuous-batching engine, on held-out requests only (issue 13, Measure).

    python -m benchmarks.bench_continuous --finetuned FOLDER [--slots 8,16,32,64] [--seeds 5]

Splits the traces ($COHORT_DATA/deepseek-v2-lite-puffin unless --traces) by request with the
project's one split (train.heldout over traces.split: 20% held out, seed 0);
the fine-tuned encoder (`cohort train`, which trains on the training side of the same split)
and both profile heads see training requests only. The held-out requests are then replayed
through S slots with lognormal output lengths (mean 64, sigma 1), 5 seeds, for: random,
arrival, the static plan order (fine-tuned encoder, B = S), every text policy (nearest
embedding, profile head) for the base and the fine-tuned encoder, and
the reference that knows the traces. The profile heads: the one saved in FOLDER by `cohort
train` when present, else fitted here on the training side; the base encoder's is always
fitted here. Embeddings are cached in --cache (outside the repository).

Prints one table per S, the targets of issue 13, the S = 16 table again under a fairness bound
(--max-wait steps), and the cost of one admission over a pool of 1,000.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

from moe_cohort.admission.resident import ResidentExperts
from moe_cohort.eval.cost import parse_cost_model
from moe_cohort.eval.engine import REFERENCE, evaluate_continuous, lengths_from_spec
from moe_cohort.eval.policies import by_profile, fixed_order
from moe_cohort.eval.replay import decode_tokens
from moe_cohort.eval.replay_cli import text_policies
from moe_cohort.eval.report import format_engine_table
from moe_cohort.traces.importers import load_traces
from moe_cohort.train.heldout import TRACES, HeldOut, data_path, embeddings


def main() -> None:
    args = _parse()
    data = HeldOut.of(load_traces(args.traces or data_path(TRACES)))
    encoders = {"base": None, **({"ft": args.finetuned} if args.finetuned else {})}
    text = {}
    for tag, enc in encoders.items():
        x = embeddings(data.traces.texts, enc, args.cache)  # [N, D]
        head = data.head(x, enc)
        text[tag] = (x[data.held_idx], head)
        print(f"encoder {tag}: {enc or 'packaged MiniLM'}; profile head alpha {head.alpha:g}")
    held = data.held
    tokens = decode_tokens(held)
    cost = parse_cost_model(args.cost_model)
    lengths = lengths_from_spec(args.lengths, held.request_ids)
    print(f"held-out: {len(held)} of {len(data.traces)} requests; lengths {args.lengths} (mean 64); cost model {cost.name}; "
          f"{args.seeds} seeds\n")
    results = [_run(data, tokens, s, text, cost, lengths, args.seeds) for s in _ints(args.slots)]
    _targets(results)
    if args.max_wait:
        print(f"\nS = 16 with the fairness bound: a request that has waited {args.max_wait} steps goes first, oldest "
              f"first (all requests arrive at step 0, so from step {args.max_wait} on the rest is first come, first served)")
        _run(data, tokens, 16, text, cost, lengths, args.seeds, max_wait=args.max_wait)
    _admission_cost(text[list(text)[-1]][1], held.num_layers, held.num_experts)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


def _run(data: HeldOut, tokens, slots, text, cost, lengths, seeds, max_wait=None) -> dict:
    from moe_cohort.encoder.planner import plan_batches

    x_plan = text[list(text)[-1]][0]
    policies = {"arrival": fixed_order(np.arange(len(data.held))), "plan": fixed_order(np.concatenate(plan_batches(x_plan, slots)))}
    for tag, (x, head) in text.items():
        policies.update(text_policies(f"-{tag}", x, head))
    policies[REFERENCE] = by_profile(data.reference)
    start = time.perf_counter()
    result = evaluate_continuous(tokens, slots, policies, lengths, cost, data.held.num_layers, seeds=seeds,
                                 max_wait=max_wait)
    queue = ", ".join(f"{k} {v['max_queue_steps']}" for k, v in result["plans"].items())
    print(format_engine_table(result) + f"\nlongest queue (steps): {queue}\n({time.perf_counter() - start:.1f} s)\n")
    return result


def _targets(results: list[dict]) -> None:
    """Issue 13's targets, per S: best text policy vs the reference and vs random's spread."""
    for r in results:
        rows = r["plans"]
        ref = rows[REFERENCE]
        texts = {k: v for k, v in rows.items() if k.startswith("text-")}
        best = max(texts, key=lambda k: texts[k]["saving"])
        worst = min(texts, key=lambda k: texts[k]["saving"])
        print(f"S = {r['slots']:>2}: best text {best} {texts[best]['saving']:.2%} = {texts[best]['capture']:.0%} of the "
              f"reference {ref['saving']:.2%} (>= 95%: {texts[best]['capture'] >= 0.95}; >= 110%: "
              f"{texts[best]['capture'] >= 1.10}); worst text {worst} {texts[worst]['saving']:+.2%} "
              f"(std {texts[worst]['saving_std']:.2%}; within the spread of random: "
              f"{texts[worst]['saving'] >= -texts[worst]['saving_std']})")


def _admission_cost(head, layers: int, experts: int, pool: int = 1000, resident: int = 32) -> None:
    """Microseconds of one pick among `pool` waiting requests with `resident` residents."""
    profiles_ = head.predict(np.random.default_rng(0).normal(size=(pool, head.dim)).astype(np.float32) * 0.05)
    flat = np.ascontiguousarray(profiles_.reshape(pool, -1))
    state = ResidentExperts(layers, experts)
    for i in range(resident):
        state.admit(flat[i])
    allowed = np.ones(pool, bool)
    with threadpool_limits(limits=1, user_api="blas"):
        state.pick(flat, allowed)
        start, reps = time.perf_counter(), 200
        for _ in range(reps):
            state.pick(flat, allowed)
    print(f"\nadmission: one pick over a pool of {pool} ({layers} x {experts} profiles): "
          f"{(time.perf_counter() - start) / reps * 1e6:.0f} us")


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--traces", help=f"trace folder (default: $COHORT_DATA/{TRACES})")
    p.add_argument("--finetuned", help="fine-tuned encoder folder from `cohort train` (default: base encoder only)")
    p.add_argument("--slots", default="8,16,32,64")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--lengths", default="lognormal")
    p.add_argument("--cost-model", default="deepseek-v2-lite")
    p.add_argument("--cache", default="/tmp/cohort-bench-cache", help="embedding cache (outside the repository)")
    p.add_argument("--max-wait", type=int, default=400, help="fairness bound (steps) of the extra S = 16 run; 0: skip")
    p.add_argument("--json", help="also write the results to this file")
    return p.parse_args()


if __name__ == "__main__":
    main()
