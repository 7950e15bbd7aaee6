"""Argument types and start-up checks of `cohort eval` and `cohort replay`: a bad value fails in one line,
before any work.

The argparse types raise `argparse.ArgumentTypeError` (argparse names the flag); `path_problems`
checks the files and folders the flags name, and `encoder_problem` an encoder that cannot load.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path


def _number(text: str, convert, ok, expected: str, shown=lambda text, value: repr(text)):
    """`convert(text)` when `ok(value)`; else the argparse error "expected <expected>, got ..."."""
    try:
        value = convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {shown(text, value)}")
    return value


def positive_int(text: str) -> int:
    return _number(text, int, lambda v: v >= 1, "a positive integer", shown=lambda text, value: str(value))


def nonnegative_float(text: str) -> float:
    return _number(text, float, lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0")


def share(text: str) -> float:
    """A fraction in (0, 1]."""
    return _number(text, float, lambda v: 0 < v <= 1, "a number in (0, 1]")


def int_list(text: str) -> list[int]:
    """Comma-separated positive integers, e.g. "8,16,32"."""
    try:
        values = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1 or any(not s.strip() for s in text.split(",")[:-1]):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers such as 8,16,32, got {text!r}")
    return values


def path_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with --traces, --plan or --report (a missing input, a report folder that is a file)."""
    if args.traces != "sample" and not Path(args.traces).exists():
        return (f"--traces {args.traces}: no such file or folder; give a trace file or folder, "
                f"or 'sample' for the built-in sample traces")
    if args.plan and not Path(args.plan).is_file():
        return f"--plan {args.plan}: no such file; give a plan file of JSON lines {{id, batch}} (from `cohort plan`)"
    if args.report and Path(args.report).exists() and not Path(args.report).is_dir():
        return f"--report {args.report} is a file; give a folder (created if missing) for report.json, report.md and the plots"
    return None


def encoder_problem(encoder: str | None) -> str | None:
    """An --encoder folder that does not exist or a hub model that is neither cached nor reachable."""
    if (encoder or "").lower() in ("none", "static"):
        return None
    from moe_cohort.encoder.embedding import EncoderNotFound, check_available, resolve_model

    try:
        check_available(resolve_model(encoder or None))
    except EncoderNotFound as exc:
        return f"--encoder: {exc}"
    return None


def engine_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the replay's --cost-model, --moe-share/--non-moe-us or --lengths."""
    from moe_cohort.eval.cost import parse_cost_model

    try:
        parse_cost_model(args.cost_model, args.non_moe_us, args.moe_share)
    except ValueError as exc:
        return f"--cost-model: {exc}"
    spec = args.lengths
    if spec.split(":")[0] == "lognormal" and ":" in spec:
        try:
            sigma = float(spec.split(":", 1)[1])
        except ValueError:
            sigma = -1.0
        if not (math.isfinite(sigma) and sigma >= 0):
            return f"--lengths {spec}: the lognormal sigma must be a number >= 0, e.g. lognormal:0.5"
    elif spec not in ("fixed", "lognormal") and not Path(spec).is_file():
        return (f"--lengths {spec}: not 'fixed', 'lognormal[:SIGMA]' or an existing file of lengths "
                f"(integers in trace order, or JSON lines {{id, length}})")
    return None


# what --encoder takes, in every command that embeds prompts (each defaults to the proxy's encoder setting)
ENCODER_CHOICES = ("a folder (one from `cohort train` brings its profile head), a hub name, 'static' (distilled "
                   "from the packaged MiniLM once, then cached) or 'all-MiniLM-L6-v2' (the packaged MiniLM)")
