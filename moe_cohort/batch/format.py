"""OpenAI Batch files: request lines in, result lines out.

Input line (one JSON object per line, https://platform.openai.com/docs/guides/batch):

    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [...], ...}}

Output line (results file and error file alike):

    {"id": "batch_req_...", "custom_id": "r1",
     "response": {"status_code": 200, "request_id": "req_...", "body": {...}} | null,
     "error": {"code": "...", "message": "..."} | null}

`read_batch_file` validates the whole file before anything is sent: every bad line (not JSON, not
UTF-8, missing or duplicate custom_id, unsupported method or url, streaming, a body the proxy would
reject, over the size limit) becomes an `InputError` naming its 1-based line. Blank lines are
skipped but keep their numbers. The JSON decoding is encoder.inputs' (`load_record`), the body
checks are the proxy's own (`protocol.prepare_body`), so a line passes here exactly when the proxy
would accept it as a request.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Iterator, Mapping

from moe_cohort.admission.wire import BATCH_KEY
from moe_cohort.encoder.inputs import InputError, load_record
from moe_cohort.send.errors import ServiceError
from moe_cohort.send.hints import HintRules
from moe_cohort.send.protocol import Route, prepare_body

URLS: dict[str, Route] = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}


@dataclass(frozen=True)
class BatchRequest:
    line: int  # 1-based line in the input file: the request's key in the journal
    custom_id: str
    url: str
    body: dict  # the line's body, vllm_xargs.moe_routing set to `policy`
    policy: str  # canonical routing policy
    text: str  # what the encoder sees ("" for token-id prompts)


@dataclass(frozen=True)
class LineError:
    line: int
    message: str  # "line N: reason"
    custom_id: str | None  # the line's custom_id when it has a readable one


@dataclass
class BatchFile:
    requests: list[BatchRequest] = field(default_factory=list)
    errors: list[LineError] = field(default_factory=list)
    sha256: str = ""  # of the file's bytes: a journal only resumes the file it was started with
    size: int = 0
    lines: int = 0

    @property
    def journal_meta(self) -> dict:
        """What a journal of this file pins (batch/journal.py): a journal only resumes the file it started with."""
        return {"input_sha256": self.sha256, "input_bytes": self.size}


def read_batch_file(path: str | Path, *, default_policy: str, max_line_bytes: int,
                    urls: Mapping[str, Route] = URLS, rules: HintRules = HintRules()) -> BatchFile:
    """Parse and validate every line of `path`; bad lines are collected, not raised. `rules`: which engine
    hints a line may carry (send/hints.py: by default none of the proxy's own, any routing policy)."""
    out, digest, seen = BatchFile(), hashlib.sha256(), {}
    with open(path, "rb") as f:
        for number, raw, size in _lines(f, max_line_bytes, digest):
            out.size += size
            out.lines = number
            try:
                if raw is None:
                    raise InputError(number, f"{size} bytes, over the limit of {max_line_bytes} bytes per line")
                if not raw.strip():
                    continue
                request = parse_request_line(raw, number, default_policy=default_policy, urls=urls, rules=rules)
                if request.custom_id in seen:
                    raise InputError(number, f"duplicate custom_id {json.dumps(request.custom_id)} "
                                             f"(first on line {seen[request.custom_id]})")
                seen[request.custom_id] = number
                out.requests.append(request)
            except InputError as err:
                out.errors.append(LineError(number, str(err), _custom_id_of(raw)))
    out.sha256 = digest.hexdigest()
    return out


def parse_request_line(raw: bytes | str, line: int, *, default_policy: str, urls: Mapping[str, Route] = URLS,
                       rules: HintRules = HintRules()) -> BatchRequest:
    """One Batch request line -> BatchRequest; raises InputError naming the line."""
    record = load_record(raw, line)
    custom_id = record.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise InputError(line, f"'custom_id' must be a non-empty string, got {json.dumps(custom_id)}")
    if record.get("method") != "POST":
        raise InputError(line, f"'method' must be \"POST\", got {json.dumps(record.get('method'))}")
    url = record.get("url")
    if url not in urls:
        raise InputError(line, f"unsupported url {json.dumps(url)}; expected one of {', '.join(sorted(urls))}")
    body = record.get("body")
    if not isinstance(body, dict):
        raise InputError(line, "'body' must be a JSON object (the request body for the url)")
    if body.get("stream"):
        raise InputError(line, "'stream' is not supported in batch requests; remove it from the body")
    try:
        request = prepare_body(body, urls[url], {}, default_policy=default_policy, rules=rules)
    except ServiceError as exc:
        raise InputError(line, exc.message) from exc
    request.body["vllm_xargs"][BATCH_KEY] = 1  # the engine chooses it under no fairness bound
    return BatchRequest(line, custom_id, url, request.body, request.policy, request.text)


def _lines(f: BinaryIO, max_bytes: int, digest) -> Iterator[tuple[int, bytes | None, int]]:
    """(number, line bytes or None when over max_bytes, size) for every line; long lines are not held in memory."""
    number = 0
    while True:
        chunk = f.readline(max_bytes + 1)
        if not chunk:
            return
        number += 1
        digest.update(chunk)
        size = len(chunk)
        if size > max_bytes and not chunk.endswith(b"\n"):
            while chunk and not chunk.endswith(b"\n"):  # read past the rest of the long line
                chunk = f.readline(1 << 20)
                digest.update(chunk)
                size += len(chunk)
            yield number, None, size
        else:
            yield number, chunk, size


def _custom_id_of(raw: bytes | None) -> str | None:
    """The custom_id of a bad line when it has one (so the error file can name it)."""
    try:
        value = json.loads(raw).get("custom_id") if raw else None
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


def result_line(request: BatchRequest, request_id: str, status_code: int, body) -> dict:
    """A finished request: the backend's answer (any status), OpenAI Batch output schema."""
    error = None
    if status_code >= 400:
        error = error_of(status_code, body)
    return {"id": new_id("batch_req_"), "custom_id": request.custom_id,
            "response": {"status_code": status_code, "request_id": request_id, "body": body}, "error": error}


def failure_line(custom_id: str | None, code: str, message: str) -> dict:
    """A request that got no answer (timeouts, invalid line, cancelled): response null, error set."""
    return {"id": new_id("batch_req_"), "custom_id": custom_id or None, "response": None,
            "error": {"code": code, "message": message}}


def error_of(status_code: int, body) -> dict:
    """{code, message} from a backend error body (OpenAI/vLLM shape), else from the status."""
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        message = error.get("message") or json.dumps(error)
        code = error.get("code") or error.get("type") or str(status_code)
        return {"code": str(code), "message": str(message)}
    message = body.get("message") if isinstance(body, dict) else None
    return {"code": str(status_code), "message": str(message or body)}
