"""Batch file validation (line numbers, duplicates, oversized lines) and the journal's crash recovery."""

import json

import pytest

from moe_cohort.batch.format import read_batch_file, result_line


def line(cid, content="hi", url="/v1/chat/completions", **extra):
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    if url == "/v1/completions":
        body = {"model": "tiny", "prompt": content, "max_tokens": 4}
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body, **extra})


def write(tmp_path, lines, name="in.jsonl"):
    path = tmp_path / name
    path.write_bytes(b"".join((ln.encode() if isinstance(ln, str) else ln) + b"\n" for ln in lines))
    return path


def read(path, **kw):
    return read_batch_file(path, default_policy=kw.pop("policy", "topk"), max_line_bytes=kw.pop("max_bytes", 10_000), **kw)


def test_valid_lines_keep_numbers_policy_and_text(tmp_path):
    body = json.loads(line("c"))["body"] | {"vllm_xargs": {"moe_routing": "oea;k0=1"}}
    path = write(tmp_path, [line("a", "first"), "", line("b", "second", url="/v1/completions"),
                            json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": body})])
    parsed = read(path, policy="xshare;m=8")
    assert [(r.line, r.custom_id, r.text) for r in parsed.requests] == [(1, "a", "first"), (3, "b", "second"), (4, "c", "hi")]
    assert parsed.requests[0].policy.startswith("xshare") and parsed.requests[2].policy.startswith("oea")
    assert parsed.requests[0].body["vllm_xargs"]["moe_routing"] == parsed.requests[0].policy
    assert all(r.body["vllm_xargs"]["moe_batch"] == 1 for r in parsed.requests)  # no fairness bound at the engine
    assert not parsed.errors and parsed.lines == 4 and parsed.size == path.stat().st_size and len(parsed.sha256) == 64


def test_every_bad_line_is_reported_with_its_number(tmp_path):
    lines = [
        line("a"),
        "{oops",                                                          # 2 not JSON
        line("a", "again"),                                               # 3 duplicate
        json.dumps({"custom_id": "m", "method": "GET", "url": "/v1/completions", "body": {}}),  # 4 method
        line("u", url="/v1/embeddings"),                                  # 5 url
        json.dumps({"custom_id": 7, "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}),  # 6 id
        json.dumps({"custom_id": "s", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"messages": [{"role": "user", "content": "x"}], "stream": True}}),  # 7 stream
        json.dumps({"custom_id": "e", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": []}}),  # 8
        line("p", **{}).replace('"max_tokens": 4', '"max_tokens": 4, "vllm_xargs": {"moe_routing": "xshare;m=zero"}'),  # 9
        b'{"custom_id": "\xff"}',                                         # 10 not UTF-8
        line("big", "x" * 20_000),                                        # 11 oversized
        line("z"),
    ]
    parsed = read(write(tmp_path, lines))
    assert [r.custom_id for r in parsed.requests] == ["a", "z"]
    messages = {e.line: e.message for e in parsed.errors}
    assert sorted(messages) == list(range(2, 12))
    assert all(m.startswith(f"line {n}: ") for n, m in messages.items())
    assert "invalid JSON" in messages[2]
    assert 'duplicate custom_id "a" (first on line 1)' in messages[3]
    assert "'method' must be \"POST\"" in messages[4]
    assert 'unsupported url "/v1/embeddings"' in messages[5]
    assert "'custom_id' must be a non-empty string" in messages[6]
    assert "'stream' is not supported" in messages[7]
    assert "'messages' must be a non-empty list" in messages[8]
    assert "invalid routing policy 'xshare;m=zero'" in messages[9]
    assert "not valid UTF-8" in messages[10]
    assert "over the limit of 10000 bytes per line" in messages[11]
    assert {e.line: e.custom_id for e in parsed.errors}[3] == "a"


def test_oversized_line_without_newline_at_end_of_file(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes((line("a") + "\n" + line("b", "y" * 50_000)).encode())
    parsed = read(path)
    assert [r.custom_id for r in parsed.requests] == ["a"]
    assert parsed.errors[0].line == 2 and "over the limit" in parsed.errors[0].message
    assert parsed.size == path.stat().st_size


def test_result_line_schema_and_backend_error_message():
    from moe_cohort.batch.format import BatchRequest

    req = BatchRequest(1, "x", "/v1/completions", {}, "topk", "")
    ok = result_line(req, "req_1", 200, {"id": "cmpl", "choices": []})
    assert set(ok) == {"id", "custom_id", "response", "error"} and ok["error"] is None
    assert ok["response"] == {"status_code": 200, "request_id": "req_1", "body": {"id": "cmpl", "choices": []}}
    bad = result_line(req, "req_2", 400, {"error": {"message": "too long", "type": "BadRequestError", "code": 400}})
    assert bad["error"] == {"code": "400", "message": "too long"} and bad["response"]["status_code"] == 400


def test_a_policy_of_the_wrong_type_is_an_error_of_its_line(tmp_path):
    lines = [json.dumps({"custom_id": c, "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": "hi", "vllm_xargs": {"moe_routing": routing}}})
             for c, routing in (("a", ["xshare"]), ("b", "oea;k0=1"), ("c", 7))]
    parsed = read(write(tmp_path, lines))
    assert [r.custom_id for r in parsed.requests] == ["b"]
    assert [e.message for e in parsed.errors] == [
        'line 1: vllm_xargs.moe_routing must be a string such as "xshare;m=24", got list [\'xshare\']',
        'line 3: vllm_xargs.moe_routing must be a string such as "xshare;m=24", got int 7']


@pytest.mark.parametrize("text, where", [
    (line("a")[:-1], f"at column {len(line('a'))} (the end of the line)"),  # the closing brace is missing
    ('{"custom_id": oops}', "Expecting value at column 15"),
    ('{"custom_id": "a",}  ', "at column 19"),
])
def test_invalid_json_names_the_column_where_it_went_wrong(tmp_path, text, where):
    (error,) = read(write(tmp_path, [text])).errors
    assert error.message.startswith("line 1: invalid JSON (") and where in error.message, error.message
