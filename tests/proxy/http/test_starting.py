"""`cohort serve` listens while its encoder is prepared (issue 27 item 10): the app it runs
(proxy/http/starting.py) under uvicorn, with the default static encoder whose cache folder another
process is still distilling (the test holds the lock, as that process would): /health answers 503
"not ready", a completion 503 in the OpenAI error shape; once the folder is there and the lock is
released, the proxy loads it (it distils nothing) and answers."""

import asyncio
import fcntl
import logging

import httpx
import numpy as np
import openai
import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from moe_cohort.embedded.vllm_server import free_port
from moe_cohort.encoder.embedding import resolve_model
from moe_cohort.encoder.static import save_static, static_path
from moe_cohort.proxy.app import create_app
from moe_cohort.proxy.http.starting import Starting
from moe_cohort.send.settings import Settings
from tests.helpers.proxy_thread import ProxyThread
from tests.helpers.vllm_stub import answer, local_backend

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello world"}], "max_tokens": 1}
OK = {"id": "x", "object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}]}


def tiny_static_model(out):
    """A real static encoder (a word-level tokenizer, random vectors), as `distill` would leave it."""
    words = ["[UNK]", "hello", "world", "sort", "list", "pizza"]
    tokenizer = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    save_static(tokenizer, np.random.default_rng(0).normal(size=(len(words), 8)).astype(np.float32), out)


def test_health_is_503_not_ready_while_the_encoder_is_prepared_then_the_proxy_serves(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("COHORT_CACHE_DIR", str(tmp_path / "cache"))
    folder = static_path(resolve_model(None))  # where `--encoder static` (the default) is distilled
    folder.parent.mkdir(parents=True)
    waiting = asyncio.Event()

    async def backend(request):
        return answer(OK)

    async def main():
        loop = asyncio.get_running_loop()

        class Waiting(logging.Handler):
            def emit(self, record):
                if "waiting for it" in record.getMessage():
                    loop.call_soon_threadsafe(waiting.set)

        handler = Waiting()
        logging.getLogger("moe_cohort.encoder.static").addHandler(handler)
        ready = asyncio.Event()
        try:
            async with local_backend(backend) as url:
                settings = Settings(backends=(url,), port=free_port(), encoder="static", data_dir=str(tmp_path))
                app = Starting(lambda: create_app(settings), on_ready=lambda: loop.call_soon_threadsafe(ready.set))
                with open(folder.parent / f".{folder.name}.lock", "a") as lock:
                    fcntl.flock(lock, fcntl.LOCK_EX)  # another process distils: the proxy must wait for it
                    with ProxyThread(settings, app) as proxy:
                        return await exchange(proxy, lock, ready)
        finally:
            logging.getLogger("moe_cohort.encoder.static").removeHandler(handler)

    async def exchange(proxy, lock, ready):
        async with httpx.AsyncClient(base_url=proxy.url) as http:
            await asyncio.wait_for(waiting.wait(), 60)  # the proxy's build waits on the lock
            health = await http.get("/health")
            client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0)
            with pytest.raises(openai.APIStatusError) as refused:
                await client.chat.completions.create(**CHAT)
            tiny_static_model(folder)  # the other process finishes...
            fcntl.flock(lock, fcntl.LOCK_UN)  # ...and lets go
            await asyncio.wait_for(ready.wait(), 60)
            after = await http.get("/health")
            served = await client.chat.completions.create(**CHAT)
            return health, refused.value, after, served

    with caplog.at_level(logging.WARNING, logger="moe_cohort.encoder.static"):
        health, refused, after, served = asyncio.run(main())
    assert health.status_code == 503 and health.json() == {"status": "not ready", "detail": "loading the encoder"}
    assert health.headers["retry-after"] == "5"
    assert refused.status_code == 503 and refused.body["code"] == "not_ready"
    assert refused.body["type"] == "service_unavailable" and "the proxy is starting" in refused.body["message"]
    assert after.status_code == 200 and after.json()["status"] == "ok"
    assert served.choices[0].message.content == "hi"
    assert not any("distilling it from" in r.getMessage() for r in caplog.records)  # it reused the other's folder
