"""`cohort eval`: compare batching plans on expert traces against random batches and the oracle."""

from __future__ import annotations

import argparse
import json
import sys

from moe_cohort.encoder.plans import PlanError, read_plan_file
from moe_cohort.eval.args import encoder_problem, engine_problem, int_list, path_problem, positive_int
from moe_cohort.eval.engine_cli import add_engine_arguments, heldout_traces, run_engine
from moe_cohort.eval.metrics import evaluate
from moe_cohort.eval.report import format_table, write_report
from moe_cohort.traces.format import TraceFormatError
from moe_cohort.traces.importers import load_traces
from moe_cohort.traces.loads import DEFAULT_DECODE_STEPS, expert_masks


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--traces", required=True,
                        help="trace file or directory (moe-cohort .npz, .jsonl, traces.npz+prompts.jsonl dir, or 'sample')")
    parser.add_argument("--batch-size", type=positive_int, default=None,
                        help="requests per batch (B); required for static batches, the plan's B under --engine continuous")
    parser.add_argument("--plan", help="plan file to evaluate: JSON lines {id, batch[, position]}")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--decode-steps", type=positive_int, default=DEFAULT_DECODE_STEPS,
                        help="decode steps of the prompt-token proxy for prefill-only traces (default %(default)s)")
    parser.add_argument("--decode", choices=("auto", "real", "proxy"), default="auto",
                        help="decode loads from generated tokens (real), the prompt proxy, or auto (default)")
    parser.add_argument("--decode-phase", choices=("aligned", "random"), default="aligned",
                        help="proxy cycles start at token 1 (aligned, default) or at a seeded random offset per request")
    parser.add_argument("--encoder", default=None,
                        help="encoder for the 'encoder' plan, from the traces' texts: local folder or hub name "
                             "(default: the packaged all-MiniLM-L6-v2); 'none' leaves the plan out")
    parser.add_argument("--seeds", type=positive_int, default=5, help="random plans to average (default %(default)s)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar while embedding the traces' texts")
    parser.add_argument("--report", metavar="DIR", help="also write report.json, report.md and saving.png to DIR")
    parser.add_argument("--sweep", type=int_list, default="8,16,32,64",
                        help="batch sizes of the report's plot, comma-separated (default %(default)s)")
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    problem = _argument_problem(args)
    if problem:
        return fail(problem)
    if args.engine == "continuous":
        return run_engine(args)
    try:
        ts = heldout_traces(load_traces(args.traces), args.heldout)
        masks = expert_masks(ts, decode_steps=args.decode_steps, decode=args.decode, phase=args.decode_phase)
        plans = {"plan": read_plan_file(args.plan, ts.request_ids)} if args.plan else {}
        planners = _encoder_planner(ts, args.encoder, progress=not args.no_progress)
        result = evaluate(ts, args.batch_size, masks=masks, seeds=args.seeds, plans=plans, planners=planners)
    except (TraceFormatError, PlanError, OSError) as exc:
        return fail(str(exc))
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    if args.report:
        sizes = sorted({*args.sweep, args.batch_size})
        results = [result if b == args.batch_size else evaluate(ts, b, masks=masks, seeds=args.seeds, planners=planners)
                   for b in sizes]
        for path in write_report(results, args.report):
            print(f"wrote {path}")
    return 0


def _encoder_planner(ts, encoder: str | None, *, progress: bool) -> dict:
    """{"encoder": planner} over the traces' texts, embedded once; {} without texts or with 'none'."""
    if (encoder or "").lower() == "none" or ts.texts is None or not any(t.strip() for t in ts.texts):
        return {}
    from moe_cohort.encoder import embed_texts
    from moe_cohort.encoder.planner import plan_batches

    x = embed_texts(list(ts.texts), encoder=encoder, progress=progress)  # [N, D]
    return {"encoder": lambda _ts, batch_size: plan_batches(x, batch_size)}


def _argument_problem(args: argparse.Namespace) -> str | None:
    """The first bad argument, checked before traces are loaded or anything is embedded."""
    if args.engine == "static" and args.batch_size is None:
        return "--batch-size is required for static batches (or pass --engine continuous --slots S)"
    return (path_problem(args) or (engine_problem(args) if args.engine == "continuous" else None)
            or encoder_problem(args.encoder))


def fail(message: str) -> int:
    print(f"cohort eval: error: {message}", file=sys.stderr)
    return 2
