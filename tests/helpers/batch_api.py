"""The proxy's Batch API through the official openai client: a request line, a JSONL upload, the settings of a
proxy in front of vLLM, waiting for a batch."""

from __future__ import annotations

import json
import time

from moe_cohort.embedded.vllm_server import free_port
from moe_cohort.send.settings import Settings


def request_line(cid, content, max_tokens=6, **body):
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "tiny", "messages": [{"role": "user", "content": content}],
                                "max_tokens": max_tokens, "ignore_eos": True, **body}})


def jsonl(lines):
    return ("\n".join(lines) + "\n").encode()


def settings(vllm_server, data_dir, **kw):
    base = dict(backends=(vllm_server.url,), port=free_port(), encoder="none", batch_max_in_flight=4,
                data_dir=str(data_dir))
    return Settings(**{**base, **kw})


def wait_for(client, batch_id, statuses=("completed", "failed", "cancelled"), timeout=120, until=None):
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses or (until and until(batch)):
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}: {batch.request_counts}"
        time.sleep(0.2)
