"""The proxy's limits on what a client sends, under uvicorn as `cohort serve` runs it (raw sockets): request
heads over the size and count limits, heads sent too slowly, idle connections, and the settings behind them."""

from __future__ import annotations

import json
import select
import socket
import threading
import time

import pytest
import uvicorn

from moe_cohort.embedded.vllm_server import free_port
from moe_cohort.proxy.app import create_app
from moe_cohort.proxy.http.limits import HeadLimits, h11_protocol, server_options
from moe_cohort.send.settings import Settings
from tests.helpers.proxy_thread import ProxyThread


def exchange(port: int, chunks, timeout: float = 30.0) -> tuple[bytes, int]:
    """Send `chunks` (an iterable of bytes) until the server answers or closes; then read the answer to its
    end (the server closes, or the body is as long as content-length). (answer's bytes, bytes sent)."""
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        for chunk in chunks:
            if select.select([sock], [], [], 0)[0]:
                break
            try:
                sock.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += len(chunk)
        received = b""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                data = sock.recv(65536)
            except ConnectionResetError:
                break
            if not data:
                break
            received += data
            head, sep, body = received.partition(b"\r\n\r\n")
            length = [int(line.split(b":")[1]) for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:")]
            if sep and length and len(body) >= length[0]:
                break
    return received, sent


def answer_of(received: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = received.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


def request_head(path: str = "/v1/models", headers: list[tuple[str, str]] = (), method: str = "GET") -> bytes:
    return (f"{method} {path} HTTP/1.1\r\nHost: proxy\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers)).encode()


def assert_431(received: bytes, words: str) -> None:
    status, headers, body = answer_of(received)
    assert status == 431, received[:300]
    assert headers["content-type"] == "application/json" and headers["connection"] == "close"
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "request_header_fields_too_large"
    assert words in error["message"]


@pytest.fixture
def keyed_proxy(tmp_path):
    """The proxy under uvicorn with its default head limits and a key: a head that passes gets a 401."""
    settings = Settings(backends=("http://127.0.0.1:9",), port=free_port(), encoder="none", data_dir=str(tmp_path),
                        api_keys=("sekrit",))
    with ProxyThread(settings) as p:
        yield int(p.url.rsplit(":", 1)[1])


def test_defaults_are_64_kib_and_100_headers():
    assert (Settings().max_header_bytes, Settings().max_headers) == (64 * 1024, 100)


def test_the_issues_probe_8192_headers_of_8_kb_is_refused_while_it_is_sent(keyed_proxy):
    """8,192 headers of 8 KB (67 MB): 431 in the OpenAI shape after at most the limit and one socket read."""
    header = b"x-pad: " + b"a" * 8192 + b"\r\n"
    chunks = [request_head()] + [header * 8 for _ in range(1024)]
    received, sent = exchange(keyed_proxy, chunks)
    assert_431(received, "over the proxy's limit of 65536 bytes")
    assert sent < 16 << 20  # far from 67 MB (the sockets' kernel buffers take a few MB): answered while sending


def test_more_than_100_small_headers_is_a_431(keyed_proxy):
    received, _ = exchange(keyed_proxy, [request_head(headers=[(f"x-h{i}", "1") for i in range(101)]) + b"\r\n"])
    assert_431(received, "over 100 headers")


def test_one_endless_header_is_refused_before_it_ends(keyed_proxy):
    """httptools keeps a header to itself until its line ends: the bytes of an unfinished head count too."""
    chunks = [request_head() + b"x-pad: "] + [b"a" * 65536 for _ in range(256)]  # 16 MB, never a CRLF
    received, sent = exchange(keyed_proxy, chunks)
    assert_431(received, "over the proxy's limit of 65536 bytes")
    assert sent < 16 << 20


def test_a_long_target_counts_too(keyed_proxy):
    received, _ = exchange(keyed_proxy, [request_head(path="/v1/models?q=" + "a" * 70_000) + b"\r\n"])
    assert_431(received, "65536 bytes")


def test_heads_within_the_limits_pass_and_bodies_do_not_count(keyed_proxy):
    """100 headers of 600 bytes (62 KB) reach the app (401: no key); a 1 MB body after a small head, in
    the same write, and two such requests pipelined, are no 431."""
    head = request_head(headers=[(f"x-h{i}", "v" * 600) for i in range(99)]) + b"\r\n"  # 99 + Host = 100
    assert answer_of(exchange(keyed_proxy, [head])[0])[0] == 401
    body = json.dumps({"model": "m", "prompt": "x" * (1 << 20)}).encode()
    post = request_head("/v1/completions", [("content-type", "application/json"), ("content-length", str(len(body))),
                                            ("authorization", "Bearer sekrit")], method="POST") + b"\r\n" + body
    status, _, _ = answer_of(exchange(keyed_proxy, [post])[0])
    assert status == 502  # read whole and sent on: the backend (port 9) is down
    with socket.create_connection(("127.0.0.1", keyed_proxy), timeout=30) as sock:
        sock.sendall(post + post)
        sock.settimeout(30)
        received = b""
        while received.count(b"HTTP/1.1 ") < 2 or not received.endswith(b"}"):
            data = sock.recv(65536)
            assert data, received
            received += data
    assert [int(part.split(b" ", 1)[0]) for part in received.split(b"HTTP/1.1 ")[1:]] == [502, 502]


def test_the_limits_are_settings(tmp_path):
    settings = Settings(backends=("http://127.0.0.1:9",), port=free_port(), encoder="none", data_dir=str(tmp_path),
                        max_headers=5, max_header_bytes=2048)
    with ProxyThread(settings) as p:
        port = int(p.url.rsplit(":", 1)[1])
        assert_431(exchange(port, [request_head(headers=[(f"x-{i}", "1") for i in range(5)]) + b"\r\n"])[0],
                   "over 5 headers")
        assert_431(exchange(port, [request_head(headers=[("x-pad", "a" * 2100)]) + b"\r\n"])[0], "2048 bytes")
        assert answer_of(exchange(port, [request_head("/metrics", [("x-pad", "a" * 1900)]) + b"\r\n"])[0])[0] == 200


@pytest.mark.parametrize("env, message", [({"COHORT_MAX_HEADERS": "0"}, "COHORT_MAX_HEADERS"),
                                          ({"COHORT_MAX_HEADER_BYTES": "-1"}, "COHORT_MAX_HEADER_BYTES")])
def test_bad_limits_are_refused(env, message):
    from moe_cohort.send.setting_sources import load_settings
    from moe_cohort.send.settings import SettingsError

    with pytest.raises(SettingsError, match=message):
        load_settings(environ=env)


def test_under_h11_a_head_is_refused_by_the_protocol_or_by_the_app(tmp_path):
    """Where httptools is missing (uvicorn's h11): an unfinished head over the limit is a 431 from the
    protocol; a complete one that h11 took in one piece, a 431 from the app's middleware (with a request id)."""
    settings = Settings(backends=("http://127.0.0.1:9",), port=free_port(), encoder="none", data_dir=str(tmp_path))
    config = uvicorn.Config(create_app(settings), host="127.0.0.1", port=settings.port, log_level="warning",
                            http=h11_protocol(HeadLimits(settings.max_header_bytes, settings.max_headers)),
                            h11_max_incomplete_event_size=settings.max_header_bytes)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.05)
        chunks = [request_head() + b"x-pad: "] + [b"a" * 65536 for _ in range(64)]
        assert_431(exchange(settings.port, chunks)[0], "65536 bytes")
        many = request_head(headers=[(f"x-h{i}", "1") for i in range(150)] + [("x-request-id", "many-1")]) + b"\r\n"
        received, _ = exchange(settings.port, [many])
        assert_431(received, "over 100 headers")
        assert answer_of(received)[1]["x-request-id"] == "many-1"
    finally:
        server.should_exit = True
        thread.join(10)


def _timed_proxy(tmp_path, backend_url: str = "http://127.0.0.1:9") -> ProxyThread:
    """The proxy under uvicorn with a short head timeout (0.5 s)."""
    return ProxyThread(Settings(backends=(backend_url,), port=free_port(), encoder="none", data_dir=str(tmp_path),
                                head_timeout_s=0.5))


def _port(proxy: ProxyThread) -> int:
    return int(proxy.url.rsplit(":", 1)[1])


def _until_closed(sock: socket.socket, wait_s: float = 20.0) -> bytes:
    """Everything the server sends until it closes; socket.timeout if it holds the connection open longer."""
    sock.settimeout(wait_s)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_a_connection_that_sends_nothing_is_closed_after_the_head_timeout(tmp_path):
    """Idle connections used to stay open for ever (a thousand of them, in a probe): each costs a socket."""
    with _timed_proxy(tmp_path) as proxy, socket.create_connection(("127.0.0.1", _port(proxy))) as sock:
        assert _until_closed(sock) == b""  # closed without a word: nothing was asked


def test_a_head_sent_too_slowly_gets_a_408_and_the_connection_ends(tmp_path):
    """Slowloris: a head trickling in holds the connection no longer than the head timeout."""
    with _timed_proxy(tmp_path) as proxy, socket.create_connection(("127.0.0.1", _port(proxy))) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: pro")  # part of a head, then nothing more
        status, headers, body = answer_of(_until_closed(sock))
    assert status == 408 and headers["connection"] == "close"
    error = json.loads(body)["error"]
    assert error["code"] == "request_timeout" and "head_timeout_s" in error["message"]


def test_the_head_timeout_neither_cuts_a_slow_answer_nor_a_second_request(tmp_path):
    """The clock runs only while a head is awaited: an answer slower than it arrives whole, and the connection
    then takes another request (kept alive)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Slow(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):
            self.rfile.read(int(self.headers["content-length"]))
            time.sleep(0.8)  # longer than the head timeout (0.5 s)
            body = json.dumps({"id": "c", "object": "chat.completion", "model": "m", "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "late"}, "finish_reason": "stop"}]}).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    backend = ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    threading.Thread(target=backend.serve_forever, daemon=True).start()
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    chat = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % len(body)) + body
    try:
        with _timed_proxy(tmp_path, f"http://127.0.0.1:{backend.server_address[1]}") as proxy, \
                socket.create_connection(("127.0.0.1", _port(proxy)), timeout=20) as sock:
            answers = []
            for _ in range(2):
                sock.sendall(chat)
                received = b""
                while b"late" not in received:
                    chunk = sock.recv(65536)
                    assert chunk, f"the proxy closed the connection after {received[:80]!r}"
                    received += chunk
                answers.append(answer_of(received)[0])
    finally:
        backend.shutdown()
        backend.server_close()
    assert answers == [200, 200]


HTTPX_POOL_EXPIRY_S = 5.0  # httpx (and the openai client) drop a pooled connection idle this long


def test_an_idle_kept_alive_connection_is_kept_for_the_head_timeout_longer_than_clients_keep_theirs(tmp_path):
    """A connection the server closes as a request goes out on it is a ReadError (a POST is not retried): the
    proxy keeps an idle connection for its head timeout, by default longer than clients keep theirs, so the
    client always closes first."""
    assert server_options(Settings())["timeout_keep_alive"] == Settings().head_timeout_s > HTTPX_POOL_EXPIRY_S
    with _timed_proxy(tmp_path) as proxy, socket.create_connection(("127.0.0.1", _port(proxy)), timeout=20) as sock:
        for _ in range(2):
            sock.sendall(b"GET /v1/cohort-unknown HTTP/1.1\r\nHost: proxy\r\n\r\n")
            received = b""
            while b"\r\n\r\n" not in received or not received.rstrip().endswith(b"}"):
                chunk = sock.recv(65536)
                assert chunk, "the proxy closed the idle connection before its head timeout"
                received += chunk
            assert received.startswith(b"HTTP/1.1 404")
            time.sleep(0.3)  # idle, within the head timeout (0.5 s)
        assert _until_closed(sock) == b""  # then closed by the server once idle past it
