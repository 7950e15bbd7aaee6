"""What `cohort batch run` prints: its progress bar while it runs, the summary of a run (wall time, generated
tokens per second, the engine's decode expert loads per generated token), what it learned, and a file's invalid
lines. Printing only; the numbers come from the run's stats and the engine's counters."""

from __future__ import annotations

import sys
from pathlib import Path

MAX_LISTED_ERRORS = 20


class ProgressBar:
    """tqdm: requests done (ETA from tqdm), tokens/s, and the backend's live decode expert loads."""

    def __init__(self, total: int, finished: int, *, enabled: bool) -> None:
        from tqdm.auto import tqdm

        # `initial`: requests finished by an earlier run count as done but not towards the rate and ETA
        self.bar = tqdm(total=total, initial=finished, unit="req", desc="batch", disable=not enabled,
                        dynamic_ncols=True)

    def update(self, stats) -> None:
        self.bar.update(stats.done - self.bar.n)
        postfix = f"{stats.tokens_per_s:.0f} tok/s"
        decode = stats.decode
        if decode is not None and decode.experts_per_layer_step is not None:
            postfix += f", {decode.experts_per_layer_step:.1f} experts/layer/decode step"
            if decode.policy_saving:
                postfix += f" ({decode.policy_saving:.1%} saved by the policy)"
        self.bar.set_postfix_str(postfix, refresh=False)
        self.bar.refresh()

    def __enter__(self) -> "ProgressBar":
        return self

    def __exit__(self, *exc) -> None:
        self.bar.close()


def summary(stats, counts: dict[str, int], paths, layers: int | None, wall_s: float) -> None:
    ok, failed = counts["output"], counts["errors"]
    print(f"done: {ok} succeeded -> {paths.output}; {failed} failed or skipped -> {paths.errors}", file=sys.stderr)
    if stats.succeeded + stats.failed == 0:
        print(f"nothing to send: all {stats.total} requests were finished by an earlier run", file=sys.stderr)
        return
    print(f"this run: {stats.succeeded + stats.failed} requests in {stats.elapsed:.1f} s from the first sent "
          f"({wall_s:.1f} s with start-up), {stats.tokens_per_s:.0f} generated tokens/s", file=sys.stderr)
    if stats.probed is not None:
        print(f"probed: {stats.probed} of {stats.succeeded + stats.failed} lines' prompts routed by the engine before "
              f"their turn (the rest went without a profile)", file=sys.stderr)
    if stats.decode is not None:
        _decode_summary(stats.decode, layers)


def _decode_summary(decode, layers: int | None) -> None:
    """The engine's decode counters over the run (send.engine_counters.DecodeCounters): per generated token, and
    per decode step of whole batches; a line only for what ran."""
    if decode.loads_per_token is not None:
        tokens_per_forward = decode.tokens_per_forward(layers)
        shared = f", {tokens_per_forward:.2f} decode tokens per forward" if tokens_per_forward else ""
        print(f"decode: {decode.loads_per_token:.3f} expert loads per generated token{shared} (the engine's counters "
              f"over this run; compare with --encoder none on the same file for file order)", file=sys.stderr)
    if decode.experts_per_layer_step is not None:
        saving = f", routing policy saved {decode.policy_saving:.1%} of them" if decode.policy_saving else ""
        print(f"backend decode steps: {decode.experts_per_layer_step:.2f} distinct experts per MoE layer "
              f"({decode.batch_after:,.0f} expert loads over {decode.batch_layer_steps:,.0f} layer-steps){saving}",
              file=sys.stderr)


def learned(learner, folder: Path) -> None:
    head = f"a head fitted on {learner.fitted_on}" if learner.head is not None else \
        f"no head yet (the first after {learner.config.first_fit})"
    print(f"learned: {learner.observed} observed requests, {head}; saved in {folder}", file=sys.stderr)


def list_errors(path: Path, errors) -> None:
    print(f"cohort batch: {path}: {len(errors)} invalid line(s); nothing was sent:", file=sys.stderr)
    for err in errors[:MAX_LISTED_ERRORS]:
        print(f"  {err.message}", file=sys.stderr)
    if len(errors) > MAX_LISTED_ERRORS:
        print(f"  ... and {len(errors) - MAX_LISTED_ERRORS} more", file=sys.stderr)
    print("fix them, or pass --skip-invalid to write them to the error file and run the rest", file=sys.stderr)
