"""OpenAI Batch input files written in the test and parsed (`parsed`: prompts; `batch_file`: ids), lines for
`cohort batch run` (`request_line`, `write`), and an output file read back (`results`)."""

from __future__ import annotations

import json

from moe_cohort.batch.format import read_batch_file


def parsed(tmp_path, prompts):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                                        "body": {"prompt": p}}) + "\n" for i, p in enumerate(prompts)))
    return read_batch_file(path, default_policy="topk", max_line_bytes=10_000).requests


def batch_file(tmp_path, ids):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"custom_id": i, "method": "POST", "url": "/v1/completions",
                                        "body": {"model": "tiny", "prompt": i, "max_tokens": 2}}) + "\n" for i in ids))
    return read_batch_file(path, default_policy="topk", max_line_bytes=10_000)


def request_line(cid, content, max_tokens=4, url="/v1/chat/completions"):
    body = {"model": "tiny", "max_tokens": max_tokens, "ignore_eos": True}
    body.update({"messages": [{"role": "user", "content": content}]} if "chat" in url else {"prompt": content})
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


def write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def results(path):
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
