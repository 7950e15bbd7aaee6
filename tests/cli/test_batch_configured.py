"""`cohort batch run --backend URL` configures itself from the engine's handshake, as `cohort serve` does
(send/autoconfig.plan_batch): the slots, whether it learns; flags win (and forward profiles when asked).
The engines are stand-ins on real sockets that answer the handshake as moe-cohort's vLLM would (with and without
our scheduler, with and without the expert counts), or as a plain vLLM; the learning one counts experts as our
plugin does (tests/helpers/plugin_vllm.py)."""

import asyncio
import json

import pytest

from moe_cohort.admission.wire import OBSERVE_KEY, PROFILE_KEY
from moe_cohort.cli import main
from moe_cohort.send.autoconfig import BatchPlan, plan_batch
from moe_cohort.send.handshake import EngineInfo
from moe_cohort.send.settings import Settings
from tests.helpers.encoders import encoder  # noqa: F401 (a fixture)
from tests.helpers.handshake import AWARE, OURS, PLAIN_VLLM, info, metrics_text
from tests.helpers.plugin_vllm import plugin_backend, topic_prompt
from tests.helpers.vllm_stub import BackendThread, answer, body_of

LINES = 40


@pytest.mark.parametrize("settings, infos, slots, forward, learn", [
    ({}, [AWARE], 32, False, True),  # max_num_seqs + a queue as deep, chosen in the proxy; learning on counts
    ({}, [OURS], 32, False, False),  # vLLM's scheduler, no counts: the same slots, nothing learned
    ({}, [PLAIN_VLLM], 256, False, False),  # nothing known: vLLM's default
    ({}, [EngineInfo(AWARE.source, 1, None, True, True)], 2, False, True),  # one slot, one queued
    ({}, [AWARE, EngineInfo(AWARE.source, 8, None, True, True)], 16, False, True),  # the smallest replica's
    ({"batch_max_in_flight": 8}, [AWARE], 8, False, True),  # flags win
    ({"max_in_flight": 12}, [AWARE], 12, False, True),
    ({"forward_profiles": True, "learn": False}, [AWARE], 32, True, False),
    ({"encoder": "none"}, [AWARE], 32, False, False),
])
def test_a_batch_is_planned_by_what_its_engines_said_and_flags_win(settings, infos, slots, forward, learn):
    plan = plan_batch(Settings(**settings), ["http://a"] * len(infos), infos)
    assert isinstance(plan, BatchPlan) and (plan.max_in_flight, plan.forward_profiles, plan.learn) == (slots, forward, learn)


@pytest.mark.parametrize("settings, infos, probe", [
    ({}, [AWARE], True),  # the engine serves its expert counts: each prompt probed
    ({}, [AWARE, EngineInfo(AWARE.source, 8, None, True, True)], True),
    ({}, [OURS], False),  # no counts to probe with
    ({}, [AWARE, OURS], False),
    ({}, [PLAIN_VLLM], False),
    ({"encoder": "none"}, [AWARE], False),  # the file's order, nothing probed
    ({"batch_probe": False}, [AWARE], False),  # flags win
    ({"batch_probe": True}, [OURS], True),
])
def test_a_batch_probes_its_prompts_where_the_engine_counts_experts(settings, infos, probe):
    plan = plan_batch(Settings(**settings), ["http://a"] * len(infos), infos, local=True)
    assert plan.probe is probe
    assert not plan_batch(Settings(**settings), ["http://a"] * len(infos), infos).probe  # the Batch API's never


@pytest.mark.parametrize("learn, learns", [(None, False), (True, True), (False, False)])
def test_a_run_that_probes_learns_only_when_asked(learn, learns):
    plan = plan_batch(Settings(learn=learn), ["http://a"], [AWARE], local=True)
    assert plan.probe and plan.learn is learns
    assert ("learning off: the engine's routing orders the lines" in plan.line) is (learn is None)


def _engine(info_body, metrics, bodies: list, counting: bool, latency_s: float = 0.02):
    """A stand-in vLLM: the handshake from `info_body` (None: 404) and `metrics`; chats answered after a while
    (so that requests overlap), their bodies and the most at once recorded; expert counts when `counting`."""
    tokens, out = [], {"now": 0, "most": 0}
    plugin = plugin_backend(tokens)

    async def handler(request):
        if request.path == "/v1/cohort/info":
            return answer(info_body) if info_body is not None else answer({"error": "not found"}, 404)
        if request.path == "/metrics":
            from aiohttp import web

            return web.Response(text=metrics, content_type="text/plain")
        if request.path == "/v1/cohort/observed" and not counting:
            return answer({}, 404)
        if request.path == "/v1/chat/completions":
            bodies.append(await body_of(request))
            out["now"] += 1
            out["most"] = max(out["most"], out["now"])
            await asyncio.sleep(latency_s * (1 + len(bodies) % 3 / 2))
            out["now"] -= 1
        return await plugin(request)
    return handler, out


def _marked_or_profiled(bodies) -> bool:
    return any(OBSERVE_KEY in b.get("vllm_xargs", {}) or PROFILE_KEY in b.get("vllm_xargs", {}) for b in bodies)


def _run(tmp_path, capsys, handler, *flags, lines: int = LINES) -> str:
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                                       "body": {"model": "tiny",
                                                "messages": [{"role": "user", "content": topic_prompt(i)}]}})
                           + "\n" for i in range(lines)))
    with BackendThread(handler) as engine:
        code = main(["batch", "run", "--input", str(src), "--output", str(tmp_path / "out.jsonl"), "--backend",
                     engine.url, "--data-dir", str(tmp_path / "data"), "--no-progress", *flags])
    err = capsys.readouterr().err
    assert code == 0, err
    assert sorted(json.loads(x)["custom_id"] for x in (tmp_path / "out.jsonl").read_text().splitlines()) == \
        sorted(f"c{i}" for i in range(lines))  # every line answered once
    return err


def test_where_vllm_counts_experts_it_keeps_a_short_queue_and_learns(encoder, tmp_path, capsys):
    bodies = []
    handler, out = _engine(info(max_num_seqs=4), "", bodies, counting=True)
    err = _run(tmp_path, capsys, handler, "--encoder", encoder, "--no-probe")
    assert "chosen from the whole file in the proxy, 8 at a time (4 for its max_num_seqs and a queue of 4)" in err
    assert "learning on: vLLM serves its expert counts" in err
    assert out["most"] == 8  # 4 slots + a queue as deep
    assert sum(OBSERVE_KEY in b.get("vllm_xargs", {}) for b in bodies) == LINES  # each counted (the reservoir keeps all)
    assert not any(PROFILE_KEY in b.get("vllm_xargs", {}) for b in bodies)  # no profile unless asked
    assert "learned: 40 observed requests" in err


def test_forward_profiles_sends_each_line_its_predicted_profile_once_there_is_a_head(encoder, tmp_path, capsys):
    bodies = []
    handler, out = _engine(info(max_num_seqs=4), "", bodies, counting=True, latency_s=0.1)
    err = _run(tmp_path, capsys, handler, "--encoder", encoder, "--forward-profiles", "--no-probe", lines=80)
    assert "with predicted profiles (--forward-profiles)" in err
    profiled = [i for i, b in enumerate(bodies) if PROFILE_KEY in b.get("vllm_xargs", {})]
    assert profiled and min(profiled) >= 16 and len(profiled) >= 20  # after the sample (16 observed), profiles


def test_a_plain_vllm_gets_proxy_admission_on_its_default_slots_and_no_learning(encoder, tmp_path, capsys):
    bodies = []
    handler, out = _engine(None, metrics_text(), bodies, counting=False)
    err = _run(tmp_path, capsys, handler, "--encoder", encoder)
    assert "no moe-cohort plugin: each line chosen from the whole file in the proxy, 256 at a time: its " \
        "max_num_seqs unknown" in err and "learning off" in err
    assert not _marked_or_profiled(bodies)  # nothing marked, no profile sent
    assert "learned:" not in err


def test_vllms_own_scheduler_without_counts_gets_max_num_seqs_in_the_proxy(encoder, tmp_path, capsys):
    bodies = []
    handler, out = _engine(info(max_num_seqs=4, expert_aware=False, observed=False), "", bodies, counting=False)
    err = _run(tmp_path, capsys, handler, "--encoder", encoder)
    assert "8 at a time (4 for its max_num_seqs and a queue of 4)" in err
    assert "learning off: vLLM does not serve its expert counts" in err
    assert out["most"] == 8 and not _marked_or_profiled(bodies)


def test_flags_win_over_the_handshake(encoder, tmp_path, capsys):
    bodies = []
    handler, out = _engine(info(max_num_seqs=4), "", bodies, counting=True)
    err = _run(tmp_path, capsys, handler, "--encoder", encoder, "--max-in-flight", "3", "--no-learn", "--no-probe")
    assert "3 at a time (--max-in-flight)" in err and "learning off (--no-learn)" in err
    assert out["most"] == 3 and not _marked_or_profiled(bodies)
