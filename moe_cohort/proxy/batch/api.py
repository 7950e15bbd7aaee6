"""The OpenAI Files + Batch API on the proxy, for the official client's `files` and `batches` resources.

    POST /v1/files                      multipart: file, purpose=batch      -> File
    GET  /v1/files?purpose=&limit=&order=&after=   cursor pagination        -> list of File
    GET  /v1/files/{file_id}                                                -> File
    DELETE /v1/files/{file_id}          refused while a batch reads it      -> deletion status
    GET  /v1/files/{file_id}/content                                        -> the file's bytes
    POST /v1/batches                    {input_file_id, endpoint, completion_window, metadata}  -> Batch
    GET  /v1/batches/{batch_id}                                             -> Batch
    GET  /v1/batches?limit=&after=      newest first, cursor pagination     -> list of Batch
    POST /v1/batches/{batch_id}/cancel                                      -> Batch

Endpoints: /v1/chat/completions and /v1/completions. Errors use the OpenAI error shape (the app's
ServiceError handler). Every route acts for the caller's owner (`authorize` returns it, send/auth.py):
files and batches of another key or tenant are answered exactly as ids that do not exist (404),
and lists show only the caller's own. Storage and jobs: proxy/batch/store.py, proxy/batch/jobs.py.
"""

from __future__ import annotations

import asyncio
from typing import Callable, Mapping

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse

from moe_cohort.batch.format import URLS, new_id
from moe_cohort.proxy.batch.jobs import BatchJobs
from moe_cohort.proxy.batch.store import to_batch, to_file
from moe_cohort.send.errors import InvalidRequest, NotFound, PayloadTooLarge
from moe_cohort.send.protocol import check_size, json_object, limited

COMPLETION_WINDOWS = ("24h",)
CREATE_BODY_BYTES = 64 * 1024  # POST /v1/batches: four fields; metadata at most 16 x (64 + 512) characters


def add_batch_api(app: FastAPI, jobs: BatchJobs, authorize: Callable[[Mapping[str, str]], str],
                  max_file_bytes: int) -> None:
    """Add the routes to `app`, serving `jobs` (resumed at start-up and closed at shutdown by the app);
    `authorize(headers)` returns the caller's owner, or raises Unauthorized for a request without a valid key."""
    router = APIRouter(prefix="/v1")

    @router.post("/files")
    async def upload_file(request: Request) -> JSONResponse:
        owner = authorize(request.headers)
        check_size(request.headers.get("content-length"), max_file_bytes + 64 * 1024)
        return JSONResponse(to_file(await _store_upload(request, jobs, max_file_bytes, owner)))

    @router.get("/files")
    async def list_files(request: Request) -> JSONResponse:
        owner = authorize(request.headers)
        query = request.query_params
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise InvalidRequest(f"order must be 'asc' or 'desc', got {order!r}", param="order")
        if query.get("after") and jobs.store.get_file(query["after"], owner) is None:
            raise InvalidRequest(f"after: no file {query['after']!r}; pass the last id of the previous page",
                                 param="after")
        rows, has_more = jobs.store.list_files(_limit(query.get("limit", "10000"), 10_000), owner=owner,
                                               after=query.get("after"), purpose=query.get("purpose"), order=order)
        return _page([to_file(r) for r in rows], has_more)

    @router.delete("/files/{file_id}")
    async def delete_file(file_id: str, request: Request) -> JSONResponse:
        _delete_file(jobs, authorize(request.headers), file_id)
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})

    @router.get("/files/{file_id}")
    async def get_file(file_id: str, request: Request) -> JSONResponse:
        return JSONResponse(to_file(_file(jobs, authorize(request.headers), file_id)))

    @router.get("/files/{file_id}/content")
    async def file_content(file_id: str, request: Request) -> FileResponse:
        row = _file(jobs, authorize(request.headers), file_id)
        return FileResponse(row["path"], media_type="application/jsonl", filename=row["filename"])

    @router.post("/batches")
    async def create_batch(request: Request) -> JSONResponse:
        owner = authorize(request.headers)
        body = b"".join([chunk async for chunk in limited(
            request.stream(), CREATE_BODY_BYTES, "the batch request body",
            "send only input_file_id, endpoint, completion_window and metadata (16 pairs of at most 64 + 512 "
            "characters)")])
        params = _batch_params(body)
        return JSONResponse(to_batch(jobs.create(owner, **params)))

    @router.get("/batches/{batch_id}")
    async def get_batch(batch_id: str, request: Request) -> JSONResponse:
        return JSONResponse(to_batch(jobs.get(batch_id, authorize(request.headers))))

    @router.get("/batches")
    async def list_batches(request: Request) -> JSONResponse:
        owner = authorize(request.headers)
        limit, after = _limit(request.query_params.get("limit", "20"), 100), request.query_params.get("after")
        if after and jobs.store.get_batch(after, owner) is None:
            raise InvalidRequest(f"after: no batch {after!r}; pass the last id of the previous page", param="after")
        rows, has_more = jobs.store.list_batches(limit, owner=owner, after=after)
        return _page([to_batch(r) for r in rows], has_more)

    @router.post("/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str, request: Request) -> JSONResponse:
        return JSONResponse(to_batch(jobs.cancel(batch_id, authorize(request.headers))))

    app.include_router(router)


def _limit(raw: str, maximum: int) -> int:
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 9 and 1 <= int(raw) <= maximum):
        raise InvalidRequest(f"limit must be an integer from 1 to {maximum}, got {raw!r}", param="limit")
    return int(raw)


def _page(data: list[dict], has_more: bool) -> JSONResponse:
    """An OpenAI cursor page."""
    return JSONResponse({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                         "last_id": data[-1]["id"] if data else None, "has_more": has_more})


def _delete_file(jobs: BatchJobs, owner: str, file_id: str) -> None:
    """Delete `owner`'s uploaded or result file, unless an unfinished batch still reads it."""
    _file(jobs, owner, file_id)
    readers = jobs.store.active_batches_reading(file_id)
    if readers:
        raise InvalidRequest(f"file {file_id} is the input of unfinished batch {', '.join(readers)}; cancel it "
                             f"(POST /v1/batches/{{id}}/cancel) or let it finish, then delete the file",
                             param="file_id")
    jobs.store.delete_file(file_id, owner)


def _file(jobs: BatchJobs, owner: str, file_id: str) -> dict:
    """`owner`'s file; another owner's is NotFound, word for word as a missing one."""
    row = jobs.store.get_file(file_id, owner)
    if row is None:
        raise NotFound(f"no file {file_id!r}", param="file_id")
    return row


async def _store_upload(request: Request, jobs: BatchJobs, max_bytes: int, owner: str) -> dict:
    # counted while read: a chunked upload (no content-length) is refused as soon as it passes the limit
    # (+ 64 KiB of multipart framing), before the form parser has spooled all of it to disk
    limit, read = max_bytes + 64 * 1024, 0

    async def receive():
        nonlocal read
        message = await request.receive()
        read += len(message.get("body", b""))
        if read > limit:
            raise PayloadTooLarge(f"the upload is over the proxy's limit of {max_bytes} bytes per file ({read} bytes "
                                  f"read before it was refused); split the batch into smaller files or raise "
                                  f"max_file_bytes (COHORT_MAX_FILE_BYTES)")
        return message

    form = await Request(request.scope, receive).form()
    try:
        upload, purpose = form.get("file"), form.get("purpose")
        if purpose != "batch":
            raise InvalidRequest(f"purpose must be 'batch' (the only purpose this proxy stores), got {purpose!r}",
                                 param="purpose")
        if upload is None or isinstance(upload, str):
            raise InvalidRequest("send the file as multipart/form-data field 'file'", param="file")
        file_id = new_id("file-")
        path = jobs.store.upload_path(file_id)
        size = await asyncio.to_thread(_copy, upload.file, path, max_bytes)
        return jobs.store.add_file(file_id, upload.filename or "upload.jsonl", "batch", path, size, owner=owner)
    finally:
        await form.close()


def _copy(src, path, max_bytes: int) -> int:
    """Copy an upload to `path`; over `max_bytes` the partial copy is removed and 413 raised."""
    size = 0
    with open(path, "wb") as dst:
        while chunk := src.read(1 << 20):
            size += len(chunk)
            if size > max_bytes:
                break
            dst.write(chunk)
    if size > max_bytes:
        path.unlink()
        raise PayloadTooLarge(f"the file is over the proxy's limit of {max_bytes} bytes (max_file_bytes, COHORT_MAX_FILE_BYTES)")
    return size


def _batch_params(raw: bytes) -> dict:
    body = json_object(raw)
    if "input_file_id" not in body:
        raise InvalidRequest("'input_file_id' is required (the id of a file uploaded with purpose 'batch')",
                             param="input_file_id")
    if not isinstance(body["input_file_id"], str):
        raise InvalidRequest(f"input_file_id must be a string (the id of a file uploaded with purpose 'batch'), "
                             f"got {type(body['input_file_id']).__name__}", param="input_file_id")
    if not isinstance(body.get("endpoint"), str) or body["endpoint"] not in URLS:
        raise InvalidRequest(f"unsupported endpoint {body.get('endpoint')!r}; this proxy runs batches for "
                             f"{', '.join(sorted(URLS))}", param="endpoint")
    if body.get("completion_window") not in COMPLETION_WINDOWS:
        raise InvalidRequest(f"completion_window must be one of {COMPLETION_WINDOWS}, got "
                             f"{body.get('completion_window')!r}", param="completion_window")
    metadata = body.get("metadata")
    if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= 16 and all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in metadata.items())):
        raise InvalidRequest("metadata must be an object of at most 16 pairs: string keys of at most 64 characters, "
                             "string values of at most 512", param="metadata")
    return {"input_file_id": body["input_file_id"], "endpoint": body["endpoint"],
            "completion_window": body["completion_window"], "metadata": metadata}
