"""A Batch API batch's files: its input (read, validated, pinned by hash), and its journal and results
in `<data_dir>/batches/<batch id>/` (output.jsonl, errors.jsonl, output.jsonl.journal), registered as
batch_output files when the batch closes. The jobs (proxy/batch/jobs.py) decide when; this says how.
"""

from __future__ import annotations

import asyncio

from moe_cohort.batch.format import URLS, BatchFile, read_batch_file
from moe_cohort.batch.journal import Journal, JournalPaths
from moe_cohort.proxy.batch.job import Job
from moe_cohort.proxy.batch.store import BatchStore
from moe_cohort.send.hints import HintRules
from moe_cohort.send.settings import Settings

MAX_ERRORS_KEPT = 100  # validation errors stored on a failed batch


class BatchFolder:
    def __init__(self, store: BatchStore, settings: Settings) -> None:
        self.store, self.settings = store, settings

    async def read(self, job: Job) -> BatchFile:
        """The batch's input file, parsed and validated (lines must use the batch's endpoint)."""
        path = self.store.get_file(job.input_file_id, None)["path"]  # its owner's: checked when the batch was made
        return await asyncio.to_thread(read_batch_file, path, default_policy=self.settings.default_policy,
                                       max_line_bytes=self.settings.max_body_bytes,
                                       urls={job.endpoint: URLS[job.endpoint]}, rules=HintRules.of(self.settings))

    async def parsed(self, job: Job) -> BatchFile:
        """The validated input: kept from validation, else read again (after a restart); it must not have changed."""
        if job.parsed is None:
            job.parsed = await self.read(job)
            if job.parsed.sha256 != job.input_sha256:
                raise RuntimeError(f"the input file {job.input_file_id} of batch {job.id} changed on disk")
        return job.parsed

    async def journal(self, job: Job) -> Journal:
        """The batch's one journal, opened on first use (opening it recovers a crash's torn tail)."""
        if job.journal is None:
            folder = self.store.batch_dir(job.id)
            paths = JournalPaths(folder / "output.jsonl", folder / "errors.jsonl", folder / "output.jsonl.journal")
            job.journal = await asyncio.to_thread(Journal.open, paths, job.journal_meta)
        return job.journal

    def register_results(self, batch_id: str, paths: JournalPaths, owner: str) -> dict:
        """Register the non-empty output and error files as `owner`'s (the batch's); their ids for the batch record."""
        fields = {}
        for kind, path, name in (("output", paths.output, "output_file_id"), ("error", paths.errors, "error_file_id")):
            size = path.stat().st_size
            file_id = f"file-{kind}-{batch_id.removeprefix('batch_')}"
            if size:
                self.store.add_file(file_id, f"{batch_id}_{kind}.jsonl", "batch_output", path, size, owner=owner)
            fields[name] = file_id if size else None
        return fields


def validation_errors(parsed: BatchFile) -> list[dict]:
    """The batch record's `errors` for a file that fails validation; [] for a valid one."""
    if parsed.requests and not parsed.errors:
        return []
    return [{"code": "invalid_request", "line": e.line, "message": e.message, "param": None}
            for e in parsed.errors[:MAX_ERRORS_KEPT]] or \
        [{"code": "empty_file", "line": None, "message": "the input file has no requests", "param": None}]
