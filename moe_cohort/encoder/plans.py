"""Plans: the one type, its invariants, the arrival chunker and the one plan-file format.

A plan is an ordered list of batches; a batch is an int64 array of request indices [n_b]. Every
request appears in exactly one batch and no batch holds more than B requests. `cohort plan`,
`cohort batch run --dry-run` and `cohort eval --plan` all write or read the same file format:

    one JSON line per request: {"id": str, "batch": int, "position": int, ...}

"position" is the member's place in its batch as written (hand-made files may number globally);
"batch" is a label. On read, batches are ordered by their smallest position, ties by first
appearance, and members by position (or line order). Extra fields (the batch runner adds
"custom_id", "line" and "policy") are written as given and ignored on read.
This module is on the ground floor: numpy and the standard library only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

Plan = list[np.ndarray]


class PlanError(ValueError):
    """A plan (or plan file) breaks the plan invariants; the message names the broken one."""


def validate_plan(plan: Plan, num_requests: int, batch_size: int) -> None:
    """Raise PlanError unless every request 0..N-1 is in exactly one batch of at most `batch_size`."""
    sizes = [len(b) for b in plan]
    if any(s > batch_size for s in sizes):
        raise PlanError(f"batch {int(np.argmax(sizes))} holds {max(sizes)} requests, more than the batch size {batch_size}")
    if any(s == 0 for s in sizes):
        raise PlanError(f"batch {sizes.index(0)} is empty")
    members = np.concatenate(plan) if plan else np.zeros(0, np.int64)
    counts = np.bincount(members, minlength=num_requests) if len(members) else np.zeros(num_requests, np.int64)
    if len(counts) > num_requests or members.min(initial=0) < 0:
        raise PlanError(f"plan refers to request indices outside [0, {num_requests})")
    if (counts != 1).any():
        bad = int(np.flatnonzero(counts != 1)[0])
        raise PlanError(f"request index {bad} appears {int(counts[bad])} times; every request must be in exactly one batch")


def chunk(order: Sequence[int], batch_size: int) -> Plan:
    """Cut an order of requests into consecutive batches of `batch_size` (the last may be short)."""
    order = np.asarray(order, dtype=np.int64)
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def arrival_plan(num_requests: int, batch_size: int) -> Plan:
    """Batches in arrival (file) order."""
    return chunk(np.arange(num_requests), batch_size)


def write_plan_file(path: str | Path, plan: Plan, ids: Sequence[str | int],
                    extra: Sequence[Mapping[str, Any]] | None = None) -> None:
    """Write `plan` over requests named `ids` (str or int, kept as given) in dispatch order;
    `extra[i]` adds fields to request i's line."""
    with open(path, "w", encoding="utf-8") as f:
        for b, batch in enumerate(plan):
            for pos, i in enumerate(batch):
                fields = dict(extra[int(i)]) if extra is not None else {}
                f.write(json.dumps({"id": ids[int(i)], "batch": b, "position": pos, **fields}) + "\n")


def read_plan_file(path: str | Path, request_ids: Sequence[str]) -> Plan:
    """Parse `path` into a Plan over `request_ids`; PlanError names the offending line."""
    index = {str(rid): i for i, rid in enumerate(request_ids)}
    members: dict[int, list[tuple[float, int]]] = {}
    seen: dict[int, int] = {}
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if line.strip():
                req, batch, key = _parse_line(line, line_no, path, index)
                if req in seen:
                    raise PlanError(f"{path} line {line_no}: id {request_ids[req]!r} already placed on line {seen[req]}")
                seen[req] = line_no
                members.setdefault(batch, []).append((key, req))
    missing = len(request_ids) - len(seen)
    if missing:
        absent = next(str(r) for i, r in enumerate(request_ids) if i not in seen)
        raise PlanError(f"{path}: {missing} request(s) of the traces are in no batch (e.g. id {absent!r}); "
                        f"a plan must place every request")
    ordered = sorted(members.values(), key=lambda m: min(k for k, _ in m))
    return [np.array([r for _, r in sorted(m)], dtype=np.int64) for m in ordered]


def _parse_line(line: str, line_no: int, path, index: dict[str, int]) -> tuple[int, int, float]:
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as exc:
        raise PlanError(f"{path} line {line_no}: invalid JSON ({exc.msg})") from exc
    if not isinstance(rec, dict) or "id" not in rec or "batch" not in rec:
        raise PlanError(f"{path} line {line_no}: expected an object with 'id' and 'batch'")
    if not isinstance(rec["batch"], int) or isinstance(rec["batch"], bool):
        raise PlanError(f"{path} line {line_no}: 'batch' must be an integer, got {rec['batch']!r}")
    position = rec.get("position", line_no)
    if not isinstance(position, (int, float)) or isinstance(position, bool):
        raise PlanError(f"{path} line {line_no}: 'position' must be a number, got {position!r}")
    req = index.get(str(rec["id"]))
    if req is None:
        raise PlanError(f"{path} line {line_no}: id {rec['id']!r} is not a request of the traces")
    return req, rec["batch"], float(position)
