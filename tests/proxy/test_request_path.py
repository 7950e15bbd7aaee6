"""What every request meets on its way in: size limits applied while reading (raw sockets against the
proxy under uvicorn), deeply nested JSON, unexpected exceptions, the request id and the access log."""

import json
import logging
import re
import select
import socket
import time

import httpx
import pytest

from moe_cohort.embedded.vllm_server import free_port
from moe_cohort.proxy.app import create_app
from moe_cohort.send.settings import Settings
from tests.helpers.proxy_client import CHAT, proxy_client, run
from tests.helpers.proxy_thread import ProxyThread
from tests.helpers.vllm_stub import OK_BODY, answer, ok

CHUNK = 64 * 1024
# what the proxy may read past a limit: the one body message that crosses it (uvicorn stops reading from the
# socket past 64 KiB of unconsumed body; asyncio reads at most 256 KiB at a time)
ONE_READ = 64 * 1024 + 256 * 1024


def send_chunked(port: int, path: str, head: bytes, chunks: int, content_type: bytes = b"application/json",
                 tail: bytes = b"") -> tuple[int, bytes]:
    """POST `head`, then `chunks` chunks of CHUNK bytes, then `tail`, with chunked transfer encoding (no
    content-length), and stop sending as soon as the server answers. (chunks sent, the answer's bytes)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    with sock:
        sock.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: proxy\r\nTransfer-Encoding: chunked\r\n"
                     b"Content-Type: " + content_type + b"\r\n\r\n" + b"%x\r\n%s\r\n" % (len(head), head))
        sent, frame = 0, b"%x\r\n%s\r\n" % (CHUNK, b"x" * CHUNK)
        while sent < chunks and not select.select([sock], [], [], 0)[0]:
            sock.sendall(frame)
            sent += 1
        if sent == chunks:
            sock.sendall(b"%x\r\n%s\r\n0\r\n\r\n" % (len(tail), tail) if tail else b"0\r\n\r\n")
        received = b""
        while b"\r\n\r\n" not in received or len(received) < received.index(b"\r\n\r\n") + 4 + _length(received):
            data = sock.recv(65536)
            if not data:
                break
            received += data
    return sent, received


def _length(received: bytes) -> int:
    found = re.search(rb"content-length: (\d+)", received.lower())
    return int(found.group(1)) if found else 0


def _status_and_error(received: bytes) -> tuple[int, dict]:
    head, _, body = received.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def _bytes_read(message: str) -> int:
    return int(re.search(r"\((\d+) bytes read before it was refused\)", message).group(1))


@pytest.fixture
def proxy(tmp_path):
    settings = Settings(backends=("http://127.0.0.1:9",), port=free_port(), encoder="none", data_dir=str(tmp_path),
                        max_body_bytes=4 * CHUNK, max_file_bytes=4 * CHUNK)
    with ProxyThread(settings) as p:
        yield p


def test_chunked_body_is_refused_while_it_is_read(proxy):
    """1,024 chunks of 64 KiB (64 MiB) against a 256 KiB limit: the 413 comes while the client still sends."""
    sent, received = send_chunked(int(proxy.url.rsplit(":", 1)[1]), "/v1/chat/completions", b'{"pad": "', 1024)
    status, error = _status_and_error(received)
    assert status == 413 and sent < 1024
    assert "over the proxy's limit of 262144 bytes" in error["message"]
    assert _bytes_read(error["message"]) <= 4 * CHUNK + ONE_READ


def test_chunked_upload_is_refused_while_it_is_read(proxy):
    boundary = b"b0undary"
    head = (b"--" + boundary + b'\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--' + boundary
            + b'\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n'
            b"Content-Type: application/jsonl\r\n\r\n")
    sent, received = send_chunked(int(proxy.url.rsplit(":", 1)[1]), "/v1/files", head, 1024,
                                  content_type=b"multipart/form-data; boundary=" + boundary,
                                  tail=b"\r\n--" + boundary + b"--\r\n")
    status, error = _status_and_error(received)
    assert status == 413 and sent < 1024
    assert "over the proxy's limit of 262144 bytes per file" in error["message"]
    assert _bytes_read(error["message"]) <= 4 * CHUNK + 64 * 1024 + ONE_READ


def test_deeply_nested_json_is_a_400_in_the_openai_shape():
    async def main():
        async with proxy_client(ok) as c:
            return await c.post("/v1/chat/completions", content=b"[" * 100_000 + b"]" * 100_000,
                                headers={"content-type": "application/json"})

    resp = run(main())
    assert resp.status_code == 400 and resp.headers["content-type"] == "application/json"
    assert "nested too deeply" in resp.json()["error"]["message"]


def test_unexpected_exception_is_a_500_in_the_openai_shape_with_the_request_id(caplog):
    async def boom():
        raise RuntimeError("a bug")

    async def main():
        app = create_app(Settings(backends=("http://127.0.0.1:9",), encoder="none"))
        app.add_api_route("/boom", boom)  # a route with a bug: nothing handles its exception
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as c:
                return await c.get("/boom", headers={"x-request-id": "trace-42"})
        finally:
            await app.state.proxy.close()

    with caplog.at_level(logging.ERROR, logger="moe_cohort.proxy.http.middleware"):
        resp = run(main())
    assert resp.status_code == 500 and resp.headers["x-request-id"] == "trace-42"
    error = resp.json()["error"]
    assert error["type"] == "internal_error" and "request id trace-42" in error["message"]
    assert any(r.exc_info and "trace-42" in r.getMessage() for r in caplog.records)  # logged with its traceback


def test_request_id_is_accepted_or_made_echoed_and_forwarded():
    seen = []

    async def backend(request):
        seen.append(request.headers.get("x-request-id"))
        return answer(OK_BODY)

    async def main():
        async with proxy_client(backend) as c:
            given = await c.post("/v1/chat/completions", json=CHAT, headers={"x-request-id": "client-7.a:b"})
            made = await c.post("/v1/chat/completions", json=CHAT)
            insane = await c.post("/v1/chat/completions", json=CHAT, headers={"x-request-id": "x" * 300})
            errors = [await c.post("/v1/chat/completions", content=b"{oops", headers={"x-request-id": "bad-json"}),
                      await c.get("/v1/nothing", headers={"x-request-id": "no-route"})]
        return given, made, insane, errors

    given, made, insane, errors = run(main())
    assert given.headers["x-request-id"] == "client-7.a:b"
    assert made.headers["x-request-id"].startswith("req-") and insane.headers["x-request-id"].startswith("req-")
    assert seen == ["client-7.a:b", made.headers["x-request-id"], insane.headers["x-request-id"]]
    assert [(e.status_code, e.headers["x-request-id"]) for e in errors] == [(400, "bad-json"), (404, "no-route")]


def test_one_access_log_line_per_request_without_the_prompt(caplog):
    async def main():
        async with proxy_client(ok) as c:
            await c.post("/v1/chat/completions", json=CHAT, headers={"x-request-id": "r1"})
            await c.post("/v1/chat/completions", content=b"{oops", headers={"x-request-id": "r2"})

    with caplog.at_level(logging.INFO, logger="moe_cohort.proxy.access"):
        run(main())
    lines = [r.getMessage() for r in caplog.records if r.name == "moe_cohort.proxy.access"]
    assert len(lines) == 2
    assert re.fullmatch(r"POST /v1/chat/completions 200 [0-9.]+ms r1", lines[0])
    assert re.fullmatch(r"POST /v1/chat/completions 400 [0-9.]+ms r2", lines[1])
    assert not any("hello" in line for line in lines)  # CHAT's prompt


def test_a_client_that_leaves_while_sending_its_body_is_a_499_not_an_error(proxy, caplog):
    with caplog.at_level(logging.INFO):
        with socket.create_connection(("127.0.0.1", int(proxy.url.rsplit(":", 1)[1])), timeout=30) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\nx-request-id: gone-1\r\n\r\n{\"model\": ")  # then hangs up
        deadline = time.monotonic() + 30
        while not any(r.name == "moe_cohort.proxy.access" for r in caplog.records):
            assert time.monotonic() < deadline, "no access line"
            time.sleep(0.05)
    assert [r.getMessage().split()[2::2] for r in caplog.records if r.name == "moe_cohort.proxy.access"] == [["499", "gone-1"]]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
