"""Read plan files: one JSON line per request, {"id": ..., "batch": int, "position": int (optional)}.

Batches are ordered by their first position (or first line) and members by position (or line
order). Ids are matched against the traces' request ids as strings.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import numpy as np

from eval.plans import Plan, PlanError


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
