"""The Batch API end to end: the official openai client -> the proxy (uvicorn) -> a real vLLM CPU server."""

import asyncio
import json
import sqlite3
import time

import httpx
import openai
import pytest

from moe_cohort.proxy.app import create_app
from moe_cohort.proxy.batch.store import BatchStore
from moe_cohort.send.settings import Settings
from tests.helpers.batch_api import jsonl, request_line, settings, wait_for
from tests.helpers.encoders import encoder  # noqa: F401 (a fixture)
from tests.helpers.proxy_thread import ProxyThread


def client_for(proxy):
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0)


def output_lines(client, file_id):
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()] if file_id else []


@pytest.fixture(scope="module")
def proxy(vllm_server, tmp_path_factory):
    with ProxyThread(settings(vllm_server, tmp_path_factory.mktemp("batch-data"))) as p:
        yield p


def test_upload_create_poll_download(proxy):
    client = client_for(proxy)
    lines = [request_line(f"q{i}", f"question number {i}") for i in range(9)]
    lines.append(request_line("too-long", "x", max_tokens=5000))  # vLLM rejects it: the error file gets its message
    upload = client.files.create(file=("requests.jsonl", jsonl(lines)), purpose="batch")
    assert upload.purpose == "batch" and upload.bytes == len(jsonl(lines)) and upload.filename == "requests.jsonl"
    assert client.files.retrieve(upload.id).id == upload.id
    assert client.files.content(upload.id).content == jsonl(lines)

    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h",
                                  metadata={"job": "e2e"})
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"job": "e2e"}
    batch = wait_for(client, batch.id)
    assert batch.status == "completed" and batch.completed_at and batch.in_progress_at and batch.finalizing_at
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (10, 9, 1)

    results = output_lines(client, batch.output_file_id)
    assert sorted(r["custom_id"] for r in results) == sorted(f"q{i}" for i in range(9))
    for r in results:
        assert set(r) == {"id", "custom_id", "response", "error"} and r["error"] is None
        assert r["id"].startswith("batch_req_") and r["response"]["request_id"].startswith("req_")
        assert r["response"]["status_code"] == 200 and r["response"]["body"]["object"] == "chat.completion"
        assert r["response"]["body"]["usage"]["completion_tokens"] == 6
    (failed,) = output_lines(client, batch.error_file_id)
    assert failed["custom_id"] == "too-long" and failed["response"]["status_code"] == 400
    assert "max_tokens=5000" in failed["error"]["message"]  # vLLM's own message
    assert batch.usage.output_tokens == 54
    assert client.files.retrieve(batch.output_file_id).purpose == "batch_output"
    with pytest.raises(openai.BadRequestError, match="has purpose 'batch_output'; a batch reads a file uploaded"):
        client.batches.create(input_file_id=batch.output_file_id, endpoint="/v1/chat/completions",
                              completion_window="24h")


def test_a_batch_of_a_learning_proxy_teaches_its_head(vllm_server, encoder, tmp_path):
    """`cohort serve --learn`: the Batch API's requests are counted by the plugin and learned from like online ones."""
    with ProxyThread(settings(vllm_server, tmp_path, encoder=encoder, learn=True)) as proxy:
        client = client_for(proxy)
        upload = client.files.create(file=("r.jsonl", jsonl([request_line(f"q{i}", f"question {i}") for i in range(20)])),
                                     purpose="batch")
        batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
        assert wait_for(client, batch.id).request_counts.completed == 20
        deadline = time.monotonic() + 30
        while (learning := httpx.get(proxy.url + "/health").json()["admission"]["learning"])["observed"] < 20:
            assert time.monotonic() < deadline, learning
            time.sleep(0.2)
    assert learning["head_fitted_on"] >= 16


def test_invalid_file_fails_with_line_numbers(proxy):
    client = client_for(proxy)
    lines = [request_line("a", "hi"), "{broken", request_line("a", "dup"),
             request_line("big", "y" * 11 * 1024 * 1024)]  # over max_body_bytes (10 MiB)
    upload = client.files.create(file=("bad.jsonl", jsonl(lines)), purpose="batch")
    batch = wait_for(client, client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                                   completion_window="24h").id)
    assert batch.status == "failed" and batch.failed_at and batch.output_file_id is None
    errors = {e.line: e.message for e in batch.errors.data}
    assert sorted(errors) == [2, 3, 4]
    assert "invalid JSON" in errors[2] and 'duplicate custom_id "a" (first on line 1)' in errors[3]
    assert "over the limit" in errors[4]


def test_openai_errors_for_bad_calls(proxy):
    client = client_for(proxy)
    with pytest.raises(openai.NotFoundError, match="no batch 'batch_nope'"):
        client.batches.retrieve("batch_nope")
    with pytest.raises(openai.NotFoundError):
        client.files.content("file-nope")
    with pytest.raises(openai.BadRequestError, match="purpose must be 'batch'"):
        client.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")
    upload = client.files.create(file=("x.jsonl", jsonl([request_line("a", "hi")])), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="unsupported endpoint"):
        client.batches.create(input_file_id=upload.id, endpoint="/v1/embeddings", completion_window="24h")
    with pytest.raises(openai.NotFoundError, match="no file 'file-missing'"):
        client.batches.create(input_file_id="file-missing", endpoint="/v1/chat/completions", completion_window="24h")


def test_list_paginates_newest_first(proxy):
    client = client_for(proxy)
    upload = client.files.create(file=("one.jsonl", jsonl([request_line("a", "hi", max_tokens=1)])), purpose="batch")
    made = [client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                  completion_window="24h").id for _ in range(3)]
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == made[::-1][:2] and first.has_more
    listed = [b.id for b in client.batches.list(limit=2)]  # auto-pagination follows `after`
    assert listed[:3] == made[::-1] and len(listed) == len(set(listed))
    for batch_id in made:
        assert wait_for(client, batch_id).status == "completed"


def test_cancel_keeps_partial_results(vllm_server, tmp_path):
    with ProxyThread(settings(vllm_server, tmp_path, batch_max_in_flight=1)) as proxy:
        client = client_for(proxy)
        lines = [request_line(f"c{i}", f"cancel me {i}", max_tokens=16) for i in range(60)]
        upload = client.files.create(file=("cancel.jsonl", jsonl(lines)), purpose="batch")
        batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
        wait_for(client, batch.id, until=lambda b: b.request_counts.completed >= 3)
        cancelled = client.batches.cancel(batch.id)
        assert cancelled.status in ("cancelling", "cancelled") and cancelled.cancelling_at
        batch = wait_for(client, batch.id, statuses=("cancelled",), timeout=30)
        done = batch.request_counts.completed
        assert batch.cancelled_at and 3 <= done < 60
        results = output_lines(client, batch.output_file_id)
        assert len(results) == done and len({r["custom_id"] for r in results}) == done
        assert client.batches.cancel(batch.id).status == "cancelled"  # cancelling twice is harmless
        small = client.files.create(file=("one.jsonl", jsonl([request_line("one", "hi", max_tokens=1)])), purpose="batch")
        finished = wait_for(client, client.batches.create(input_file_id=small.id, endpoint="/v1/chat/completions",
                                                          completion_window="24h").id)
        with pytest.raises(openai.BadRequestError, match="is completed; only validating or in_progress"):
            client.batches.cancel(finished.id)


def test_restart_resumes_a_running_batch(vllm_server, tmp_path):
    lines = [request_line(f"r{i}", f"resume {i}", max_tokens=16) for i in range(40)]
    with ProxyThread(settings(vllm_server, tmp_path, batch_max_in_flight=1)) as proxy:
        client = client_for(proxy)
        upload = client.files.create(file=("resume.jsonl", jsonl(lines)), purpose="batch")
        batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
        wait_for(client, batch.id, until=lambda b: b.request_counts.completed >= 5)
    with sqlite3.connect(tmp_path / "cohort.sqlite3") as db:  # the proxy is down, mid-batch
        status, completed = db.execute("SELECT status, completed FROM batches WHERE id = ?", (batch.id,)).fetchone()
    assert status == "in_progress" and 5 <= completed < 40
    with ProxyThread(settings(vllm_server, tmp_path, batch_max_in_flight=4)) as proxy:
        client = client_for(proxy)
        batch = wait_for(client, batch.id)
        assert batch.status == "completed" and batch.request_counts.completed == 40
        ids = [r["custom_id"] for r in output_lines(client, batch.output_file_id)]
    assert sorted(ids) == sorted(f"r{i}" for i in range(40)) and len(ids) == len(set(ids))


def test_batch_routes_need_the_proxy_key_and_answer_in_openai_shape(tmp_path):
    app = create_app(Settings(backends=("http://vllm.test",), encoder="none", api_keys=("k",), data_dir=str(tmp_path)))
    key = {"Authorization": "Bearer k"}

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as c:
            return [await c.get("/v1/batches"),
                    await c.post("/v1/files", files={"file": ("a.jsonl", b"{}\n")}, data={"purpose": "batch"}),
                    await c.get("/v1/batches/batch_x", headers=key),
                    await c.get("/v1/batches?limit=0", headers=key),
                    await c.post("/v1/batches", content=b"{", headers=key),
                    await c.get("/v1/batches", headers=key)]

    no_key, upload_no_key, missing, bad_limit, bad_json, empty = asyncio.run(main())
    assert no_key.status_code == upload_no_key.status_code == 401
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "invalid_request_error"
    assert bad_limit.status_code == 400 and "limit must be an integer from 1 to 100" in bad_limit.json()["error"]["message"]
    assert bad_json.status_code == 400 and "not valid JSON" in bad_json.json()["error"]["message"]
    assert empty.json() == {"object": "list", "data": [], "first_id": None, "last_id": None, "has_more": False}


def test_files_list_pages_and_delete_refuses_a_file_a_running_batch_reads(tmp_path):
    app = create_app(Settings(backends=("http://127.0.0.1:9",), encoder="none", data_dir=str(tmp_path)))

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as http:
            client = openai.AsyncOpenAI(base_url="http://proxy/v1", api_key="unused", max_retries=0, http_client=http)
            ids = [(await client.files.create(file=(f"f{i}.jsonl", jsonl([request_line("a", "x")])),
                                              purpose="batch")).id for i in range(3)]
            newest = await client.files.list(limit=2)
            rest = await client.files.list(limit=2, after=newest.data[-1].id)
            oldest_first = await client.files.list(order="asc")
            outputs = await client.files.list(purpose="batch_output")
            BatchStore(tmp_path).add_batch({"id": "batch_running", "status": "in_progress", "endpoint": "/v1/completions",
                                            "input_file_id": ids[0], "completion_window": "24h", "created_at": 0})
            with pytest.raises(openai.BadRequestError) as in_use:
                await client.files.delete(ids[0])
            deleted = await client.files.delete(ids[1])
            with pytest.raises(openai.NotFoundError):
                await client.files.retrieve(ids[1])
            with pytest.raises(openai.NotFoundError):
                await client.files.delete(ids[1])
            bad_order = await http.get("/v1/files?order=sideways")
            left = [f.id for f in (await client.files.list()).data]
        return ids, newest, rest, oldest_first, outputs, in_use.value, deleted, bad_order, left

    ids, newest, rest, oldest_first, outputs, in_use, deleted, bad_order, left = asyncio.run(main())
    assert [f.id for f in newest.data] == [ids[2], ids[1]] and newest.has_more
    assert [f.id for f in rest.data] == [ids[0]] and not rest.has_more
    assert [f.id for f in oldest_first.data] == ids and outputs.data == []
    assert "unfinished batch batch_running" in in_use.message
    assert deleted.deleted and deleted.id == ids[1] and left == [ids[2], ids[0]]
    assert not (tmp_path / "files" / ids[1]).exists() and (tmp_path / "files" / ids[0]).exists()
    assert bad_order.status_code == 400 and "order must be 'asc' or 'desc'" in bad_order.json()["error"]["message"]


BASE = {"endpoint": "/v1/completions", "completion_window": "24h"}


async def chunks(parts):
    """A body with no content-length (sent chunked)."""
    for part in parts:
        yield part


@pytest.mark.parametrize("method, path, body, status, message", [
    ("GET", "/v1/files?limit=%C2%B2", None, 400, "limit must be an integer from 1 to 10000, got '²'"),
    ("GET", "/v1/files?limit=" + "9" * 5000, None, 400, "limit must be an integer from 1 to 10000"),
    ("GET", "/v1/batches?limit=%C2%B2", None, 400, "limit must be an integer from 1 to 100, got '²'"),
    ("GET", "/v1/files?after=file-nope", None, 400, "after: no file 'file-nope'"),
    ("GET", "/v1/batches?after=batch_nope", None, 400, "after: no batch 'batch_nope'"),
    ("POST", "/v1/batches", {**BASE, "input_file_id": 123}, 400, "input_file_id must be a string"),
    ("POST", "/v1/batches", {**BASE, "endpoint": ["/v1/completions"]}, 400, "unsupported endpoint ['/v1/completions']"),
    ("POST", "/v1/batches", {**BASE, "completion_window": "1h"}, 400, "completion_window must be one of ('24h',)"),
    ("POST", "/v1/batches", {**BASE, "metadata": {"k" * 65: "v"}}, 400, "keys of at most 64 characters"),
    ("POST", "/v1/batches", {**BASE, "metadata": {"k": "v" * 513}}, 400, "values of at most 512"),
    ("POST", "/v1/batches", b'{"metadata": ' + b"[" * 30_000 + b"]" * 30_000 + b"}", 400, "nested too deeply"),
    ("POST", "/v1/batches", {**BASE, "metadata": {"k": "v" * 200_000}}, 413, "the batch request body is over"),
    ("POST", "/v1/batches", [b'{"metadata": "', b"v" * 200_000, b'"}'], 413, "the batch request body is over"),  # chunked
    ("DELETE", "/v1/batches/batch_x", None, 405, "DELETE /v1/batches/batch_x: Method Not Allowed"),
    ("GET", "/v1/batches/batch_x/cancel", None, 405, "Method Not Allowed"),
    ("PUT", "/v1/files", None, 405, "Method Not Allowed"),
])
def test_wrong_fields_and_methods_are_openai_errors_naming_them(tmp_path, method, path, body, status, message):
    app = create_app(Settings(backends=("http://127.0.0.1:9",), encoder="none", data_dir=str(tmp_path)))

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as c:
            upload = await c.post("/v1/files", files={"file": ("a.jsonl", jsonl([request_line("a", "x")]))},
                                  data={"purpose": "batch"})
            content = body if not isinstance(body, dict) else json.dumps({"input_file_id": upload.json()["id"],
                                                                          **body}).encode()
            return await c.request(method, path, content=chunks(content) if isinstance(content, list) else content)

    answer = asyncio.run(main())
    error = answer.json()["error"]
    assert answer.status_code == status and message in error["message"], error
    assert set(error) == {"message", "type", "param", "code"}
