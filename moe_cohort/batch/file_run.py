"""One OpenAI Batch file through vLLM, resumable: the batch runner's entry point, as `create_app(settings)` is the
server's. `cohort batch run` parses its flags into Settings and a FileJob, calls these, and prints.

    result = run_file(settings, job)                  # all of it; or, step by step as `cohort batch run` prints them:
    batch = read_file(settings, job)                  # every line checked; InvalidLines names the bad ones
    settings, layers, said = configured(settings, job)  # what the backends' handshake makes of the settings
    run = FileRun(settings, batch, job)               # the journal beside the output: a rerun resumes
    result = run.run(on_progress)                     # every line answered once, into the output or error file

A local run sends from this process to one backend, in admission order once its predictor is ready (the encoder
loads on a thread while the first lines go), learning the profile head from the engine's expert counts of its
answers with `settings.learn` and saving it in the data dir; without learning it orders by the head an earlier run
saved there. A Ray run sends through Ray Data to every backend. Anything that stops a run raises BatchRunError,
whose `code` is the exit status the command returns.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from moe_cohort.batch.core import RunConfig, RunStats
from moe_cohort.batch.format import BatchFile, LineError, read_batch_file
from moe_cohort.batch.journal import Journal, JournalError, JournalPaths
from moe_cohort.send.hints import HintRules
from moe_cohort.send.settings import Settings

log = logging.getLogger(__name__)

RUNNERS = ("local", "ray")  # who sends the lines: this process, or Ray Data


@dataclass(frozen=True)
class FileJob:
    """What to run beside the settings: the files, and who sends."""

    input: Path  # OpenAI Batch JSONL
    output: Path  # results JSONL; its journal lies beside it
    errors: Path | None = None  # failed (and with skip_invalid refused) lines; default: OUTPUT's stem + .errors.jsonl
    runner: str = "local"  # "local": this process, to one backend; "ray": Ray Data, to every backend
    skip_invalid: bool = False  # bad lines go to the error file instead of stopping the run before it starts


class BatchRunError(Exception):
    """Why a run cannot start or did not finish, said for the person who runs it; `code`: the exit status."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.message, self.code = message, code


class InvalidLines(BatchRunError):
    """The file has bad lines and skip_invalid is off: nothing was sent."""

    def __init__(self, path: Path, errors: list[LineError]) -> None:
        super().__init__(f"{path}: {len(errors)} invalid line(s); nothing was sent")
        self.path, self.errors = path, errors


@dataclass
class RunResult:
    stats: RunStats
    paths: JournalPaths
    counts: dict[str, int]  # lines in the output and the error file, this run and earlier ones
    learner: object | None = None  # the online learner, saved in `learned_in`, when the run learned
    learned_in: Path | None = None


def problem(settings: Settings, job: FileJob, *, dry_run: bool = False) -> str | None:
    """What stops the run before any work (no backend, an encoder that will not load, Ray missing), said with the
    fix; None when it can go."""
    from moe_cohort.send.profiles import encoder_problem

    if job.output.is_dir():
        return (f"--output {job.output} is a folder; give a file path for the results, "
                f"e.g. {job.output / 'results.jsonl'}")
    if not settings.backends and not dry_run:
        return "no backend: pass --backend URL (a vLLM server) or set COHORT_BACKENDS"
    if job.runner not in RUNNERS:
        return f"runner {job.runner!r}: choose one of {', '.join(RUNNERS)}"
    found = encoder_problem(settings) or (_ray_problem() if job.runner == "ray" else _one_backend(settings))
    if not found and settings.learn and (job.runner == "ray" or dry_run):
        found = ("--learn learns from answers as the local runner gets them; drop --learn for "
                 f"{'--runner ray' if job.runner == 'ray' else '--dry-run'}")
    return found


def run_file(settings: Settings, job: FileJob, on_progress: Callable[[RunStats], None] | None = None) -> RunResult:
    """`job`'s file through the settings' backends, every line answered once: checked, configured by the backends'
    handshake, then run (or resumed). Raises BatchRunError (InvalidLines for bad lines) with what to fix."""
    found = problem(settings, job)
    if found:
        raise BatchRunError(found)
    batch = read_file(settings, job)
    settings, _, said = configured(settings, job)
    log.info("%s", said)
    return FileRun(settings, batch, job).run(on_progress)


def read_file(settings: Settings, job: FileJob) -> BatchFile:
    """Every line of `job.input`, checked as the proxy checks a request; raises InvalidLines when some are bad and
    `job.skip_invalid` is off."""
    try:
        batch = read_batch_file(job.input, default_policy=settings.default_policy,
                                max_line_bytes=settings.max_body_bytes, rules=HintRules.of(settings))
    except OSError as exc:
        raise BatchRunError(f"cannot read {job.input}: {exc}") from exc
    if batch.errors and not job.skip_invalid:
        raise InvalidLines(job.input, batch.errors)
    if not batch.requests and not batch.errors:
        raise BatchRunError(f"{job.input} has no requests")
    return batch


def configured(settings: Settings, job: FileJob) -> tuple[Settings, int | None, str]:
    """The run's settings as the backends' handshake makes them (flags win), the model's MoE layers when an engine
    told them, and one line that says what was chosen."""
    from moe_cohort.send.autoconfig import plan_batch
    from moe_cohort.send.handshake import ask_all

    infos = asyncio.run(ask_all(settings.backends, settings))
    plan = plan_batch(settings, settings.backends, infos, local=job.runner == "local")
    learn, probe = plan.learn and job.runner == "local" and settings.encoder.lower() != "none", plan.probe
    said = plan.line + ("" if learn == plan.learn else " (not with --runner ray)")
    settings = replace(settings, max_in_flight=plan.max_in_flight, forward_profiles=plan.forward_profiles, learn=learn,
                       batch_probe=probe, encoder="none" if plan.engine_orders else settings.encoder)
    return settings, plan.layers, said


def dry_run(settings: Settings, batch: BatchFile, plan: Path) -> int:
    """The order admission would send `batch` in if every request finished in order, written to `plan`; nothing
    is sent. Returns how many requests go at a time."""
    from moe_cohort.batch.order import admission_plan
    from moe_cohort.batch.run import write_plan
    from moe_cohort.send.profiles import make_predictor

    max_in_flight = settings.max_in_flight_for_batches
    order, _ = admission_plan(batch.requests, make_predictor(settings), max_in_flight)
    write_plan(plan, order, max_in_flight)
    return max_in_flight


class FileRun:
    """One run of a checked file: opening it opens (or resumes) the journal beside the output."""

    def __init__(self, settings: Settings, batch: BatchFile, job: FileJob) -> None:
        self.settings, self.batch, self.job = settings, batch, job
        self.paths = JournalPaths.for_output(job.output, job.errors)
        try:
            self.journal = Journal.open(self.paths, batch.journal_meta)
        except (JournalError, OSError) as exc:
            raise BatchRunError(str(exc)) from exc

    @property
    def finished(self) -> int:
        """Requests an earlier run finished."""
        return sum(1 for r in self.batch.requests if r.line in self.journal.done)

    def run(self, on_progress: Callable[[RunStats], None] | None = None) -> RunResult:
        """Every line answered once; the journal is closed after, whatever happened."""
        from moe_cohort.batch.run import RunAborted

        result = RunResult(RunStats(0, 0), self.paths, {})
        try:
            if self.job.runner == "ray":
                result.stats = self._ray(on_progress)
            else:
                asyncio.run(self._local(result, on_progress))
        except RunAborted as exc:
            raise BatchRunError(f"{exc}\nresults so far are in {self.paths.output}; run the same command again to "
                                f"finish the rest", 1) from exc
        except KeyboardInterrupt:
            raise BatchRunError(f"interrupted; results so far are in {self.paths.output}; run the same command "
                                f"again to finish", 130) from None
        finally:
            self.journal.close()
        result.counts = dict(self.journal.counts)
        return result

    async def _local(self, result: RunResult, on_progress) -> None:
        from moe_cohort.batch.run import run_batch
        from moe_cohort.send.backend_client import BackendClient
        from moe_cohort.send.learning.learning import Learning, learned_folder, load_learner
        from moe_cohort.send.metrics import Metrics
        from moe_cohort.send.profiles import limit_threads

        settings = self.settings
        # the run shares the machine with the engine: BLAS on `encoder_threads` (1) for the whole process, as
        # `cohort serve` does (a pool of BLAS threads busy-waits after each call on the cores vLLM needs)
        limit_threads(settings.encoder_threads)
        backend = BackendClient.of(settings, settings.backends[0])
        loading = _load_predictor(settings)  # the encoder loads while the first requests go (a sample, in any case)
        learning = None
        if settings.learn:
            learning = Learning(load_learner(settings, _refit_every(settings)),
                                lambda texts: loading.result().features(texts), learned_folder(settings),
                                Metrics(), settings.learn_sample_rate, [backend])
        predictor = None if loading is None else asyncio.wrap_future(_following(loading, learning, settings))
        try:
            result.stats = await run_batch(self.batch, self.journal, [backend], predictor,
                                           RunConfig.from_settings(settings), skip_invalid=self.job.skip_invalid,
                                           on_progress=on_progress, learning=learning)
        finally:
            if learning is not None:
                await learning.flush()  # the last answers' counts
                await asyncio.to_thread(learning.close)  # what it learned is saved for the next run (and serve)
                result.learner, result.learned_in = learning.learner, learned_folder(settings)
            await backend.close()

    def _ray(self, on_progress) -> RunStats:
        from moe_cohort.batch.ray import run_batch_ray
        from moe_cohort.send.profiles import make_predictor

        return run_batch_ray(self.settings, self.batch, self.journal, make_predictor(self.settings),
                             skip_invalid=self.job.skip_invalid, on_progress=on_progress)


def _refit_every(settings: Settings) -> int | None:
    """A batch refits its head more often than a server, unless the settings say how often: its early heads order
    most of the file (docs/results.md: the learned-first schedule in the replay)."""
    from moe_cohort.batch.follow import BATCH_REFIT_EVERY

    return BATCH_REFIT_EVERY if settings.learn_refit_every == Settings.learn_refit_every else None


def _load_predictor(settings: Settings) -> Future | None:
    """The settings' predictor, loading on a thread; None with --encoder none, and for a run that probes and does not
    learn (nothing reads it)."""
    if settings.encoder.lower() == "none" or (settings.batch_probe and not settings.learn):
        return None
    pool = ThreadPoolExecutor(1, "cohort-encoder-load")
    loading = pool.submit(_loaded, settings)
    pool.shutdown(wait=False)  # the load goes on; the thread ends with it
    return loading


def _loaded(settings: Settings):
    """The settings' predictor, and this process's threads limited again (`limit_threads`: the libraries it loaded)."""
    from moe_cohort.send.profiles import limit_threads, make_predictor

    predictor = make_predictor(settings)
    limit_threads(settings.encoder_threads)
    return predictor


def _following(loading: Future, learning, settings: Settings) -> Future:
    """`loading`'s predictor, made to follow `learning` (its head, once learned), else the head an earlier run
    saved in the data dir, as soon as it is loaded."""
    from moe_cohort.send.learning.learning import follow_learned

    out: Future = Future()

    def done(future: Future) -> None:
        if out.cancelled():  # the run ended before the encoder had loaded
            return
        try:
            predictor = future.result()
            follow_learned(predictor, learning, settings)
            out.set_result(predictor)
        except BaseException as exc:  # the encoder failed to load: the run fails with its error
            out.set_exception(exc)
    loading.add_done_callback(done)
    return out


def _one_backend(settings: Settings) -> str | None:
    if len(settings.backends) > 1:
        return (f"--runner local sends to one backend, got {len(settings.backends)} in --backend "
                f"({', '.join(settings.backends)}); "
                f"pass one, or --runner ray to send to all of them")
    return None


def _ray_problem() -> str | None:
    from moe_cohort.batch.ray import ray_problem

    return ray_problem()
