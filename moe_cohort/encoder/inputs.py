"""Input lines of `cohort plan`: OpenAI Batch request lines or plain {"id", "text"} lines.

The kind is detected per line: a line with `custom_id` is an OpenAI Batch request line
(`{"custom_id", "method", "url", "body": {"messages" | "prompt", ...}}`) and its text comes from
the body; a line with `id` and `text` is a plain line. Both give a `PlanInput(id, text)`; the id is
kept as the JSON value it was (string or integer) so the plan names requests exactly as the input did.
No file I/O here: the CLI reads the lines and reports `InputError`s with their line numbers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable, Iterator

from moe_cohort.encoder.text import RequestTextError, request_text


class InputError(ValueError):
    """An input line cannot be planned; `line` is its 1-based number, the message says why."""

    def __init__(self, line: int, reason: str, raw: str = ""):
        super().__init__(f"line {line}: {reason}")
        self.line, self.reason, self.raw = line, reason, raw


@dataclass(frozen=True)
class PlanInput:
    id: str | int
    text: str
    line: int


def load_record(raw: str | bytes, line: int) -> dict:
    """One JSONL line (text, or bytes in UTF-8, BOM allowed) -> its JSON object; raises InputError naming the line."""
    try:  # the line end stripped: a fault at the end of the line is at its last column, not "line 2 column 1"
        text = (raw.decode("utf-8-sig") if isinstance(raw, bytes) else raw.lstrip("\ufeff")).rstrip()
        record = json.loads(text)
    except UnicodeDecodeError as exc:
        raise InputError(line, f"not valid UTF-8 (byte {exc.start})") from exc
    except json.JSONDecodeError as exc:
        end = " (the end of the line)" if exc.pos >= len(text) else ""
        raise InputError(line, f"invalid JSON ({exc.msg} at column {exc.pos + 1}{end})") from exc
    if not isinstance(record, dict):
        raise InputError(line, f"expected a JSON object, got {type(record).__name__}")
    return record


def parse_line(raw: str | bytes, line: int) -> PlanInput:
    """One JSONL line (text, or bytes in UTF-8) -> PlanInput; raises InputError naming the line."""
    record = load_record(raw, line)
    if "custom_id" in record:
        key, body = record["custom_id"], record.get("body")
        if not isinstance(body, dict):
            raise InputError(line, "an OpenAI Batch line needs a 'body' object with 'messages' or 'prompt'")
    elif "id" in record and "text" in record:
        key, body = record["id"], record["text"]
        if not isinstance(body, str):
            raise InputError(line, "'text' must be a string")
    else:
        raise InputError(line, "expected an OpenAI Batch line (custom_id, body) or a plain line (id, text)")
    if isinstance(key, bool) or not isinstance(key, (str, int)):
        raise InputError(line, f"the id must be a string or an integer, got {json.dumps(key)}")
    try:
        return PlanInput(id=key, text=request_text(body), line=line)
    except RequestTextError as exc:
        raise InputError(line, str(exc)) from exc


def parse_lines(lines: Iterable[str | bytes], *, skip_invalid: bool = False) -> Iterator[PlanInput | InputError]:
    """Parse numbered lines (blank ones skipped). Yields PlanInputs, and InputErrors when skipping.

    Without `skip_invalid` the first bad line raises. Duplicate ids are errors: a plan names each
    request once.
    """
    seen: dict[str | int, int] = {}
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            item = parse_line(raw, number)
            if item.id in seen:
                raise InputError(number, f"duplicate id {json.dumps(item.id)} (first on line {seen[item.id]})")
            seen[item.id] = number
        except InputError as err:
            if not skip_invalid:
                raise
            err.raw = (raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw).rstrip("\r\n")
            yield err
            continue
        yield item
