"""A Batch API job in memory: its status, the explicit table of status changes, and what it holds while it runs.

    validating  -> in_progress (valid) | failed (invalid lines, or a bug) | cancelling
    in_progress -> finalizing (all finished, or the window expired) | cancelling | failed
    cancelling  -> cancelled | failed
    finalizing  -> completed | expired | failed

`Job.move` is the only way a status changes; proxy/batch/jobs.py persists each move with a
compare-and-set (proxy/batch/store.py), so the record in memory and the row in SQLite go together
and the state machine is walked here, never by re-reading the database. One Job exists per running
batch; it holds the batch's one journal from its first use to the end of the job.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from moe_cohort.batch.format import BatchFile
from moe_cohort.batch.journal import Journal

TRANSITIONS: dict[str, frozenset[str]] = {
    "validating": frozenset({"in_progress", "failed", "cancelling"}),
    "in_progress": frozenset({"finalizing", "cancelling", "failed"}),
    "cancelling": frozenset({"cancelled", "failed"}),
    "finalizing": frozenset({"completed", "expired", "failed"}),
}
CANCELLABLE = ("validating", "in_progress")


class InvalidTransition(RuntimeError):
    """A status change the table does not allow (a bug: the job's code asked for it)."""


@dataclass(eq=False)
class Job:
    id: str
    status: str
    endpoint: str
    input_file_id: str
    expires_at: float | None = None  # the completion window's end (epoch seconds)
    expired_at: int | None = None  # set when the window closed on the batch
    input_sha256: str | None = None  # the validated input, pinned for the journal
    input_bytes: int | None = None
    prompt_tokens: int = 0  # usage of the answered requests, over every run of the batch
    completion_tokens: int = 0
    expiring: bool = False  # the window closed while it was running: finish it as expired
    stop: asyncio.Event = field(default_factory=asyncio.Event)  # cancel, expiry or shutdown: stop where it is
    parsed: BatchFile | None = None  # the validated file, kept from validation to the run
    journal: Journal | None = None
    owner: str = ""  # send/auth.py: the tenant the batch's requests share slots as (proxy/batch/share.py)

    @classmethod
    def from_row(cls, row: dict) -> "Job":
        usage = row.get("usage") or {}
        return cls(row["id"], row["status"], row["endpoint"], row["input_file_id"], row["expires_at"],
                   row["expired_at"], row["input_sha256"], row["input_bytes"], usage.get("input_tokens", 0),
                   usage.get("output_tokens", 0), owner=row.get("owner") or "")

    def move(self, to: str) -> str:
        """Change the status to `to` if the table allows it; returns the status it left."""
        if to not in TRANSITIONS.get(self.status, ()):
            raise InvalidTransition(f"batch {self.id}: {self.status} -> {to} is not a status change a batch makes")
        before, self.status = self.status, to
        return before

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and now >= self.expires_at

    @property
    def journal_meta(self) -> dict:
        return {"input_sha256": self.input_sha256, "input_bytes": self.input_bytes}

    @property
    def usage(self) -> dict:
        """The OpenAI BatchUsage object."""
        return {"input_tokens": self.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": self.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.prompt_tokens + self.completion_tokens}
