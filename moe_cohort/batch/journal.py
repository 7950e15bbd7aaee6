"""Append-only results with a commit journal: across kill -9, nothing lost and nothing twice.

Files of one run (`--output results.jsonl --errors errors.jsonl`):

    results.jsonl           Batch output lines of answered requests, appended as they finish
    errors.jsonl            the same schema, for failed requests and skipped input lines
    results.jsonl.journal   line 1, the header: {"version", "input_sha256", "input_bytes", "output", "errors"}
                            then one entry per finished input line: {"line": n, "file": "output"|"errors", "end": offset}

Commit (`commit(records)`, a group of finished requests at once):
    1. append the records' lines to the data files; flush; fsync
    2. append one journal entry per record (`end`: the byte offset just after its data line); flush; fsync
An input line is finished exactly when its journal entry is on disk.

Recovery (`Journal.open` when the journal exists): kill -9 can leave a torn last line in any of the
three files, and data lines whose journal entries were never written. The journal is read up to its
last complete entry (a torn tail is cut off), then each data file is cut back to the `end` of its
last entry. Finished = the lines with entries; every other line is sent again. A request that the
backend answered just before the kill is therefore sent twice to the backend, but appears once in
the results. A data file shorter than its journal says was changed by someone else: JournalError.
The journal is held under an exclusive flock, so two runs cannot write the same results.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

log = logging.getLogger(__name__)

VERSION = 1
Kind = Literal["output", "errors"]


class JournalError(RuntimeError):
    """The journal cannot be used for these files; the message says why and what to do."""


@dataclass(frozen=True)
class Record:
    line: int  # the input line this result finishes
    kind: Kind  # which data file it goes to
    data: dict  # the Batch output line


@dataclass(frozen=True)
class JournalPaths:
    output: Path
    errors: Path
    journal: Path

    @classmethod
    def for_output(cls, output: str | Path, errors: str | Path | None = None) -> "JournalPaths":
        output = Path(output).resolve()
        errors = Path(errors).resolve() if errors else output.with_name(output.stem + ".errors.jsonl")
        return cls(output, errors, output.with_name(output.name + ".journal"))


# characters that JSON allows raw in a string but str.splitlines() (and other splitters) take for line breaks;
# json.dumps escapes the C0 controls already
_LINE_BREAKS = {0x85: "\\u0085", 0x2028: "\\u2028", 0x2029: "\\u2029"}


def jsonl_line(data: dict) -> bytes:
    """`data` as one JSONL line (UTF-8, newline-terminated) that every line splitter reads as one line: text
    stays UTF-8, but U+0085, U+2028 and U+2029 are written as JSON escapes (the same JSON value)."""
    text = json.dumps(data, ensure_ascii=False)
    return (text.translate(_LINE_BREAKS) + "\n").encode()


class Journal:
    """The finished lines of a run (`done`: line -> kind) and the means to add more (`commit`)."""

    def __init__(self, paths: JournalPaths, header: dict, done: dict[int, Kind], ends: dict[Kind, int], journal) -> None:
        self.paths, self.header, self.done = paths, header, done
        self.counts: dict[Kind, int] = {"output": 0, "errors": 0}  # finished lines per data file
        for kind in done.values():
            self.counts[kind] += 1
        self._lock = threading.Lock()
        self._journal = journal  # opened (append) and flock-ed by `open`
        self._files = {"output": open(paths.output, "ab"), "errors": open(paths.errors, "ab")}
        self._ends = dict(ends)  # committed size of each data file
        self._journal_end = journal.seek(0, os.SEEK_END)
        _fsync_dir(paths.output.parent)

    @classmethod
    def open(cls, paths: JournalPaths, meta: dict) -> "Journal":
        """Resume the journal at `paths.journal` (it must describe `meta`), or start a new one."""
        header = {"version": VERSION, **meta, "output": str(paths.output), "errors": str(paths.errors)}
        if not paths.journal.exists():
            _check_fresh(paths)
            _write_atomically(paths.journal, (json.dumps(header) + "\n").encode())
        journal = _locked(paths)  # before recovery: never cut the files of a run that is still writing
        try:
            done, ends = _recover(paths, header)
        except BaseException:
            journal.close()
            raise
        if done:
            log.info("resuming %s: %d lines already finished", paths.journal, len(done))
        return cls(paths, header, done, ends, journal)

    def commit(self, records: list[Record]) -> None:
        """Make `records` durable: data lines first (fsync), then their journal entries (fsync)."""
        if not records:
            return
        with self._lock:
            if any(r.line in self.done for r in records) or len({r.line for r in records}) < len(records):
                raise JournalError("a record names an input line that is already finished; refusing to write it twice")
            try:
                entries, ends = self._append_data(records)
                self._append(self._journal, b"".join(entries))
            except BaseException:
                self._roll_back()
                raise
            self._ends, self._journal_end = ends, self._journal.tell()
            for r in records:
                self.done[r.line] = r.kind
                self.counts[r.kind] += 1

    def close(self) -> None:
        with self._lock:  # waits for a commit in progress in another thread
            for f in (*self._files.values(), self._journal):
                f.close()

    def _append_data(self, records: list[Record]) -> tuple[list[bytes], dict[Kind, int]]:
        """Append and fsync the data lines; the journal entries to write and the new file sizes."""
        entries, ends = [], dict(self._ends)
        for kind, f in self._files.items():
            lines = [(r, jsonl_line(r.data)) for r in records if r.kind == kind]
            for r, data in lines:
                ends[kind] += len(data)
                entries.append((json.dumps({"line": r.line, "file": kind, "end": ends[kind]}) + "\n").encode())
            if lines:
                self._append(f, b"".join(data for _, data in lines))
        return entries, ends

    @staticmethod
    def _append(f, data: bytes) -> None:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())

    def _roll_back(self) -> None:
        """After a failed commit (disk full...): cut every file back to its committed size."""
        for kind, f in self._files.items():
            f.truncate(self._ends[kind])
        self._journal.truncate(self._journal_end)


def _recover(paths: JournalPaths, header: dict) -> tuple[dict[int, Kind], dict[Kind, int]]:
    raw = paths.journal.read_bytes()
    complete = raw.split(b"\n")[:-1]  # what follows the last newline is a torn entry (or nothing)
    found = _parse_header(complete[0] if complete else b"", paths)
    _check_header(found, header, paths)
    done: dict[int, Kind] = {}
    ends: dict[Kind, int] = {"output": 0, "errors": 0}
    good_bytes = len(complete[0]) + 1
    for number, line in enumerate(complete[1:], start=2):
        entry = _parse_entry(line)
        if entry is None:
            if number < len(complete):  # only the last line can be torn by a crash
                raise JournalError(f"{paths.journal}: line {number} is not a journal entry; the file was "
                                   f"changed by hand. Move the output files away to start over")
            break
        done[entry["line"]] = entry["file"]
        ends[entry["file"]] = entry["end"]
        good_bytes += len(line) + 1
    _truncate(paths.journal, good_bytes, len(raw))
    for kind in ("output", "errors"):
        _cut_data_file(getattr(paths, kind), ends[kind])
    return done, ends


def _parse_header(line: bytes, paths: JournalPaths) -> dict:
    try:
        header = json.loads(line)
    except ValueError:
        header = None
    if not isinstance(header, dict) or header.get("version") != VERSION:
        raise JournalError(f"{paths.journal} has no valid journal header; move it and the output files away "
                           f"to start over")
    return header


def _check_header(found: dict, wanted: dict, paths: JournalPaths) -> None:
    for key, value in wanted.items():
        if found.get(key) != value:
            raise JournalError(f"{paths.journal} belongs to another run ({key}: {found.get(key)!r}, this run: "
                               f"{value!r}); rerun the same command with the same input file, or choose "
                               f"another --output")


def _parse_entry(line: bytes) -> dict | None:
    try:
        entry = json.loads(line)
    except ValueError:
        return None
    ok = (isinstance(entry, dict) and isinstance(entry.get("line"), int) and entry.get("file") in ("output", "errors")
          and isinstance(entry.get("end"), int))
    return entry if ok else None


def _cut_data_file(path: Path, end: int) -> None:
    size = path.stat().st_size if path.exists() else 0
    if size < end:
        raise JournalError(f"{path} has {size} bytes but its journal has results up to byte {end}; the file was "
                           f"truncated or replaced. Move the output files and journal away to start over")
    if size > end:
        _truncate(path, end, size)


def _truncate(path: Path, end: int, size: int) -> None:
    if size > end:
        log.info("%s: dropping %d bytes written after the last commit (a crash mid-write)", path, size - end)
        with open(path, "r+b") as f:
            f.truncate(end)
            os.fsync(f.fileno())


def _check_fresh(paths: JournalPaths) -> None:
    for path in (paths.output, paths.errors):
        if path.exists() and path.stat().st_size > 0:
            raise JournalError(f"{path} exists and has no journal ({paths.journal.name}), so it is not from an "
                               f"earlier run of this command; move it away or choose another --output/--errors")


def _write_atomically(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _locked(paths: JournalPaths):
    """The journal opened for appending, under an exclusive flock (released when closed, or by the kernel on a kill)."""
    f = open(paths.journal, "ab")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise JournalError(f"another process is writing {paths.output} (it holds {paths.journal}); "
                           f"wait for it or stop it first") from None
    return f
