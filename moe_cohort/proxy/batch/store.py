"""Embedded storage of the Batch API: a directory with the files and SQLite for the records.

    <data_dir>/cohort.sqlite3              tables `files` and `batches` (schema below)
    <data_dir>/files/<file id>             uploaded files, as uploaded
    <data_dir>/batches/<batch id>/         a batch's run: output.jsonl, errors.jsonl, output.jsonl.journal
                                           (batch/journal.py); output and error files are registered in
                                           `files` with purpose batch_output and served from here

A batch record holds the OpenAI Batch object's fields; `to_batch`/`to_file` render the objects the
official client parses. Every file and batch has an `owner` (send/auth.py: "key:<sha256 of the API
key>", "tenant:<name>", or "" on an open proxy; never a key): the API's reads, lists and deletes take
the caller's owner and match only its records, so another owner's id reads as missing. A batch's
output and error files get the batch's owner. Databases from before owners gain the column on open,
their records owned by "" (the open proxy's owner): with keys configured no key sees them. Status changes go through `transition`, a compare-and-set, so a cancel
and a finishing run cannot both win. Everything is committed as it happens (SQLite in WAL mode,
synchronous=FULL): after a crash or restart the records say which batches were still running.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY,
    filename TEXT NOT NULL,
    purpose TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    path TEXT NOT NULL,
    owner TEXT NOT NULL DEFAULT ''  -- send/auth.py: a key's hash, a tenant, or '' (open proxy)
);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    status TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    expires_at INTEGER,
    in_progress_at INTEGER, finalizing_at INTEGER, completed_at INTEGER, failed_at INTEGER,
    cancelling_at INTEGER, cancelled_at INTEGER, expired_at INTEGER,
    output_file_id TEXT, error_file_id TEXT,
    total INTEGER NOT NULL DEFAULT 0, completed INTEGER NOT NULL DEFAULT 0, failed INTEGER NOT NULL DEFAULT 0,
    errors TEXT,          -- JSON list of {code, line, message, param}: why validation failed
    metadata TEXT,        -- JSON object
    usage TEXT,           -- JSON BatchUsage, summed as requests finish; shown once the batch is final
    input_sha256 TEXT, input_bytes INTEGER, -- the validated input, pinned for the journal
    owner TEXT NOT NULL DEFAULT ''
);
"""
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
FINAL = ("completed", "failed", "expired", "cancelled")
TIMESTAMPS = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "cancelling_at", "cancelled_at",
              "expired_at")


class BatchStore:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        (self.root / "files").mkdir(parents=True, exist_ok=True)
        (self.root / "batches").mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.root / "cohort.sqlite3", isolation_level=None, check_same_thread=False)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(SCHEMA)
        for table in ("files", "batches"):  # a database from before owners: its records are the open proxy's
            if "owner" not in {col["name"] for col in self._db.execute(f"PRAGMA table_info({table})")}:
                self._db.execute(f"ALTER TABLE {table} ADD COLUMN owner TEXT NOT NULL DEFAULT ''")

    @staticmethod
    def exists(root: str | Path) -> bool:
        return (Path(root) / "cohort.sqlite3").exists()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # files

    def upload_path(self, file_id: str) -> Path:
        return self.root / "files" / file_id

    def batch_dir(self, batch_id: str) -> Path:
        path = self.root / "batches" / batch_id
        path.mkdir(parents=True, exist_ok=True)
        return path

    def add_file(self, file_id: str, filename: str, purpose: str, path: Path, size: int, *, owner: str) -> dict:
        """Register `owner`'s file (replacing a record with the same id, so finalizing twice is harmless)."""
        row = {"id": file_id, "filename": filename, "purpose": purpose, "bytes": size, "created_at": _now(),
               "path": str(path), "owner": owner}
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO files (id, filename, purpose, bytes, created_at, path, owner) "
                             "VALUES (:id, :filename, :purpose, :bytes, :created_at, :path, :owner)", row)
        return row

    def get_file(self, file_id: str, owner: str | None) -> dict | None:
        """The file if `owner` owns it (None: whoever does, for the jobs that run a batch already checked)."""
        with self._lock:
            row = self._db.execute("SELECT * FROM files WHERE id = ? AND (? IS NULL OR owner = ?)",
                                   (file_id, owner, owner)).fetchone()
        return dict(row) if row else None

    def list_files(self, limit: int, *, owner: str, after: str | None = None, purpose: str | None = None,
                   order: str = "desc") -> tuple[list[dict], bool]:
        """`limit` of `owner`'s files in upload order (`order` asc or desc) after its file `after`; and whether
        more follow."""
        op, direction = ("<", "DESC") if order == "desc" else (">", "ASC")
        with self._lock:
            bound = self._db.execute("SELECT rowid FROM files WHERE id = ? AND owner = ?",
                                     (after, owner)).fetchone() if after else None
            where = ["owner = ?", f"rowid {op} ?"] + (["purpose = ?"] if purpose else [])
            start = bound[0] if bound else (1 << 62 if order == "desc" else -1)
            rows = self._db.execute(f"SELECT * FROM files WHERE {' AND '.join(where)} ORDER BY rowid {direction} "
                                    f"LIMIT ?", (owner, start, *([purpose] if purpose else []), limit + 1)).fetchall()
        return [dict(r) for r in rows[:limit]], len(rows) > limit

    def delete_file(self, file_id: str, owner: str) -> None:
        """Forget `owner`'s file's record and remove its bytes (another owner's file: nothing happens)."""
        with self._lock:
            row = self._db.execute("SELECT path FROM files WHERE id = ? AND owner = ?", (file_id, owner)).fetchone()
            self._db.execute("DELETE FROM files WHERE id = ? AND owner = ?", (file_id, owner))
        if row is not None:
            Path(row["path"]).unlink(missing_ok=True)

    # batches

    def active_batches_reading(self, file_id: str) -> list[str]:
        """Ids of the unfinished batches whose input is `file_id`."""
        marks = ", ".join("?" * len(ACTIVE))
        with self._lock:
            rows = self._db.execute(f"SELECT id FROM batches WHERE input_file_id = ? AND status IN ({marks})",
                                    (file_id, *ACTIVE)).fetchall()
        return [r["id"] for r in rows]

    def add_batch(self, record: dict) -> dict:
        cols = ", ".join(record)
        with self._lock:
            self._db.execute(f"INSERT INTO batches ({cols}) VALUES ({', '.join(':' + c for c in record)})",
                             _encoded(record))
        return self.get_batch(record["id"], None)

    def get_batch(self, batch_id: str, owner: str | None) -> dict | None:
        """The batch if `owner` owns it (None: whoever does)."""
        with self._lock:
            row = self._db.execute("SELECT * FROM batches WHERE id = ? AND (? IS NULL OR owner = ?)",
                                   (batch_id, owner, owner)).fetchone()
        return _decoded(row) if row else None

    def list_batches(self, limit: int, *, owner: str, after: str | None = None) -> tuple[list[dict], bool]:
        """`owner`'s batches newest first, `limit` of them after its batch `after` (OpenAI's cursor); and
        whether more follow."""
        with self._lock:
            bound = self._db.execute("SELECT seq FROM batches WHERE id = ? AND owner = ?",
                                     (after, owner)).fetchone() if after else None
            rows = self._db.execute("SELECT * FROM batches WHERE owner = ? AND seq < ? ORDER BY seq DESC LIMIT ?",
                                    (owner, bound[0] if bound else 1 << 62, limit + 1)).fetchall()
        return [_decoded(r) for r in rows[:limit]], len(rows) > limit

    def active_batches(self) -> list[dict]:
        """Batches a restart must pick up, oldest first."""
        marks = ", ".join("?" * len(ACTIVE))
        with self._lock:
            rows = self._db.execute(f"SELECT * FROM batches WHERE status IN ({marks}) ORDER BY seq", ACTIVE).fetchall()
        return [_decoded(r) for r in rows]

    def update(self, batch_id: str, **fields) -> None:
        sets = ", ".join(f"{k} = :{k}" for k in fields)
        with self._lock:
            self._db.execute(f"UPDATE batches SET {sets} WHERE id = :id", _encoded({**fields, "id": batch_id}))

    def transition(self, batch_id: str, from_status: tuple[str, ...], to_status: str, **fields) -> bool:
        """Set `to_status` (and its `<status>_at` stamp, and `fields`) if the batch is in one of `from_status`."""
        stamp = f"{to_status}_at"
        if stamp in TIMESTAMPS:
            fields[stamp] = _now()
        values = _encoded({**fields, "status": to_status, "id": batch_id})
        sets = ", ".join(f"{k} = :{k}" for k in (*fields, "status"))
        marks = ", ".join(f":from{i}" for i in range(len(from_status)))
        values.update({f"from{i}": s for i, s in enumerate(from_status)})
        with self._lock:
            cur = self._db.execute(f"UPDATE batches SET {sets} WHERE id = :id AND status IN ({marks})", values)
        return cur.rowcount == 1


def to_file(row: dict) -> dict:
    """The OpenAI File object."""
    return {"id": row["id"], "object": "file", "bytes": row["bytes"], "created_at": row["created_at"],
            "filename": row["filename"], "purpose": row["purpose"], "status": "processed", "expires_at": None,
            "status_details": None}


def to_batch(row: dict) -> dict:
    """The OpenAI Batch object."""
    errors = {"object": "list", "data": row["errors"]} if row["errors"] else None
    return {
        "id": row["id"], "object": "batch", "endpoint": row["endpoint"], "errors": errors,
        "input_file_id": row["input_file_id"], "completion_window": row["completion_window"], "status": row["status"],
        "output_file_id": row["output_file_id"], "error_file_id": row["error_file_id"],
        "created_at": row["created_at"], "expires_at": row["expires_at"],
        **{stamp: row[stamp] for stamp in TIMESTAMPS},
        "request_counts": {"total": row["total"], "completed": row["completed"], "failed": row["failed"]},
        "metadata": row["metadata"], "usage": row["usage"] if row["status"] in FINAL else None,
    }


_JSON_COLUMNS = ("errors", "metadata", "usage")


def _encoded(values: dict) -> dict:
    return {k: json.dumps(v) if k in _JSON_COLUMNS and v is not None else v for k, v in values.items()}


def _decoded(row: sqlite3.Row) -> dict:
    out = dict(row)
    for k in _JSON_COLUMNS:
        out[k] = json.loads(out[k]) if out[k] is not None else None
    return out


def _now() -> int:
    return int(time.time())
