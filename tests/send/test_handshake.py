"""The engine handshake, proxy side: what each replica says it is (send/handshake.py), how the proxy serves it
(send/autoconfig.py), and the running app configured by it, against real throwaway servers
(tests/helpers/vllm_stub.py) that answer as moe-cohort's vLLM would, as a plain vLLM, or badly."""

import asyncio

import httpx
import pytest
from aiohttp import web

from moe_cohort.proxy.app import create_app
from moe_cohort.send.autoconfig import (INSTALL_PLUGIN, TURN_ON_COUNTS, TURN_ON_SCHEDULER, fed, fed_at,
                                        plan_learning, plan_replica)
from moe_cohort.send.backend_client import BackendClient
from moe_cohort.send.handshake import (METRICS, PLAIN, ROUTE, UNREACHABLE, EngineInfo, MalformedInfo, ask,
                                       from_json, from_metrics)
from moe_cohort.send.settings import Settings
from tests.helpers.handshake import AWARE, OURS, PLAIN_VLLM, info, metrics_text
from tests.helpers.vllm_stub import answer, local_backend

CHAT_OK = {"id": "x", "object": "chat.completion", "created": 0, "model": "tiny",
           "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "hi"}}]}


SERIES = dict(schema="1", plugin_version="0.1.0", model="tiny", moe_layers="4", experts="64", top_k="4",
              max_num_seqs="8", expert_aware_scheduler="false", scheduler_base="Scheduler", observed_counts="false",
              policies="topk,xshare")


def engine(info_body=None, metrics="", status=404):
    """A backend: GET /v1/cohort/info answers `info_body` (None: `status`), GET /metrics `metrics`, chats CHAT_OK."""
    async def handler(request):
        if request.path == "/v1/cohort/info":
            if isinstance(info_body, bytes):
                return web.Response(body=info_body, content_type="application/json")
            return answer(info_body) if info_body is not None else answer({"error": "not found"}, status)
        if request.path == "/metrics":
            return web.Response(text=metrics, content_type="text/plain")
        if request.path == "/v1/cohort/observed":
            return answer({"observed": {}}) if info_body is not None else answer({}, 404)
        return answer({} if request.path == "/health" else CHAT_OK)
    return handler


# ---- parsing ---------------------------------------------------------------------------------------------------

def test_the_info_route_is_read_whole():
    got = from_json(info())
    assert got == EngineInfo(ROUTE, 16, (4, 64, 4), True, True, "0.1.0") and got.plugin
    assert from_json(info(moe=None)).moe is None


@pytest.mark.parametrize("body, message", [
    ([], "cohort.engine_info"), (info(object="list"), "cohort.engine_info"), (info(schema=2), "schema 2"),
    (info(max_num_seqs="16"), "max_num_seqs must be a positive integer"), (info(max_num_seqs=0), "max_num_seqs"),
    (info(moe={"layers": 4, "experts": 64}), "moe.top_k"), (info(scheduler=None), "scheduler"),
    (info(observed_counts="yes"), "observed_counts must be true or false"),
])
def test_a_malformed_info_says_what_is_off(body, message):
    with pytest.raises(MalformedInfo, match=message):
        from_json(body)


def test_the_info_series_on_metrics_is_read_and_its_absence_is_none():
    got = from_metrics(metrics_text(**SERIES))
    assert got == EngineInfo(METRICS, 8, (4, 64, 4), False, False, "0.1.0")
    assert from_metrics(metrics_text()) is None
    with pytest.raises(MalformedInfo, match="schema"):
        from_metrics(metrics_text(**{**SERIES, "schema": "9"}))


# ---- asking a replica --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("handler, source, seqs", [
    (engine(info()), ROUTE, 16),
    (engine(None, metrics_text(**SERIES)), METRICS, 8),  # the endpoint plugin not loaded: the general plugin's series
    (engine(None, metrics_text()), PLAIN, None),  # a plain vLLM
    (engine(None, "", status=405), PLAIN, None),
    (engine(b"{not json", metrics_text(**SERIES)), METRICS, 8),  # a broken route: the series still says it
    (engine(info(schema=7), metrics_text()), PLAIN, None),
])
def test_ask_reads_the_route_then_the_series_then_nothing(handler, source, seqs):
    async def main():
        async with local_backend(handler) as url:
            client = BackendClient(url)
            try:
                return await ask(client)
            finally:
                await client.close()
    got = asyncio.run(main())
    assert (got.source, got.max_num_seqs) == (source, seqs)


def test_a_replica_that_is_down_or_hangs_is_unreachable_not_an_error():
    async def hang(request):
        await asyncio.sleep(30)

    async def main():
        down = BackendClient("http://127.0.0.1:9")  # discard port: refused
        async with local_backend(hang) as url:
            slow = BackendClient(url)
            try:
                return await ask(down), await ask(slow, timeout_s=0.3)
            finally:
                await asyncio.gather(down.close(), slow.close())
    assert [i.source for i in asyncio.run(main())] == [UNREACHABLE, UNREACHABLE]


# ---- the plan ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("settings, engine_info, slots, engine_side, could", [
    ({}, AWARE, 256, True, ""),  # our scheduler admits: forward at once
    ({}, EngineInfo(ROUTE, 128, None, True, True), 512, True, ""),  # 4 x max_num_seqs when that is more
    ({}, OURS, 16, False, TURN_ON_SCHEDULER),  # vLLM's scheduler: the proxy holds max_num_seqs and chooses
    ({}, PLAIN_VLLM, 256, False, INSTALL_PLUGIN),  # nothing known: vLLM's default, nothing waits
    ({}, EngineInfo(UNREACHABLE), 256, False, ""),
    ({"max_in_flight": 12}, AWARE, 12, True, ""),  # flags win
    ({"max_in_flight": 12}, PLAIN_VLLM, 12, False, INSTALL_PLUGIN),
    ({"forward_profiles": False}, AWARE, 16, False, ""),
    ({"forward_profiles": True}, OURS, 256, True, ""),
])
def test_each_replica_is_served_by_what_it_said_and_flags_win(settings, engine_info, slots, engine_side, could):
    plan = plan_replica(Settings(**settings), engine_info)
    assert (plan.max_in_flight, plan.engine_side, plan.could) == (slots, engine_side, could)


@pytest.mark.parametrize("settings, infos, on, could", [
    ({}, [AWARE], True, ""), ({}, [PLAIN_VLLM, AWARE], True, ""), ({}, [OURS], False, TURN_ON_COUNTS),
    ({}, [PLAIN_VLLM], False, ""), ({}, [EngineInfo(UNREACHABLE)], None, ""),
    ({"learn": False}, [AWARE], False, ""), ({"learn": True}, [PLAIN_VLLM], True, ""),
    ({"encoder": "none"}, [AWARE], False, ""),
])
def test_learning_is_on_where_a_replica_counts_experts_and_flags_win(settings, infos, on, could):
    plan = plan_learning(Settings(**settings), infos)
    assert (plan.on, plan.could) == (on, could)


def test_engines_are_fed_from_their_slots_and_a_short_queue_each():
    """A request waits for its prediction only from fed_at requests at the backends (send/gate.py): every engine's
    max_num_seqs and a queue of its own (a quarter more, at least 2); an engine that does not say adds nothing."""
    assert [fed(s) for s in (1, 8, 16, 64)] == [3, 10, 20, 80]
    assert fed_at([AWARE, EngineInfo(ROUTE, 64, None, True, True)]) == 20 + 80
    assert fed_at([AWARE, PLAIN_VLLM, EngineInfo(UNREACHABLE)]) == 20 and fed_at([PLAIN_VLLM]) == 0


# ---- the running proxy -------------------------------------------------------------------------------------------

async def _health(app, headers=None) -> dict:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as client:
        return (await client.get("/health", headers=headers)).json()


def test_replicas_that_disagree_each_get_what_they_support(tmp_path):
    async def main():
        async with local_backend(engine(info(max_num_seqs=8))) as ours, local_backend(engine(None, metrics_text())) as plain:
            app = create_app(Settings(backends=(ours, plain), encoder="none", data_dir=str(tmp_path)))
            async with app.router.lifespan_context(app):
                proxy = app.state.proxy
                return proxy.replicas.router.capacity.tolist(), proxy.gate.profile_first, await _health(app)
    capacity, profile_first, health = asyncio.run(main())
    assert capacity == [256, 256] and profile_first  # engine side (4 x 8 < 256), and nothing known
    replicas = health["configuration"]["replicas"]
    assert [r["admission"] for r in replicas] == ["engine", "proxy"] and replicas[1]["could"] == INSTALL_PLUGIN
    assert health["configuration"]["learning"]["on"] is False  # --encoder none


def test_a_replica_is_asked_again_when_it_answers_and_learning_is_decided_then(tmp_path, monkeypatch):
    import moe_cohort.proxy.app

    monkeypatch.setattr(moe_cohort.proxy.app, "HEALTH_EVERY_S", 0.05)
    said = {"info": None, "metrics": metrics_text(**SERIES)}  # first the general plugin's series alone, 8 slots

    async def changing(request):
        return await engine(said["info"], said["metrics"])(request)

    async def main():
        async with local_backend(changing) as url:
            app = create_app(Settings(backends=(url,), data_dir=str(tmp_path)))  # the default encoder, learning auto
            async with app.router.lifespan_context(app):
                proxy = app.state.proxy
                first = (proxy.replicas.router.capacity.tolist(), proxy.learning.on, proxy.predictor.mode())
                proxy.engines[0] = EngineInfo(UNREACHABLE)  # as after a restart: asked again by the watcher
                said["info"] = info(max_num_seqs=8, expert_aware=False, observed=True)
                for _ in range(200):
                    if proxy.engines[0].source == ROUTE:
                        break
                    await asyncio.sleep(0.05)
                return first, proxy.replicas.router.capacity.tolist(), proxy.learning.on
    first, capacity, learning = asyncio.run(main())
    assert first == ([8], False, "embeddings")  # the plugin without the counts route: no learning, embeddings
    assert capacity == [8] and learning is False  # learning was decided once; slots follow the new answer


def test_learning_on_is_first_come_first_served_until_its_first_head(tmp_path):
    async def main():
        async with local_backend(engine(info(max_num_seqs=4, expert_aware=False))) as url:
            app = create_app(Settings(backends=(url,), data_dir=str(tmp_path)))
            async with app.router.lifespan_context(app):
                proxy = app.state.proxy
                return proxy.learning.on, proxy.predictor.ready(), proxy.predictor.mode(), await _health(app)
    on, ready, mode, health = asyncio.run(main())
    assert on and not ready and mode.startswith("first come, first served")
    assert health["admission"]["learning"]["observed"] == 0


def test_a_keyed_proxy_protecting_its_metrics_shows_callers_without_a_key_only_its_status(tmp_path):
    async def main():
        async with local_backend(engine(info())) as url:
            app = create_app(Settings(backends=(url,), encoder="none", api_keys=("k",), protect_metrics=True,
                                      data_dir=str(tmp_path)))
            async with app.router.lifespan_context(app):
                return await _health(app), await _health(app, {"authorization": "Bearer k"})
    anonymous, keyed = asyncio.run(main())
    assert anonymous == {"status": "ok"}
    assert keyed["replicas"][0]["backend"].startswith("http://127.0.0.1:") and keyed["admission"]
    assert keyed["configuration"]["replicas"][0]["admission"] == "engine"


def test_the_fairness_bound_is_three_rounds_of_the_smallest_replica_admitting_in_the_proxy():
    from moe_cohort.send.autoconfig import ReplicaPlan, passed_bound

    engine, proxy8, proxy16 = ReplicaPlan(256, True, ""), ReplicaPlan(8, False, ""), ReplicaPlan(16, False, "")
    assert passed_bound([engine, proxy16, proxy8]) == 24 and passed_bound([engine]) == 768


def test_a_batch_in_front_of_an_engine_that_prefills_ahead_goes_in_file_order_without_probe_or_learning():
    from moe_cohort.send.autoconfig import plan_batch

    ahead = EngineInfo(ROUTE, 16, (4, 64, 4), True, True, prefill_ahead=16)
    plan = plan_batch(Settings(), ["http://e"], [ahead], local=True)
    assert (plan.probe, plan.learn, plan.engine_orders, plan.max_in_flight) == (False, False, True, 48)  # 2 x 16 + 16
    assert "no probe" in plan.line and "prefills 16 ahead" in plan.line
    asked = plan_batch(Settings(learn=True), ["http://e"], [ahead], local=True)
    assert asked.learn and not asked.engine_orders  # learning reads the encoder: the run keeps its predictor
    probed = plan_batch(Settings(batch_probe=True), ["http://e"], [ahead], local=True)
    assert probed.probe and not probed.engine_orders
    today = plan_batch(Settings(), ["http://e"], [AWARE], local=True)
    assert today.probe and not today.engine_orders and today.max_in_flight == 32
    assert from_json({"object": "cohort.engine_info", "schema": 1, "max_num_seqs": 16, "moe": None, "observed_counts": True,
                      "scheduler": {"expert_aware": True, "prefill_ahead": 16}}).prefill_ahead == 16
