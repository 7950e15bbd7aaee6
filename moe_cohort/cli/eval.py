"""`cohort eval`: compare static batching plans on expert traces against random batches and the oracle.

The continuous-batching replay is `cohort replay` (cli.replay); both read traces the same way
(`add_input_arguments`, `load_input`).
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from moe_cohort.cli.checks import ENCODER_CHOICES, encoder_problem, int_list, path_problem, positive_int
from moe_cohort.encoder.plans import PlanError, read_plan_file
from moe_cohort.eval.metrics import evaluate
from moe_cohort.eval.report import format_table, write_report
from moe_cohort.send.settings import DEFAULT_ENCODER
from moe_cohort.traces.format import TraceFormatError, TraceSet
from moe_cohort.traces.importers import load_traces
from moe_cohort.traces.loads import DEFAULT_DECODE_STEPS, expert_masks
from moe_cohort.traces.split import heldout_split


def add_input_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags `cohort eval` and `cohort replay` share: which traces, which plan and encoder, how many seeds."""
    parser.add_argument("--traces", required=True,
                        help="trace file or directory (moe-cohort .npz, .jsonl, traces.npz+prompts.jsonl dir, or 'sample')")
    parser.add_argument("--heldout-only", action="store_true",
                        help="evaluate on the held-out side of the project's split only: the requests that "
                             "`cohort train` holds out at its default --holdout-share and --seed")
    parser.add_argument("--plan", help="plan file to evaluate: JSON lines {id, batch[, position]}")
    parser.add_argument("--encoder", default=DEFAULT_ENCODER,
                        help=f"embeds the traces' texts for the 'encoder' plan (and the replay's text policies): "
                             f"{ENCODER_CHOICES}; 'none' leaves them out")
    parser.add_argument("--decode", choices=("auto", "real", "proxy"), default="auto",
                        help="decode loads from generated tokens (real), the prompt proxy, or auto (default)")
    parser.add_argument("--seeds", type=positive_int, default=5, help="random orders to average (default %(default)s)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar while embedding the traces' texts")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_input_arguments(parser)
    parser.add_argument("--batch-size", type=positive_int, required=True, help="requests per batch (B)")
    parser.add_argument("--decode-steps", type=positive_int, default=DEFAULT_DECODE_STEPS,
                        help="decode steps of the prompt-token proxy for prefill-only traces (default %(default)s)")
    parser.add_argument("--decode-phase", choices=("aligned", "random"), default="aligned",
                        help="proxy cycles start at token 1 (aligned, default) or at a seeded random offset per request")
    parser.add_argument("--report", metavar="DIR", help="also write report.json, report.md and saving.png to DIR")
    parser.add_argument("--sweep", type=int_list, default="8,16,32,64",
                        help="batch sizes of the report's plot, comma-separated (default %(default)s)")


def run(args: argparse.Namespace) -> int:
    problem = path_problem(args) or encoder_problem(args.encoder)
    if problem:
        return fail(problem)
    try:
        ts = load_input(args)
        masks = expert_masks(ts, decode_steps=args.decode_steps, decode=args.decode, phase=args.decode_phase)
        plans = {"plan": read_plan_file(args.plan, ts.request_ids)} if args.plan else {}
        x = embed_traces(ts, args.encoder, progress=not args.no_progress)  # [N, D] or None
        planners = {} if x is None else {"encoder": lambda _ts, batch_size: _plan(x, batch_size)}
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


def load_input(args: argparse.Namespace) -> TraceSet:
    """The traces of --traces; with --heldout-only, their held-out side under the project's split."""
    ts = load_traces(args.traces)
    return ts.subset(heldout_split(ts)[1]) if args.heldout_only else ts


def embed_traces(ts: TraceSet, encoder: str | None, *, progress: bool) -> np.ndarray | None:
    """Embeddings [N, D] of the traces' texts by --encoder; None without texts or with 'none'."""
    if (encoder or "").lower() == "none" or ts.texts is None or not any(t.strip() for t in ts.texts):
        return None
    from moe_cohort.encoder import embed_texts

    return embed_texts(list(ts.texts), encoder=encoder, progress=progress)


def _plan(x: np.ndarray, batch_size: int) -> list[np.ndarray]:
    from moe_cohort.encoder.planner import plan_batches

    return plan_batches(x, batch_size)


def fail(message: str, command: str = "eval") -> int:
    print(f"cohort {command}: error: {message}", file=sys.stderr)
    return 2
