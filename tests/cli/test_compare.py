"""`cohort compare` (cli/compare.py): end to end against a real vLLM with the plugin and a real `cohort serve`;
its one-line errors against throwaway servers."""

import asyncio
import math
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest
from aiohttp import web

from moe_cohort.cli import main
from moe_cohort.embedded.vllm_server import free_port
from tests.helpers.vllm_stub import answer, local_backend

PER_TOKEN = re.compile(r"(\S+) decode expert loads per generated token, +(\S+) decode tokens per forward")


def _compare(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = main(["compare", *argv])
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _not_vllm(health: dict):
    """A server that answers like a proxy (its /health says `health`, the server's own address as its one replica
    when it says "self") and like a vLLM without the plugin: an empty /metrics, no /v1/cohort/info."""
    async def handler(request: web.BaseRequest) -> web.StreamResponse:
        if request.path == "/health":
            return answer({k: [{"backend": f"http://{request.host}"}] if v == "self" else v for k, v in health.items()})
        if request.path == "/v1/models":
            return answer({"object": "list", "data": [{"id": "tiny", "object": "model"}]})
        if request.path == "/metrics":
            return web.Response(text="", content_type="text/plain")
        if request.method == "POST" and request.path == "/v1/chat/completions":
            return answer({"object": "chat.completion", "choices": [{"index": 0, "message": {"content": "hi"}}]})
        return answer({"error": {"message": "not found"}}, 404)
    return handler


@pytest.mark.parametrize("health, said", [
    ({"status": "ok", "replicas": "self"}, "shows no moe-cohort plugin counters on /metrics: install moe-cohort in "
                                          "vLLM's environment"),
    ({"status": "ok"}, "pass --backend URL, the vLLM server to measure"),
])
def test_a_backend_without_the_plugin_or_unknown_is_one_line_and_exit_2(health, said, capsys):
    async def go():
        async with local_backend(_not_vllm(health)) as url:
            return await asyncio.to_thread(_compare, ["--proxy", url, "--learn-requests", "0", "--requests", "2"],
                                           capsys)

    code, out, err = asyncio.run(go())
    assert code == 2 and said in err and len(err.strip().splitlines()) == 1, (out, err)
    assert "decode expert loads" not in out  # nothing was measured


def test_a_backend_whose_metrics_cannot_be_read_is_named_in_one_line(capsys):
    backend = f"http://127.0.0.1:{free_port()}"  # nothing listens there

    async def go():
        async with local_backend(_not_vllm({"status": "ok"})) as url:
            return await asyncio.to_thread(_compare, ["--proxy", url, "--backend", backend, "--learn-requests", "0"],
                                           capsys)

    code, out, err = asyncio.run(go())
    assert code == 2 and len(err.strip().splitlines()) == 1, (out, err)
    assert f"cannot read {backend}/metrics (" in err and "): is --backend the vLLM server?" in err, err


def test_each_round_takes_the_next_held_out_prompts_and_cycles_only_when_they_run_out():
    from moe_cohort.cli.compare import round_prompts

    assert round_prompts(list("abcdef"), 2, 3) == [list("ab"), list("cd"), list("ef")]
    assert round_prompts(list("abcde"), 2, 3) == [list("ab"), list("cd"), list("ea")]


def test_no_proxy_at_the_address_is_one_line(capsys):
    code, out, err = _compare(["--proxy", f"http://127.0.0.1:{free_port()}"], capsys)
    assert code == 2 and "no proxy answers at" in err and "start `cohort serve` first" in err, err


@pytest.mark.integration
def test_compare_measures_fcfs_and_admission_through_a_real_proxy(vllm_server, tmp_path, capsys):
    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proxy = subprocess.Popen([sys.executable, "-m", "moe_cohort.cli", "serve", "--backend", vllm_server.url,
                                  "--port", str(port), "--learn", "--data-dir", str(tmp_path / "data"),
                                  "--max-in-flight", "4"],
                                 stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240
        while not _ok(url + "/health"):
            assert proxy.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        code, out, err = _compare(["--proxy", url, "--learn-requests", "16", "--requests", "16", "--rounds", "1",
                                   "--clients", "8", "--max-tokens", "8"], capsys)
    finally:
        proxy.send_signal(signal.SIGINT)
        proxy.wait(60)
    assert code == 0, (out, err)
    assert f"backend {vllm_server.url}" in out and "learning {" in out, out  # found through /health; it learned
    figures = PER_TOKEN.findall(out)
    assert len(figures) == 2, out  # first come, first served, then admission
    for per_token, tokens_per_forward in figures:  # 8 clients: at most 8 tokens per forward
        assert 0 < float(per_token) < math.inf and 0 < float(tokens_per_forward) <= 8, out
    assert "admission against first come, first served:" in out and "per generated token saved" in out


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_the_direct_run_asks_the_engine_for_arrival_order_and_the_proxys_run_does_not():
    """Our scheduler orders what it holds by each prompt's routing; the baseline must not be ordered so."""
    from moe_cohort.cli.compare import Target, _send

    seen = []

    async def record(request: web.BaseRequest) -> web.StreamResponse:
        seen.append((request.host, (await request.json()).get("vllm_xargs")))
        return answer({"object": "chat.completion", "choices": [{"index": 0, "message": {"content": "hi"}}]})

    async def main_():
        async with local_backend(record) as backend, local_backend(record) as proxy:
            target = Target(proxy=proxy, backend=backend, model="tiny")
            await _send(target, backend, ["a", "b"], 2, 4)
            await _send(target, proxy, ["c"], 1, 4)
            return backend.removeprefix("http://")

    host = asyncio.run(main_())
    assert [x for h, x in seen if h == host] == [{"moe_fcfs": 1}] * 2 and [x for h, x in seen if h != host] == [None]
