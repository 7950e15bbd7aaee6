"""`cohort batch run`: an OpenAI Batch file through a vLLM backend, in admission order, resumable.

    cohort batch run --input requests.jsonl --output results.jsonl --backend http://127.0.0.1:8000

The whole file is validated first (nothing is sent if a line is bad, unless --skip-invalid). Then the
run asks each backend what it is, as `cohort serve` does (send/handshake.py, send/autoconfig.py), and says
what it chose: as many requests out as the engine's max_num_seqs plus a short queue (vLLM refills a freed slot
at once), and learning on where the engine serves its expert counts. Flags win. With no profile head yet (a fresh --data-dir) it sends a sample drawn from
across the file first, learns the head from the engine's counts of those answers, then predicts the rest and
sends it in admission order: each freed slot goes to the waiting request that best fits those out now, the
whole remaining file being the pool (--encoder none keeps file order). Results and failures are appended as
they finish, with a journal next to the output (`results.jsonl.journal`): after a crash or kill, the same
command finishes the rest, and a head learned before the kill orders it from its first line.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import replace
from pathlib import Path

from moe_cohort.cli.batch_report import ProgressBar, learned, list_errors, summary
from moe_cohort.cli.checks import ENCODER_CHOICES
from moe_cohort.cli.setting_flags import add_setting_flags, flag_overrides, flag_table
from moe_cohort.send.setting_sources import load_settings
from moe_cohort.send.settings import Settings, SettingsError

# the settings `cohort batch run` takes as flags, in its own words where a batch gives them another sense
# (defaults live in Settings and COHORT_* variables)
_FLAGS = flag_table(
    ("backend_url", "default_policy", "encoder", "max_in_flight", "batch_max_retries", "request_timeout_s",
     "backend_api_key", "max_body_bytes", "data_dir", "learn", "forward_profiles"),
    {"backend_url": "vLLM server, e.g. http://127.0.0.1:8000 (--engine ray: every replica, the flag repeated or a "
                    "comma list)",
     "default_policy": "routing policy for lines without vllm_xargs.moe_routing, e.g. xshare;m=32",
     "encoder": f"orders the requests by their predicted experts: {ENCODER_CHOICES}; 'none' keeps the file order",
     "max_in_flight": "lines at each backend at once (default: from its vLLM: its max_num_seqs plus a short queue, "
                      "that vLLM refills a freed slot from)",
     "max_body_bytes": "longest input line (one request) accepted",
     "data_dir": "with --learn: where the learned head is kept (its learned/ folder; the same as cohort serve's)",
     "learn": "learn the profile head from the engine's routing of this batch's answers as it runs (the expert "
              "counts of moe-cohort's vLLM plugin, or vLLM's routed_experts), re-predicting the requests next in "
              "line with each new head; starts from, and saves to, --data-dir's learned/ (default: on where the "
              "backend serves its expert counts)",
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
    run_parser.add_argument("--engine", choices=("local", "ray"), default="local",
                            help="local: this process sends, to one --backend; ray: Ray Data sends, to every "
                                 "--backend (the flag repeated, or a comma list)")


def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    if args.output.is_dir():
        return _fail(f"--output {args.output} is a folder; give a file path for the results, "
                     f"e.g. {args.output / 'results.jsonl'}")
    try:
        settings = load_settings(flag_overrides(args, _FLAGS), flags=_FLAGS)
    except SettingsError as exc:
        return _fail(str(exc))
    settings = settings.replace(batch_concurrency=0)  # the Batch API's share of a proxy's slots; a run's: max_in_flight
    if not settings.backend_url and not args.dry_run:
        return _fail("no backend: pass --backend URL (a vLLM server) or set COHORT_BACKEND_URL")
    from moe_cohort.send.profiles import encoder_problem

    problem = encoder_problem(settings) or (_ray_problem() if args.engine == "ray" else _one_backend(settings))
    if settings.learn and (args.engine == "ray" or args.dry_run):
        problem = problem or ("--learn learns from answers as the local runner gets them; drop --learn for "
                              f"{'--engine ray' if args.engine == 'ray' else '--dry-run'}")
    if problem:
        return _fail(problem)
    from moe_cohort.batch.format import read_batch_file
    from moe_cohort.send.hints import HintRules

    try:
        batch = read_batch_file(args.input, default_policy=settings.default_policy, max_line_bytes=settings.max_body_bytes,
                                rules=HintRules.of(settings))
    except OSError as exc:
        return _fail(f"cannot read {args.input}: {exc}")
    if batch.errors and not args.skip_invalid:
        list_errors(args.input, batch.errors)
        return 2
    if not batch.requests and not batch.errors:
        return _fail(f"{args.input} has no requests")
    if args.dry_run:
        from moe_cohort.send.profiles import make_predictor

        return _dry_run(args, settings, batch, make_predictor(settings))
    settings, layers = _configured(settings, args.engine)
    return _execute(args, settings, batch, layers, started)


def _configured(settings: Settings, engine: str) -> tuple[Settings, int | None]:
    """The run's settings as the backends' handshake makes them (flags win), said in one line; and the model's
    MoE layers when an engine told them."""
    from moe_cohort.send.autoconfig import plan_batch
    from moe_cohort.send.handshake import ask_all

    infos = asyncio.run(ask_all(settings.backend_urls, settings))
    plan = plan_batch(settings, settings.backend_urls, infos)
    learn = plan.learn and engine == "local" and settings.encoder.lower() != "none"
    print(f"cohort batch: {plan.line}" + ("" if learn == plan.learn else " (not with --engine ray)"), file=sys.stderr)
    return replace(settings, max_in_flight=plan.slots, forward_profiles=plan.forward_profiles, learn=learn), \
        plan.layers


def _dry_run(args, settings: Settings, batch, predictor) -> int:
    from moe_cohort.batch.order import make_order, simulated_order
    from moe_cohort.batch.run import write_plan

    concurrency = settings.batch_in_flight
    order = simulated_order(batch.requests, make_order(batch.requests, predictor, concurrency), concurrency)
    path = args.plan or args.output.with_name(args.output.name + ".plan.jsonl")
    write_plan(path, order, concurrency)
    skipped = f", {len(batch.errors)} invalid line(s) left out" if batch.errors else ""
    batches = -(-len(order) // concurrency)
    print(f"dry run: planned {len(batch.requests)} requests into {batches} batches of <= {concurrency} "
          f"(the order admission sends them in, {concurrency} at a time, if they finish in order){skipped} -> {path}; "
          f"nothing was sent", file=sys.stderr)
    return 0


def _execute(args, settings: Settings, batch, layers: int | None, started: float) -> int:
    from moe_cohort.batch.journal import Journal, JournalError, JournalPaths
    from moe_cohort.batch.run import RunAborted

    paths = JournalPaths.for_output(args.output, args.errors)
    try:
        journal = Journal.open(paths, batch.journal_meta)
    except (JournalError, OSError) as exc:
        return _fail(str(exc))
    try:
        progress, skip = not args.no_progress, args.skip_invalid
        stats = _run_ray(settings, batch, journal, progress=progress, skip_invalid=skip) if args.engine == "ray" \
            else asyncio.run(_run(settings, batch, journal, progress=progress, skip_invalid=skip))
    except RunAborted as exc:
        return _fail(f"{exc}\nresults so far are in {paths.output}; run the same command again to finish the rest", 1)
    except KeyboardInterrupt:
        return _fail(f"interrupted; results so far are in {paths.output}; run the same command again to finish", 130)
    finally:
        journal.close()
    summary(stats, journal, paths, layers, time.monotonic() - started)
    return 0


async def _run(settings: Settings, batch, journal, *, progress: bool, skip_invalid: bool):
    from moe_cohort.batch.core import RunConfig
    from moe_cohort.batch.run import run_batch
    from moe_cohort.send.backend_client import BackendClient
    from moe_cohort.send.learning.learning import Learning, learned_folder, load_learner
    from moe_cohort.send.metrics import ProxyMetrics

    backend = BackendClient.from_settings(settings)
    loading = _load_predictor(settings)  # the encoder loads while the first requests go (a sample, in any case)
    learning = None
    if settings.learn:
        learning = Learning(load_learner(settings, _refit_every(settings)), lambda texts: loading.result().features(texts),
                            learned_folder(settings), ProxyMetrics(), settings.learn_sample_rate, [backend])
    predictor = None if loading is None else asyncio.wrap_future(_following(loading, learning))
    finished = sum(1 for r in batch.requests if r.line in journal.done)
    before = await _metrics(backend)
    with ProgressBar(len(batch.requests), finished, enabled=progress) as bar:
        try:
            stats = await run_batch(batch, journal, [backend], predictor, RunConfig.from_settings(settings),
                                    skip_invalid=skip_invalid, on_progress=bar.update, learning=learning)
        finally:
            if learning is not None:
                await learning.flush()  # the last answers' counts
                await asyncio.to_thread(learning.close)  # what it learned is saved for the next run (and serve)
                learned(learning.learner, learned_folder(settings))
            after = await _metrics(backend)
            await backend.close()
    if before is not None and after is not None:
        stats.decode = {key: after[key] - before[key] for key in before}
    return stats


def _refit_every(settings: Settings) -> int | None:
    """A batch refits its head more often than a server, unless the settings say how often: its early heads order
    most of the file (docs/results.md: the learned-first schedule in the replay)."""
    from moe_cohort.batch.follow import BATCH_REFIT_EVERY

    return BATCH_REFIT_EVERY if settings.learn_refit_every == Settings.learn_refit_every else None


def _load_predictor(settings: Settings):
    """The settings' predictor, loading on a thread (a concurrent Future); None with --encoder none."""
    if settings.encoder.lower() == "none":
        return None
    from concurrent.futures import ThreadPoolExecutor

    from moe_cohort.send.profiles import make_predictor

    pool = ThreadPoolExecutor(1, "cohort-encoder-load")
    loading = pool.submit(make_predictor, settings)
    pool.shutdown(wait=False)  # the load goes on; the thread ends with it
    return loading


def _following(loading, learning):
    """`loading`'s predictor, made to follow `learning` (its head, once learned) as soon as it is loaded."""
    from concurrent.futures import Future

    out: Future = Future()

    def done(future) -> None:
        if out.cancelled():  # the run ended before the encoder had loaded
            return
        try:
            predictor = future.result()
            if learning is not None:
                predictor.follow(learning)
            out.set_result(predictor)
        except BaseException as exc:  # the encoder failed to load: the run fails with its error
            out.set_exception(exc)
    loading.add_done_callback(done)
    return out


async def _metrics(backend) -> dict[str, float] | None:
    """The plugin's decode counters on the backend now (send/backend_metrics.py: zeros before its first step, or
    without the plugin); None where /metrics cannot be read."""
    from moe_cohort.send.backend_metrics import decode_sums
    from moe_cohort.send.errors import ProxyError

    try:
        return decode_sums((await backend.request("GET", "/metrics")).text)
    except (ProxyError, ValueError):
        return None


def _run_ray(settings: Settings, batch, journal, *, progress: bool, skip_invalid: bool):
    from moe_cohort.batch.ray import run_batch_ray
    from moe_cohort.send.profiles import make_predictor

    finished = sum(1 for r in batch.requests if r.line in journal.done)
    with ProgressBar(len(batch.requests), finished, enabled=progress) as bar:
        return run_batch_ray(settings, batch, journal, make_predictor(settings), skip_invalid=skip_invalid,
                             on_progress=bar.update)


def _one_backend(settings: Settings) -> str | None:
    if "," in settings.backend_url:
        return (f"--engine local sends to one backend, got several in --backend {settings.backend_url!r}; "
                f"pass one, or --engine ray to send to all of them")
    return None


def _ray_problem() -> str | None:
    from moe_cohort.batch.ray import ray_problem

    return ray_problem()


def _fail(message: str, code: int = 2) -> int:
    print(f"cohort batch: error: {message}", file=sys.stderr)
    return code
