"""Issue 27's hostile client and new operator: request heads over the limits (raw sockets against the proxy
under uvicorn, as `cohort serve` runs it), keys that are present but empty, the API docs routes, batch
output lines with Unicode line separators, and engine hints (vllm_xargs) forged by a client."""

from __future__ import annotations

import json
import select
import socket
import threading
import time

import pytest
import uvicorn

from moe_cohort.proxy.app import create_app
from moe_cohort.proxy.http.limits import HeadLimits, h11_protocol
from moe_cohort.proxy.settings import Settings
from moe_cohort.proxy.vllm_server import free_port
from tests.proxy.servers import ProxyThread

# --- item 2: request heads ------------------------------------------------------------------------


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
    settings = Settings(backend_url="http://127.0.0.1:9", port=free_port(), encoder="none", data_dir=str(tmp_path),
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
    settings = Settings(backend_url="http://127.0.0.1:9", port=free_port(), encoder="none", data_dir=str(tmp_path),
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
    from moe_cohort.proxy.setting_sources import load_settings
    from moe_cohort.proxy.settings import SettingsError

    with pytest.raises(SettingsError, match=message):
        load_settings(environ=env)


def test_under_h11_a_head_is_refused_by_the_protocol_or_by_the_app(tmp_path):
    """Where httptools is missing (uvicorn's h11): an unfinished head over the limit is a 431 from the
    protocol; a complete one that h11 took in one piece, a 431 from the app's middleware (with a request id)."""
    settings = Settings(backend_url="http://127.0.0.1:9", port=free_port(), encoder="none", data_dir=str(tmp_path))
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


# --- item 6: the API docs routes ------------------------------------------------------------------

DOCS_ROUTES = ["/openapi.json", "/docs", "/redoc", "/docs/oauth2-redirect"]


def _docs_proxy(tmp_path, **settings):
    return ProxyThread(Settings(backend_url="http://127.0.0.1:9", port=free_port(), encoder="none",
                                data_dir=str(tmp_path), **settings))


def test_api_docs_are_off_by_default_even_with_a_key(tmp_path):
    import httpx

    for keys in ((), ("sekrit",)):
        with _docs_proxy(tmp_path, api_keys=keys) as p:
            for path in DOCS_ROUTES:
                resp = httpx.get(p.url + path, headers={"authorization": "Bearer sekrit"} if keys else {})
                assert resp.status_code == 404, (keys, path, resp.text)
                assert resp.json()["error"]["type"] == "invalid_request_error"


def test_api_docs_turned_on_are_behind_the_key(tmp_path):
    import httpx

    with _docs_proxy(tmp_path, api_keys=("sekrit",), api_docs=True) as p:
        for path in DOCS_ROUTES[:3]:
            refused = httpx.get(p.url + path)
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key", path
            assert httpx.get(p.url + path, headers={"authorization": "Bearer wrong"}).status_code == 401
            assert httpx.get(p.url + path, headers={"authorization": "Bearer sekrit"}).status_code == 200, path
        schema = httpx.get(p.url + "/openapi.json", headers={"authorization": "Bearer sekrit"}).json()
        assert "/v1/chat/completions" in schema["paths"] and "/openapi.json" not in schema["paths"]
    with _docs_proxy(tmp_path, api_docs=True) as p:  # an open proxy: open docs
        assert httpx.get(p.url + "/docs").status_code == 200


def test_api_docs_setting_and_flag():
    from moe_cohort.proxy.setting_sources import load_settings

    assert load_settings(environ={"COHORT_API_DOCS": "true"}).api_docs is True
    assert load_settings(environ={}).api_docs is False
    import argparse

    from moe_cohort.cli import serve as cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert parser.parse_args(["--api-docs"]).api_docs is True and parser.parse_args([]).api_docs is None


# --- item 7: batch output lines with Unicode line separators ---------------------------------------

SEPARATORS = "one\u0085two\u2028three\u2029four"  # JSON allows them raw; str.splitlines() breaks at each


class _EchoBackend:
    """A stdlib HTTP server in a thread: every POST answers a chat completion with SEPARATORS in its text; one
    with max_tokens 1, a 400 with SEPARATORS in its message. `bodies`: what it was sent."""

    def __init__(self) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                sent = json.loads(self.rfile.read(int(self.headers["content-length"])))
                bodies.append((self.path, sent))
                refused = sent.get("max_tokens") == 1
                body = json.dumps({"error": {"message": SEPARATORS, "type": "invalid_request_error"}} if refused else
                                  {"id": "c1", "object": "chat.completion", "model": "m", "choices": [
                                      {"index": 0, "message": {"role": "assistant", "content": SEPARATORS},
                                       "finish_reason": "stop"}]}, ensure_ascii=False).encode()
                self.send_response(400 if refused else 200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.bodies = bodies = []  # (path, body) of every POST, as the proxy forwarded it
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self):
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def test_batch_output_lines_escape_unicode_line_separators(tmp_path):
    """A Batch API run whose answers and custom_ids hold U+0085, U+2028, U+2029: the output and error files
    split into exactly one line per record with str.splitlines(), and each line reads back the same text."""
    import openai

    lines = [json.dumps({"custom_id": f"ok\u2028{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}, ensure_ascii=False)
             for i in range(3)]
    lines.append(json.dumps({"custom_id": "bad\u0085id", "method": "POST", "url": "/v1/chat/completions",
                             "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}},
                            ensure_ascii=False))
    with _EchoBackend() as backend, ProxyThread(Settings(backend_url=backend.url, port=free_port(), encoder="none",
                                                         data_dir=str(tmp_path))) as proxy:
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0)
        upload = client.files.create(file=("in.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch")
        batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
        deadline = time.monotonic() + 60
        while batch.status not in ("completed", "failed", "cancelled"):
            assert time.monotonic() < deadline, batch.status
            time.sleep(0.1)
            batch = client.batches.retrieve(batch.id)
        assert batch.status == "completed", batch.errors
        output = client.files.content(batch.output_file_id).text
        errors = client.files.content(batch.error_file_id).text
    assert len(output.splitlines()) == 3 and len(errors.splitlines()) == 1, output + errors
    records = [json.loads(line) for line in output.splitlines()]
    assert sorted(r["custom_id"] for r in records) == [f"ok\u2028{i}" for i in range(3)]
    assert all(r["response"]["body"]["choices"][0]["message"]["content"] == SEPARATORS for r in records)
    error = json.loads(errors.splitlines()[0])
    assert error["custom_id"] == "bad\u0085id" and error["response"]["body"]["error"]["message"] == SEPARATORS
    assert "\\u2028" in output and "\\u0085" in errors  # escaped, not dropped


# --- item 4: engine hints forged by a client ---------------------------------------------------------

FORGED = {"moe_profile": [1, 2, 3, 4, 5, 6, 7, 8], "moe_record": True, "moe_routing": "OEA; k0=1", "temperature_x": 3}


def _hints_proxy(backend, tmp_path, **settings):
    return ProxyThread(Settings(backend_url=backend.url, port=free_port(), encoder="none", data_dir=str(tmp_path),
                                **settings))


def _send_forged(proxy) -> list:
    """A chat completion (official client), a completion and a response (httpx), each with FORGED xargs."""
    import httpx
    import openai

    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0)
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                   extra_body={"vllm_xargs": dict(FORGED)})
    answers = [httpx.post(proxy.url + "/v1/completions", json={"model": "m", "prompt": "hi", "vllm_xargs": FORGED}),
               httpx.post(proxy.url + "/v1/responses", json={"model": "m", "input": "hi", "vllm_xargs": FORGED})]
    return answers


def test_the_proxy_drops_the_engine_hints_it_owns_from_clients(tmp_path):
    """The issue's probe: vllm_xargs {"moe_profile": [...], "moe_record": true} reached vLLM as sent. Now the
    backend sees neither, on every route that generates; the routing policy and other keys stay."""
    with _EchoBackend() as backend, _hints_proxy(backend, tmp_path) as proxy:
        assert [a.status_code for a in _send_forged(proxy)] == [200, 200]
    assert [path for path, _ in backend.bodies] == ["/v1/chat/completions", "/v1/completions", "/v1/responses"]
    for _, body in backend.bodies:
        assert body["vllm_xargs"] == {"moe_routing": "oea;k0=1", "temperature_x": 3}


def test_trusted_callers_may_pass_the_engine_hints(tmp_path):
    with _EchoBackend() as backend, _hints_proxy(backend, tmp_path, trust_client_hints=True) as proxy:
        _send_forged(proxy)
    for _, body in backend.bodies:
        assert body["vllm_xargs"] == {**FORGED, "moe_routing": "oea;k0=1"}


def test_the_operator_limits_the_routing_policies_clients_may_ask_for(tmp_path):
    import httpx
    import openai

    with _EchoBackend() as backend, _hints_proxy(backend, tmp_path, allowed_policies=("OEA", "xshare;m=8"),
                                                 default_policy="topk") as proxy:
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0)

        def chat(**kw):
            return client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], **kw)

        chat(extra_headers={"x-moe-routing": "oea;k0=2;max_p=4"})  # a listed name: any parameters
        chat(extra_body={"vllm_xargs": {"moe_routing": "xshare; m=8"}})  # a listed policy, written otherwise
        chat(extra_body={"vllm_xargs": {"moe_routing": "topk"}})  # the server's default: always allowed
        chat()
        for kw, source in [({"extra_headers": {"x-moe-routing": "xshare;m=16"}}, "X-MoE-Routing"),
                           ({"extra_body": {"vllm_xargs": {"moe_routing": "lynx-lat;drop=2"}}}, "vllm_xargs.moe_routing")]:
            with pytest.raises(openai.BadRequestError) as refused:
                chat(**kw)
            error = refused.value.response.json()["error"]
            assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "policy_not_allowed",
                                                                     source)
            assert "allowed: oea, xshare;m=8;k0=1 " in error["message"] and "'topk'" in error["message"]
        response = httpx.post(proxy.url + "/v1/responses", json={"model": "m", "input": "hi"},
                              headers={"x-moe-routing": "xshare;m=16"})
        assert response.status_code == 400 and response.json()["error"]["code"] == "policy_not_allowed"
    assert [b["vllm_xargs"]["moe_routing"] for _, b in backend.bodies] == ["oea;k0=2;max_p=4", "xshare;m=8;k0=1", "topk",
                                                                           "topk"]


def test_batch_lines_follow_the_same_rules(tmp_path):
    """A Batch API batch: forged hints dropped from the lines sent; a policy off the list fails validation."""
    import openai

    def line(cid, xargs):
        return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                           "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "vllm_xargs": xargs}})

    with _EchoBackend() as backend, _hints_proxy(backend, tmp_path, allowed_policies=("oea",)) as proxy:
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0)

        def run(lines):
            upload = client.files.create(file=("in.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch")
            batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                          completion_window="24h")
            deadline = time.monotonic() + 60
            while batch.status not in ("completed", "failed", "cancelled"):
                assert time.monotonic() < deadline, batch.status
                time.sleep(0.1)
                batch = client.batches.retrieve(batch.id)
            return batch

        assert run([line("a", FORGED)]).status == "completed"
        failed = run([line("b", {"moe_routing": "xshare;m=8"})])
    assert [b["vllm_xargs"] for _, b in backend.bodies] == [{"moe_routing": "oea;k0=1", "temperature_x": 3}]
    assert failed.status == "failed" and failed.errors.data[0].line == 1
    assert "is not allowed on this proxy; allowed: oea" in failed.errors.data[0].message


@pytest.mark.parametrize("env, expected", [({"COHORT_ALLOWED_POLICIES": "topk, OEA,xshare; m=8"},
                                            ("topk", "oea", "xshare;m=8;k0=1")), ({}, ())])
def test_allowed_policies_setting(env, expected):
    from moe_cohort.proxy.setting_sources import load_settings

    assert load_settings(environ=env).allowed_policies == expected
    assert load_settings(environ={"COHORT_TRUST_CLIENT_HINTS": "1"}).trust_client_hints is True


def test_allowed_policies_from_the_command_line():
    """`cohort serve --allowed-policy oea --allowed-policy 'xshare;m=8'`, parsed as cohort serve parses it."""
    import argparse

    from moe_cohort.cli import serve as cli
    from moe_cohort.cli.setting_flags import flag_overrides
    from moe_cohort.proxy.setting_sources import load_settings

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--allowed-policy", "oea", "--allowed-policy", "xshare;m=8", "--backend", "http://a",
                              "--backend", "http://b"])
    settings = load_settings(flag_overrides(args, cli._FLAGS), environ={})
    assert settings.allowed_policies == ("oea", "xshare;m=8;k0=1")
    assert settings.backend_urls == ("http://a", "http://b")


def test_a_bad_allowed_policy_names_the_setting():
    from moe_cohort.proxy.setting_sources import load_settings
    from moe_cohort.proxy.settings import SettingsError

    with pytest.raises(SettingsError, match=r"allowed_policies \(env COHORT_ALLOWED_POLICIES\) must be policy names"):
        load_settings(environ={"COHORT_ALLOWED_POLICIES": "topk,bogus"})


# --- beyond the list: slow and idle clients ----------------------------------------------------------


def _timed_proxy(tmp_path, backend_url: str = "http://127.0.0.1:9") -> ProxyThread:
    """The proxy under uvicorn with a short head timeout (0.5 s)."""
    return ProxyThread(Settings(backend_url=backend_url, port=free_port(), encoder="none", data_dir=str(tmp_path),
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
    assert error["code"] == "request_timeout" and "--head-timeout-s" in error["message"]


def test_the_head_timeout_neither_cuts_a_slow_answer_nor_a_second_request(tmp_path):
    """The clock runs only while a head is awaited: an answer slower than it arrives whole, and the connection
    then takes another request (kept alive)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Slow(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):
            self.rfile.read(int(self.headers["content-length"]))
            time.sleep(1.5)  # three head timeouts
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


def test_an_idle_kept_alive_connection_outlives_the_clients_pool_expiry(tmp_path):
    """httpx (and the openai client) drop a pooled connection after 5 s idle; uvicorn's own keep-alive closed it at
    5 s too, so a request sent on it as the server closed it was a ReadError (a POST is not retried). The proxy
    keeps it for its head timeout (10 s by default): the client always closes first."""
    with ProxyThread(Settings(backend_url="http://127.0.0.1:9", port=free_port(), encoder="none",
                              data_dir=str(tmp_path))) as proxy, \
            socket.create_connection(("127.0.0.1", _port(proxy)), timeout=20) as sock:
        for _ in range(2):
            sock.sendall(b"GET /v1/cohort-unknown HTTP/1.1\r\nHost: proxy\r\n\r\n")
            received = b""
            while b"\r\n\r\n" not in received or not received.rstrip().endswith(b"}"):
                chunk = sock.recv(65536)
                assert chunk, "the proxy closed the idle connection before its head timeout"
                received += chunk
            assert received.startswith(b"HTTP/1.1 404")
            time.sleep(6)  # past uvicorn's default keep-alive (5 s), within the head timeout (10 s)
