"""Batch output and error files: one line per record whatever separators the answers hold."""

from __future__ import annotations

import json
import time

from moe_cohort.embedded.vllm_server import free_port
from moe_cohort.send.settings import Settings
from tests.proxy.servers import SEPARATORS, EchoBackend, ProxyThread


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
    with EchoBackend() as backend, ProxyThread(Settings(backends=(backend.url,), port=free_port(), encoder="none",
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
