"""`cohort plan`: prompts (JSONL) -> expert-coherent batches (JSONL).

    cohort plan --input prompts.jsonl --batch-size 16 --output plan.jsonl

Input lines are OpenAI Batch request lines (custom_id, body.messages or body.prompt) or plain
{"id", "text"} lines, detected line by line. Output lines are {"id", "batch", "position"} in plan
order: batch 0 first, then by position inside the batch. A bad input line stops the run with an
error naming the line, unless --skip-invalid, which writes it to the --errors file and goes on.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from moe_cohort.cli.checks import ENCODER_CHOICES
from moe_cohort.encoder.inputs import InputError, PlanInput, parse_lines
from moe_cohort.encoder.plans import write_plan_file
from moe_cohort.send.settings import DEFAULT_ENCODER

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", required=True, type=Path, help="JSONL of OpenAI Batch request lines or {id, text} lines")
    parser.add_argument("--output", required=True, type=Path, help="where to write the plan (JSONL of {id, batch, position})")
    parser.add_argument("--batch-size", required=True, type=_positive_int, help="most requests per batch (B)")
    parser.add_argument("--encoder", default=DEFAULT_ENCODER, help=f"embeds the prompts: {ENCODER_CHOICES}")
    parser.add_argument("--max-seq-len", type=_positive_int, default=None, help="truncate texts to this many tokens "
                        "(default: the encoder's own limit)")
    parser.add_argument("--seed", type=int, default=0, help="planner seed (default 0)")
    parser.add_argument("--skip-invalid", action="store_true", help="write bad lines to the --errors file instead of "
                        "stopping")
    parser.add_argument("--errors", type=Path, default=None,
                        help="with --skip-invalid: JSONL of the refused lines (default: OUTPUT with .errors.jsonl)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar while embedding")


def run(args: argparse.Namespace) -> int:
    if args.input.is_dir():
        return _fail(f"--input {args.input}: is a folder; give the JSONL file of prompts")
    if args.errors is not None and not args.skip_invalid:
        return _fail("--errors only applies with --skip-invalid; add --skip-invalid or drop --errors")
    problem = _unwritable(args.output) or _unknown_encoder(args.encoder)
    if problem:
        return _fail(problem)
    try:
        items, rejects = _read(args.input, args.skip_invalid)
    except (OSError, InputError) as exc:
        return _fail(f"{args.input}: {exc}")
    rejects_path = args.errors or args.output.with_suffix(".errors.jsonl")
    if rejects:
        _write_rejects(rejects_path, rejects)
        print(f"skipped {len(rejects)} invalid line(s) -> {rejects_path}", file=sys.stderr)
    if not items:
        return _fail(f"{args.input}: no valid requests to plan")
    from moe_cohort.encoder import embed_texts
    from moe_cohort.encoder.planner import plan_batches

    start = time.perf_counter()
    x = embed_texts([it.text for it in items], encoder=args.encoder, max_seq_len=args.max_seq_len,
                    progress=not args.no_progress)
    embedded = time.perf_counter()
    plan = plan_batches(x, args.batch_size, seed=args.seed)
    planned = time.perf_counter()
    write_plan_file(args.output, plan, [it.id for it in items])
    print(f"planned {len(items)} requests into {len(plan)} batches of <= {args.batch_size} -> {args.output} "
          f"(embedding {embedded - start:.1f}s, planning {planned - embedded:.2f}s)", file=sys.stderr)
    return 0


def _unwritable(output: Path) -> str | None:
    if output.is_dir():
        return f"--output {output} is a folder; give a file path for the plan, e.g. {output / 'plan.jsonl'}"
    if not output.parent.is_dir():
        return f"--output {output}: the folder {output.parent} does not exist"
    return None


def _unknown_encoder(name: str | None) -> str | None:
    from moe_cohort.encoder.embedding import EncoderNotFound, check_available, resolve_model

    try:
        check_available(resolve_model(name)) if name != "static" else None  # `static` is built on first use
    except EncoderNotFound as exc:
        return str(exc)
    return None


def _read(path: Path, skip_invalid: bool) -> tuple[list[PlanInput], list[InputError]]:
    items: list[PlanInput] = []
    rejects: list[InputError] = []
    with open(path, "rb") as f:  # bytes: a line that is not UTF-8 is an error on that line, not for the file
        for parsed in parse_lines(f, skip_invalid=skip_invalid):
            (rejects if isinstance(parsed, InputError) else items).append(parsed)
    return items, rejects


def _write_rejects(path: Path, rejects: list[InputError]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for err in rejects:
            f.write(json.dumps({"line": err.line, "error": err.reason, "raw": err.raw}) + "\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _fail(message: str) -> int:
    print(f"cohort plan: error: {message}", file=sys.stderr)
    return 2
