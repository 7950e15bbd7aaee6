"""`cohort replay`: the admission policies in a replay of vLLM's continuous batching (eval.engine).

Policies, in the order of the output (random is always first):
    arrival          admission in trace (file) order
    plan             a static plan's batches one after another: the --plan file, else the
                     encoder's plan of batches of --batch-size (default: S)
    text-nearest     nearest embedding to the resident set (the --encoder's embeddings)
    text-profile     fewest expected new experts by the profile head saved with the encoder
                     (`cohort train` writes it beside the fine-tuned encoder)
    reference        fewest expected new experts by the traces' own profiles

Loads and time per token count the steps with every slot busy (the engine kept full) unless
--no-kept-full, or --replicas or --report, which count every step.

With --replicas R: R replicas of S slots behind a router instead (eval.replicas; --replica-routing picks
round-robin, least-loaded, affinity or all), beside one engine of R*S slots for reference.
Static plans are `cohort eval` (cli.eval), whose trace flags this command shares.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import numpy as np

from moe_cohort.encoder.plans import Plan, PlanError, read_plan_file
from moe_cohort.cli.checks import (encoder_problem, engine_problem, int_list, nonnegative_float, path_problem,
                                  positive_int, share)
from moe_cohort.cli.eval import add_input_arguments, embed_traces, fail, load_input
from moe_cohort.eval.cost import DEFAULT_COST_MODEL, PRESETS, parse_cost_model
from moe_cohort.eval.engine import DEFAULT_MEAN_LENGTH, REFERENCE, evaluate_continuous, lengths_from_spec
from moe_cohort.eval.policies import Policy, by_embedding, by_profile, fixed_order
from moe_cohort.eval.replay import DecodeTokens, decode_profiles, decode_tokens
from moe_cohort.traces.format import TraceFormatError, TraceSet

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_input_arguments(parser)
    parser.add_argument("--slots", type=positive_int, default=16, help="resident requests S (default %(default)s)")
    parser.add_argument("--batch-size", type=positive_int, default=None,
                        help="B of the encoder's plan in the 'plan' row (default: S)")
    parser.add_argument("--lengths", default="lognormal",
                        help="output lengths, fixed | lognormal[:SIGMA] | FILE (default %(default)s; decode traces run "
                             "as long as they ran)")
    parser.add_argument("--mean-length", type=positive_int, default=DEFAULT_MEAN_LENGTH,
                        help="mean output length of fixed/lognormal (default %(default)s)")
    parser.add_argument("--cost-model", default=DEFAULT_COST_MODEL,
                        help=f"{', '.join(PRESETS)} or 'A8,A128,B' in us (default %(default)s)")
    parser.add_argument("--non-moe-us", type=nonnegative_float, default=None,
                        help="us per step outside the MoE blocks (default: from --moe-share)")
    parser.add_argument("--moe-share", type=share, default=None, help="MoE share of a random-order step (default 0.73)")
    parser.add_argument("--max-queue-steps", type=nonnegative_float, default=None,
                        help="fairness bound, the setting max_queue_ms counted in engine steps: a request that has "
                             "waited this many steps goes first (default: none)")
    parser.add_argument("--clients", type=positive_int, default=None,
                        help="closed-loop clients sending the requests (at most clients - S wait; default: every "
                             "request waits from the start)")
    parser.add_argument("--kept-full", action=argparse.BooleanOptionalAction, default=None,
                        help="loads and time per token over the steps with every slot busy only (the engine kept "
                             "full, as on a loaded server), not the drain at the end where the last requests run "
                             "beside free slots (default: on for one engine; off with --replicas or --report, which "
                             "count every step)")
    parser.add_argument("--replicas", type=positive_int, default=None,
                        help="R replicas of --slots each behind a router (default: one engine)")
    parser.add_argument("--replica-routing", choices=("round-robin", "least-loaded", "affinity", "all"), default="all",
                        help="with --replicas: which routings to replay beside random (default %(default)s)")
    parser.add_argument("--report", metavar="DIR",
                        help="also write report.json, report.md, saving.png and moe_time.png to DIR: static plans "
                             "against the replay at every S of --sweep")
    parser.add_argument("--sweep", type=int_list, default="8,16,32,64",
                        help="slot counts S (and batch sizes B) of the report, comma-separated (default %(default)s)")


def run(args: argparse.Namespace) -> int:
    """Print the table (or JSON), and with --report the sweep over S."""
    from moe_cohort.eval.report import format_engine_table

    problem = path_problem(args) or engine_problem(args) or encoder_problem(args.encoder)
    if args.replicas is not None and args.report:
        problem = "--report draws one engine against S; leave it out with --replicas"
    one_engine = args.replicas is None and not args.report
    if (args.clients is not None or args.kept_full) and not one_engine:
        problem = (f"{'--clients' if args.clients is not None else '--kept-full'} replays one engine at --slots; "
                   f"leave out --replicas and --report")
    if problem:
        return fail(problem, "replay")
    args = _with(args, kept_full=one_engine if args.kept_full is None else args.kept_full)
    try:
        ts = load_input(args)
        plan = read_plan_file(args.plan, ts.request_ids) if args.plan else None
        text = text_side(ts, args.encoder, progress=not args.no_progress)
        result = run_continuous(args, ts, plan, text) if args.replicas is None else run_replicas(args, ts, text)
    except (TraceFormatError, PlanError, OSError, ValueError) as exc:
        return fail(str(exc), "replay")
    if args.replicas is not None:
        from moe_cohort.eval.replicas import format_replica_table

        print(json.dumps(result, indent=2) if args.json else format_replica_table(result))
        return 0
    print(json.dumps(result, indent=2) if args.json else format_engine_table(result))
    if args.report:
        for path in engine_report(args, ts, text, result):
            print(f"wrote {path}")
    return 0


def text_side(ts: TraceSet, encoder: str | None, *, progress: bool = False) -> tuple:
    """(embeddings [N, D], profile head or None) from --encoder; (None, None) without texts or with 'none'."""
    x = embed_traces(ts, encoder, progress=progress)
    if x is None:
        return None, None
    from moe_cohort.encoder.profile import load_profile_head

    head = load_profile_head(encoder) if encoder and Path(encoder).is_dir() else None
    if head is None:
        log.info("no profile head beside encoder %s (cohort train writes one): text-profile left out", encoder)
    return x, head


def run_continuous(args: argparse.Namespace, ts: TraceSet, plan: Plan | None, text: tuple) -> dict:
    """One replay summary (eval.engine.evaluate_continuous) at S = args.slots for the CLI's options.

    `text` is (embeddings [N, D] or None, profile head or None), from `text_side`."""
    tokens = decode_tokens(ts, args.decode)
    lengths = _lengths(args, ts, tokens)
    cost = parse_cost_model(args.cost_model, args.non_moe_us, args.moe_share)
    x, head = text
    policies = continuous_policies(ts, tokens, args.slots, x=x, head=head, plan=plan, batch_size=args.batch_size)
    return evaluate_continuous(tokens, args.slots, policies, lengths, cost, ts.num_layers, seeds=args.seeds,
                               max_wait=args.max_queue_steps, clients=args.clients, kept_full=args.kept_full)


def run_replicas(args: argparse.Namespace, ts: TraceSet, text: tuple) -> dict:
    """R = args.replicas replicas of S = args.slots (eval.replicas) for --replica-routing, with one engine of R*S for reference."""
    from moe_cohort.eval.replicas import evaluate_with_single, routings_for

    tokens = decode_tokens(ts, args.decode)
    x, head = text
    flat = lambda p: p.reshape(len(ts), -1)  # noqa: E731  [N, L, E] -> [N, L*E]
    predicted = None if head is None else flat(head.predict(x, _texts(ts)))
    routings = routings_for(args.replica_routing, predicted=predicted, embeddings=x,
                            reference=flat(decode_profiles(tokens, ts)))
    cost = parse_cost_model(args.cost_model, args.non_moe_us, args.moe_share)
    return evaluate_with_single(tokens, args.replicas, args.slots, routings, _lengths(args, ts, tokens), cost,
                                ts.num_layers, seeds=args.seeds, max_wait=args.max_queue_steps)


def continuous_policies(ts: TraceSet, tokens: DecodeTokens, slots: int, *, x: np.ndarray | None = None, head=None,
                        plan: Plan | None = None, batch_size: int | None = None) -> dict[str, Policy]:
    """The policies of the module docstring that the inputs allow (text ones need x [N, D])."""
    out: dict[str, Policy] = {"arrival": fixed_order(np.arange(len(ts)))}
    if plan is None and x is not None:
        from moe_cohort.encoder.planner import plan_batches

        plan = plan_batches(x, batch_size or slots)
    if plan is not None:
        out["plan"] = fixed_order(np.concatenate(plan))
    if x is not None:
        out.update(text_policies("", x, head, _texts(ts)))
    out[REFERENCE] = by_profile(decode_profiles(tokens, ts))
    return out


def text_policies(suffix: str, x: np.ndarray, head=None, texts: list[str] | None = None) -> dict[str, Policy]:
    """text-nearest{suffix}, and with a profile head text-profile{suffix} (`texts`, one per row of x: what a
    head that reads n-grams needs beside the embeddings)."""
    out = {f"text-nearest{suffix}": by_embedding(x)}
    if head is not None:
        predicted = head.predict(x, texts)  # [N, L, E]
        out[f"text-profile{suffix}"] = by_profile(predicted)
    return out


def _texts(ts: TraceSet) -> list[str] | None:
    return None if ts.texts is None else [str(t) for t in ts.texts]


def _lengths(args: argparse.Namespace, ts: TraceSet, tokens: DecodeTokens):
    if tokens.mode == "real":  # recorded generations run as long as they ran
        own = np.maximum(ts.num_decode_tokens, 1)
        return lambda seed: own
    return lengths_from_spec(args.lengths, ts.request_ids, mean=args.mean_length)


def engine_report(args: argparse.Namespace, ts: TraceSet, text: tuple, result: dict) -> list[Path]:
    """Replays and static evaluations at every S of --sweep, drawn by eval.report.write_engine_report."""
    from moe_cohort.eval.cost import static_moe_us_per_token
    from moe_cohort.eval.metrics import evaluate
    from moe_cohort.eval.report import write_engine_report
    from moe_cohort.traces.loads import expert_masks

    sizes = sorted({*args.sweep, args.slots})  # --sweep: a list of ints (cli.checks.int_list)
    masks = expert_masks(ts, decode_steps=args.mean_length, decode=args.decode)
    cost = parse_cost_model(args.cost_model, args.non_moe_us, args.moe_share)
    planners = {}
    if text[0] is not None:
        from moe_cohort.encoder.planner import plan_batches

        planners["encoder"] = lambda _ts, b: plan_batches(text[0], b)
    static, continuous = [], []
    for s in sizes:
        row = evaluate(ts, s, masks=masks, seeds=args.seeds, planners=planners)
        for r in row["plans"].values():
            r["moe_us_per_token"] = static_moe_us_per_token(cost, r["decode_loads"], len(ts), s, masks.decode_steps,
                                                            ts.num_layers)
        static.append(row)
        continuous.append(result if s == args.slots else run_continuous(_with(args, slots=s), ts, None, text))
    return write_engine_report(static, continuous, args.report)


def _with(args: argparse.Namespace, **changes) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), **changes})
