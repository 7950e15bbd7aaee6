"""A client that leaves takes its request with it: whether it waits in the proxy's queue, is being predicted, or is
generating, streamed or not, on every generating route, its request is gone from the engine within GRACE_S, and
one that had not reached the engine never does.

The engine is a stand-in (`StandInEngine`): a local HTTP server in its own thread that generates a token per
request every TOKEN_S, streamed or whole, and stops a request as soon as its connection closes, as vLLM aborts a
request whose client disconnected. The clients are raw sockets that send a request and close."""

import asyncio
import contextlib
import json
import socket
import threading
import time
import uuid

import pytest

import numpy as np
from aiohttp import web

import moe_cohort.proxy.app
from moe_cohort.admission.resident import ResidentExperts
from moe_cohort.admission.wire import Prediction
from moe_cohort.embedded.vllm_server import free_port
from moe_cohort.proxy.app import create_app
from moe_cohort.send.profiles import Predictor
from moe_cohort.send.settings import Settings
from tests.helpers.proxy_thread import ProxyThread
from tests.helpers.vllm_stub import BackendThread, answer

TOKEN_S = 0.01  # the stand-in's time per token
MAX_TOKENS = 1000  # more than any client here waits for
LEAVE_S, GRACE_S = 0.3, 0.5  # the clients leave this long after sending; their requests are gone this long after
SLOTS, QUEUED = 4, 8  # per route and mode: requests generating, and waiting in the proxy, when their clients leave
ROUTES = {"chat": "/v1/chat/completions", "completion": "/v1/completions", "responses": "/v1/responses"}
CASES = [(route, stream) for route in ROUTES for stream in (False, True)]


def body(route: str, name: str, stream: bool) -> dict:
    if route == "chat":
        return {"model": "m", "messages": [{"role": "user", "content": name}], "max_tokens": MAX_TOKENS,
                "stream": stream}
    if route == "completion":
        return {"model": "m", "prompt": name, "max_tokens": MAX_TOKENS, "stream": stream}
    return {"model": "m", "input": name, "max_output_tokens": MAX_TOKENS, "stream": stream}


def name_of(sent: dict) -> str:
    return sent["messages"][0]["content"] if "messages" in sent else sent.get("prompt", sent.get("input"))


class StandInEngine:
    """An aiohttp handler generating each POST's tokens one every TOKEN_S (SSE events when streamed, one JSON answer
    at the end otherwise) until MAX_TOKENS or its connection closes. `arrived`: the requests' names as they
    arrived; `tokens`: (name, when) of every token generated. GETs (the proxy's handshake) are answered `info`
    on the handshake's route, else 404."""

    def __init__(self, info: dict | None = None) -> None:
        self.info = info  # the handshake's answer (GET /v1/cohort/info), None: a 404 as from a vLLM without plugin
        self.arrived: list[str] = []
        self.tokens: list[tuple[str, float]] = []
        self.stopped = False  # True: every request ends (the test is over)

    async def __call__(self, request: web.BaseRequest) -> web.StreamResponse:
        if request.method != "POST":
            if request.path == "/v1/cohort/info" and self.info is not None:
                return answer(self.info)
            return answer({"detail": "Not Found"}, status=404)
        sent = json.loads(await request.read())
        name = name_of(sent)
        self.arrived.append(name)
        stream = web.StreamResponse(headers={"content-type": "text/event-stream"}) if sent.get("stream") else None
        if stream is not None:
            await stream.prepare(request)
        for _ in range(MAX_TOKENS):
            await asyncio.sleep(TOKEN_S)
            if request.transport is None or request.transport.is_closing() or self.stopped:  # aborted
                return stream or web.Response()
            self.tokens.append((name, time.monotonic()))
            if stream is not None:
                await stream.write(b'data: {"choices": [{"index": 0, "text": "t"}]}\n\n')
        return stream or answer({"choices": [{"index": 0, "text": "t" * MAX_TOKENS}]})

    def count(self, prefix: str, after: float = 0.0) -> tuple[int, int]:
        """(requests arrived, tokens generated after `after`) of the requests named `prefix`*."""
        return (sum(n.startswith(prefix) for n in self.arrived),
                sum(n.startswith(prefix) and t > after for n, t in self.tokens))


async def send(port: int, path: str, sent: dict) -> asyncio.StreamWriter:
    """A client that sent its request and reads nothing; closing the writer is the client leaving."""
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    data = json.dumps(sent).encode()
    writer.write(b"POST %s HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                 % (path.encode(), len(data), data))
    await writer.drain()
    return writer


def gauge(app, name: str) -> float:
    return app.state.proxy.metrics.registry.get_sample_value(name)


async def until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def leave_and_watch(app, engine: StandInEngine, writers: list, sent_at: float) -> tuple[float, float]:
    """Close every client LEAVE_S after `sent_at`, the last sent first, so that the queued ones have left before a
    slot frees (a queued request whose slot frees before the proxy sees its client leave is sent, and closed at
    once), and watch the engine GRACE_S past GRACE_S; then stop it. Returns when the clients left, and the requests
    the proxy still holds (waiting or in flight) a moment after."""
    await asyncio.sleep(max(0.0, sent_at + LEAVE_S - time.monotonic()))
    left = time.monotonic()
    for writer in reversed(writers):
        writer.close()
    await asyncio.sleep(2 * GRACE_S)
    with contextlib.suppress(AssertionError):
        await until(lambda: gauge(app, "cohort_waiting") == 0 and gauge(app, "cohort_in_flight") == 0, 1.0)
    held = gauge(app, "cohort_waiting") + gauge(app, "cohort_in_flight")
    engine.stopped = True
    return left, held


def test_clients_that_leave_while_queued_or_generating_take_their_requests_with_them():
    """SLOTS requests of each route and mode generate and QUEUED more wait in the proxy when all their clients leave:
    fewer than one token per request is generated past GRACE_S, and none of the queued ones reaches the engine."""
    engine = StandInEngine()

    async def main():
        with BackendThread(engine) as backend:
            settings = Settings(backends=(backend.url,), port=free_port(), encoder="none",
                                max_in_flight=SLOTS * len(CASES))
            app = create_app(settings)
            with ProxyThread(settings, app):
                sent_at = time.monotonic()
                writers = [await send(settings.port, ROUTES[r], body(r, f"{r}-{s}-{i}", s))
                           for i in range(SLOTS) for r, s in CASES]  # every case's first SLOTS take the slots
                await until(lambda: len(engine.arrived) == SLOTS * len(CASES))
                writers += [await send(settings.port, ROUTES[r], body(r, f"{r}-{s}-{i}", s))
                            for i in range(SLOTS, SLOTS + QUEUED) for r, s in CASES]
                await until(lambda: gauge(app, "cohort_waiting") == QUEUED * len(CASES))
                left, held = await leave_and_watch(app, engine, writers, sent_at)
        return {(r, s): engine.count(f"{r}-{s}-", after=left + GRACE_S) for r, s in CASES}, held

    seen, held = asyncio.run(main())
    assert seen == {case: (SLOTS, seen[case][1]) for case in CASES}  # no queued request reached the engine
    assert all(late < SLOTS + QUEUED for _, late in seen.values()), seen  # (arrived, tokens past GRACE_S)
    assert held == 0


def test_clients_that_leave_while_their_requests_are_predicted_never_reach_the_engine(monkeypatch):
    """Every request waits for its prediction (forwarded profiles, a long deadline), and the predictor answers only
    after the clients left: none of them is sent."""
    engine, release, asked = StandInEngine(), threading.Event(), []

    def slow(texts):
        asked.append(len(texts))
        release.wait(10)
        return [Prediction(np.ones(4), [0]) for _ in texts]

    predictor = Predictor(slow, lambda size: ResidentExperts(1, size), "profile")
    monkeypatch.setattr(moe_cohort.proxy.app, "make_predictor", lambda settings, threads=None: predictor)

    async def main():
        with BackendThread(engine) as backend:
            settings = Settings(backends=(backend.url,), port=free_port(), encoder="none", max_in_flight=SLOTS,
                                forward_profiles=True, profile_deadline_ms=10_000)
            app = create_app(settings)
            with ProxyThread(settings, app):
                sent_at = time.monotonic()
                writers = [await send(settings.port, ROUTES[r], body(r, f"{r}-{s}-{i}", s))
                           for i in range(2) for r, s in CASES]
                await until(lambda: gauge(app, "cohort_waiting") == len(writers) and asked)
                threading.Timer(LEAVE_S + 0.1, release.set).start()  # the predictions land after the clients left
                _, held = await leave_and_watch(app, engine, writers, sent_at)
        return engine.arrived, held

    try:
        assert asyncio.run(main()) == ([], 0)
    finally:
        release.set()


ENGINE_ADMITS = {"object": "cohort.engine_info", "schema": 1, "plugin_version": "0.1.0", "vllm_version": "0.32.0",
                 "model": "m", "moe": {"layers": 2, "experts": 8, "top_k": 2}, "max_num_seqs": 1,
                 "scheduler": {"expert_aware": True, "class": "x", "base": "Scheduler", "prefill_ahead": 4},
                 "observed_counts": False, "policies": ["topk"]}  # our scheduler: the proxy forwards at once
MOMENTS = ("before its body is read", "while it waits for a slot", "the instant it is forwarded", "while it generates")


@pytest.fixture(scope="module", params=["proxy admits", "engine admits"])
def served(request):
    """(engine, proxy app, port): the proxy in front of a stand-in engine running vLLM's own scheduler (the proxy
    admits, 1 slot) or ours (the engine admits: the proxy forwards every request at once)."""
    engine = StandInEngine(ENGINE_ADMITS if request.param == "engine admits" else None)
    with BackendThread(engine) as backend:
        settings = Settings(backends=(backend.url,), port=free_port(), encoder="none",
                            max_in_flight=1 if request.param == "proxy admits" else 0)
        app = create_app(settings)
        with ProxyThread(settings, app):
            yield engine, app, settings.port
    engine.stopped = True


class RawClient:
    """One request on a socket of its own: the test picks the moment its client leaves (`leave`)."""

    def __init__(self, port: int, route: str, name: str, stream: bool) -> None:
        data = json.dumps(body(route, name, stream)).encode()
        self.request = b"POST %s HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\nContent-Length: %d" \
                       b"\r\n\r\n%s" % (ROUTES[route].encode(), len(data), data)
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)

    def send(self, whole: bool = True) -> "RawClient":
        self.sock.sendall(self.request if whole else self.request[: len(self.request) - 10])
        return self

    def leave(self) -> float:
        self.sock.close()
        return time.monotonic()


def waited_for(condition, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("moment", MOMENTS)
def test_a_client_that_leaves_at_any_moment_takes_its_request_with_it(served, moment, route, stream):
    """One request, one client that leaves at `moment`: a request not yet sent never reaches the engine; one sent
    generates nothing past GRACE_S after its client left; the proxy then holds nothing."""
    engine, app, port = served
    if moment == MOMENTS[1] and engine.info is not None:
        pytest.skip("an engine that admits gets every request at once: nothing waits in the proxy")
    name = f"{moment}-{route}-{stream}-{uuid.uuid4().hex[:8]}"  # its own, also when the test is repeated
    client = RawClient(port, route, name, stream)
    blocker = None
    if moment == MOMENTS[0]:
        left = client.send(whole=False).leave()
    elif moment == MOMENTS[1]:
        blocker = RawClient(port, "completion", f"blocker of {name}", True).send()
        waited_for(lambda: f"blocker of {name}" in engine.arrived, "the blocker never reached the engine")
        client.send()
        waited_for(lambda: gauge(app, "cohort_waiting") == 1, "the request never waited for the slot")
        left = client.leave()
        time.sleep(0.05)
        blocker.leave()  # its slot frees just after
    elif moment == MOMENTS[2]:
        client.send()
        waited_for(lambda: name in engine.arrived, "the request never reached the engine", 10.0)
        left = client.leave()
    else:
        client.send()
        waited_for(lambda: engine.count(name)[1] >= 20, "the request never generated", 10.0)
        left = client.leave()
    waited_for(lambda: gauge(app, "cohort_waiting") == 0 and gauge(app, "cohort_in_flight") == 0,
               "the proxy still holds a request whose client left")
    time.sleep(max(0.0, left + GRACE_S + 10 * TOKEN_S - time.monotonic()))  # a request still generating shows
    arrived, late = engine.count(name, after=left + GRACE_S)
    assert (arrived, late) == ((0, 0) if moment in MOMENTS[:2] else (1, 0))
