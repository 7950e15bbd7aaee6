"""`cohort batch run`: an OpenAI Batch file through a vLLM backend, in admission order, resumable.

    cohort batch run --input requests.jsonl --output results.jsonl --backend http://127.0.0.1:8000

The whole file is validated first (nothing is sent if a line is bad, unless --skip-invalid). Then the
run asks each backend what it is, as `cohort serve` does (send/handshake.py, send/autoconfig.py), and says
what it chose: as many requests out as twice the engine's max_num_seqs (its slots, and a queue as deep that vLLM
refills freed slots from at once), and learning on where the engine serves its expert counts. Flags win. With no profile head yet (a fresh --data-dir) it sends a sample drawn from
across the file first, learns the head from the engine's counts of those answers, then predicts the rest and
sends it in admission order: each freed slot goes to the waiting request that best fits those out now, the
whole remaining file being the pool (--encoder none keeps file order). Results and failures are appended as
they finish, with a journal next to the output (`results.jsonl.journal`): after a crash or kill, the same
command finishes the rest, and a head learned before the kill orders it from its first line.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from moe_cohort.cli.batch_report import ProgressBar, learned, list_errors, summary
from moe_cohort.cli.checks import ENCODER_CHOICES
from moe_cohort.cli.setting_flags import add_setting_flags, flag_overrides, flag_table
from moe_cohort.send.setting_sources import load_settings
from moe_cohort.send.settings import Settings, SettingsError

# the settings `cohort batch run` takes as flags, in its own words where a batch gives them another sense
# (defaults live in Settings and COHORT_* variables)
_FLAGS = flag_table(
    ("backends", "default_policy", "encoder", "max_in_flight", "batch_max_retries", "request_timeout_s",
     "backend_api_key", "max_body_bytes", "data_dir", "learn", "forward_profiles", "batch_probe"),
    {"backends": "vLLM server, e.g. http://127.0.0.1:8000 (--runner ray: every replica, the flag repeated or a "
                    "comma list)",
     "default_policy": "routing policy for lines without vllm_xargs.moe_routing, e.g. xshare;m=32",
     "encoder": f"orders the requests by their predicted experts: {ENCODER_CHOICES}; 'none' keeps the file order",
     "max_in_flight": "lines at each backend at once (default: from its vLLM: its max_num_seqs plus a queue as deep, "
                      "that vLLM refills freed slots from)",
     "max_body_bytes": "longest input line (one request) accepted",
     "data_dir": "with --learn: where the learned head is kept (its learned/ folder; the same as cohort serve's)",
     "learn": "learn the profile head from the engine's routing of this batch's answers as it runs (the expert "
              "counts of moe-cohort's vLLM plugin, or vLLM's routed_experts), re-predicting the requests next in "
              "line with each new head; starts from, and saves to, --data-dir's learned/ (default: on where the "
              "backend serves its expert counts and the run does not probe)",
     "batch_probe": "route each line's prompt through the engine once before its turn (one token, its expert counts "
                    "from moe-cohort's vLLM plugin) and admit lines by that routing (default: on where the backend "
                    "serves its expert counts; --encoder none keeps the file order)",
     "forward_profiles": "send each request's predicted profile, for moe-cohort's scheduler in vLLM to choose among "
                         "the few queued lines by (default: off, the runner chooses every line)"})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    run_parser = sub.add_parser("run", help="run a Batch file (resumable)", description=__doc__.splitlines()[0])
    run_parser.add_argument("--input", required=True, type=Path, help="OpenAI Batch JSONL (custom_id, method, url, body)")
    run_parser.add_argument("--output", required=True, type=Path, help="results JSONL (OpenAI Batch output lines)")
    run_parser.add_argument("--errors", type=Path, help="error JSONL: failed requests, and with --skip-invalid the "
                            "refused lines (default: OUTPUT's stem + .errors.jsonl)")
    add_setting_flags(run_parser, _FLAGS)
    run_parser.add_argument("--skip-invalid", action="store_true", help="write bad lines to the error file and go on")
    run_parser.add_argument("--dry-run", action="store_true", help="validate and predict only; write the sending order, send nothing")
    run_parser.add_argument("--plan", type=Path, help="where --dry-run writes the plan (default: OUTPUT + .plan.jsonl)")
    run_parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    run_parser.add_argument("--runner", choices=("local", "ray"), default="local",
                            help="local: this process sends, to one --backend; ray: Ray Data sends, to every "
                                 "--backend (the flag repeated, or a comma list)")


def run(args: argparse.Namespace) -> int:
    # a run shares the machine with the engine: BLAS on one thread, set before numpy loads OpenBLAS, whose pool of
    # threads would spin on the engine's cores after each call (the caller's setting wins)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    from moe_cohort.batch.file_run import BatchRunError, FileJob, FileRun, InvalidLines, configured, problem, read_file

    started = time.monotonic()
    job = FileJob(args.input, args.output, args.errors, runner=args.runner, skip_invalid=args.skip_invalid)
    try:
        settings = load_settings(flag_overrides(args, _FLAGS), flags=_FLAGS)
    except SettingsError as exc:
        return _fail(str(exc))
    settings = settings.replace(batch_max_in_flight=0)  # the Batch API's share of a proxy's slots; a run's: max_in_flight
    found = problem(settings, job, dry_run=args.dry_run)
    if found:
        return _fail(found)
    try:
        batch = read_file(settings, job)
        if args.dry_run:
            return _dry_run(args, settings, batch)
        settings, layers, said = configured(settings, job)
        print(f"cohort batch: {said}", file=sys.stderr)
        run_ = FileRun(settings, batch, job)
        with ProgressBar(len(batch.requests), run_.finished, enabled=not args.no_progress) as bar:
            result = run_.run(bar.update)
    except InvalidLines as exc:
        list_errors(exc.path, exc.errors)
        return exc.code
    except BatchRunError as exc:
        return _fail(exc.message, exc.code)
    if result.learner is not None:
        learned(result.learner, result.learned_in)
    summary(result.stats, result.counts, result.paths, layers, time.monotonic() - started)
    return 0


def _dry_run(args, settings: Settings, batch) -> int:
    from moe_cohort.batch.file_run import dry_run

    path = args.plan or args.output.with_name(args.output.name + ".plan.jsonl")
    slots = dry_run(settings, batch, path)
    skipped = f", {len(batch.errors)} invalid line(s) left out" if batch.errors else ""
    print(f"dry run: planned {len(batch.requests)} requests into {-(-len(batch.requests) // slots)} batches of <= "
          f"{slots} (the order admission sends them in, {slots} at a time, if they finish in order){skipped} -> "
          f"{path}; nothing was sent", file=sys.stderr)
    return 0


def _fail(message: str, code: int = 2) -> int:
    print(f"cohort batch: error: {message}", file=sys.stderr)
    return code
